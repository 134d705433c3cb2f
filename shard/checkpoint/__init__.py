"""Checkpoints: safetensors shards written by each rank plus a JSON index written last.

    from soapstone.shard.checkpoint import save, resume, load_params
    save(executor, "ckpt", step=3, seed=0, settings={...}, keep=2)   # collective
    resume(executor, "ckpt")            # latest complete checkpoint, any saved layout
    load_params(executor, "model.safetensors")   # weights only: a file or a checkpoint dir

index.py (format, torch-free), boxes.py (region algebra), holdings.py (what a rank holds),
tensorfile.py (safetensors writer and box reader), save.py, load.py, export.py.
"""

from soapstone.shard.checkpoint.index import CheckpointError, find, read
from soapstone.shard.checkpoint.load import load_params, resume
from soapstone.shard.checkpoint.save import save

__all__ = ["CheckpointError", "find", "load_params", "read", "resume", "save"]
