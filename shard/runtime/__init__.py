"""Running a plan on one rank: the executor, the sharded model, fusion, traces."""

from soapstone.comm import moved

# ShardedModel and its helpers, as `soapstone.shard.runtime` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "sharded_model")
