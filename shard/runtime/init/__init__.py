"""A parameter's initial values, drawn for a rank's shard from a counter-based generator."""
