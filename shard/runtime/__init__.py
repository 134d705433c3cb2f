"""Running a plan on one rank: the executor, the sharded model, fusion, traces; init/ draws
the initial parameters."""

from soapstone.comm import moved

# ShardedModel and its helpers, as `soapstone.shard.runtime` (a module before 0.2) had them; the
# modules that moved into init/ keep their old paths for a release, with a DeprecationWarning
__getattr__ = moved.keep_old_paths(__name__, {
    "counter_rng": "init.counter_rng",
    "param_init": "init.param_init",
}, names=moved.names_from(__name__, "sharded_model"))
