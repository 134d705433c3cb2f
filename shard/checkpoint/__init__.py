"""Checkpoints: safetensors shards written by each rank plus a JSON index with their checksums.

    from soapstone.shard.checkpoint import save, resume, load_params
    save(executor, "ckpt", step=3, seed=0, settings={...}, keep=2)   # collective
    resume(executor, "ckpt")            # newest usable checkpoint, any saved layout
    load_params(executor, "model.safetensors")   # weights only: a file or a checkpoint dir

Torch-free: index.py (format, finding checkpoints), schema.py (the typed, checked index),
checksum.py (CRC-32 per chunk), verify.py (files against the index, checked reads),
durable.py (atomic publish), boxes.py (region algebra). With torch: holdings.py (what a rank
holds), tensorfile.py (safetensors writer and box reader), agree.py (one verdict for every
rank), save.py, load.py.
"""

from soapstone.shard.checkpoint.index import CheckpointError, find, read

try:
    import torch  # noqa: F401
except ImportError:  # the torch-free modules still import (`ckpt verify`, `ckpt inspect`)
    pass
else:
    from soapstone.shard.checkpoint.load import load_params, resume
    from soapstone.shard.checkpoint.save import save

__all__ = ["CheckpointError", "find", "load_params", "read", "resume", "save"]
