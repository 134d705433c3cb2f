"""Watching the collectives: flight recorder, watchdog, diagnosis, argument checks."""
