"""The primitive ops: one record each (doc, sharding rule, distributed statistics, costs,
saves, fusion eligibility, kernel); registry.py lists them, kernels.py is what kernels run in;
loss/ holds cross_entropy, positions/ rope and the causal mask."""

from soapstone.comm import moved

# the kernels' names, as `soapstone.shard.ops` (a module before 0.2) had them; the modules that
# moved into loss/ and positions/ keep their old paths for a release, with a DeprecationWarning
__getattr__ = moved.keep_old_paths(__name__, {
    "cross_entropy": "loss.cross_entropy",
    "loss_kernels": "loss.loss_kernels",
    "masks": "positions.masks",
    "rope": "positions.rope",
}, names=moved.names_from(__name__, "kernels"))
