"""The primitive ops: one record each (sharding, kernel, costs)."""

from soapstone.comm import moved

# the kernels' names, as `soapstone.shard.ops` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "kernels")
