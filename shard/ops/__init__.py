"""The primitive ops: one record each (doc, sharding rule, distributed statistics, costs,
saves, fusion eligibility, kernel); registry.py lists them, kernels.py is what kernels run in."""

from soapstone.comm import moved

# the kernels' names, as `soapstone.shard.ops` (a module before 0.2) had them
__getattr__ = moved.names_from(__name__, "kernels")
