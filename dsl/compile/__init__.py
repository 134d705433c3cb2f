"""The compiler: IR -> Program and StageGraph (lower, stages, sharding rules, proofs)."""
