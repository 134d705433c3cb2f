"""Load a checkpoint into an executor of any layout of the same model, resharding on the fly.

Each rank asks, for each parameter share it holds (holdings.py: its boxes of the global
tensor), the saved pieces that overlap them, and reads only those bytes (safetensors
get_slice). The saved layout and this one are independent: tp2 with ZeRO-1 loads into dp2 with
ZeRO-3, a pipeline, or one rank, because both sides are boxes of the same global tensors.

    resume(executor, "ckpt")          # parameters, fp32 masters, optimizer state and its step
    load_params(executor, "ckpt")     # parameters only: a checkpoint dir or a full
    load_params(executor, "w.safetensors")  #   safetensors file (name -> full tensor)
"""

from __future__ import annotations

from pathlib import Path

from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint.holdings import holdings
from soapstone.shard.checkpoint.tensorfile import CODE_OF_NAME, Reader


def model_params(executor) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every parameter of the executor's model: name -> (dims, global shape)."""
    return {p.name: (p.dims, p.shape) for s in executor.graph.stages
            for p in s.program.params}


def resume(executor, path: str | Path) -> dict:
    """Load parameters, masters, optimizer state and step count from the checkpoint `path`
    names (a step dir, or the latest complete one under a --save DIR); its index, with
    "dir" and "skipped" (partial saves passed over) added. Collective."""
    d, partial = ix.find(path)
    index = ix.read(d)
    ix.check_model(index, str(d), executor.graph.model, model_params(executor))
    from soapstone.shard.checkpoint.save import optimizer_name

    name = optimizer_name(executor)
    saved = index["optimizer"]["name"]
    if name is not None and saved != name:
        raise ix.CheckpointError(f"checkpoint {d}: saved with optimizer {saved}, this run uses "
                                 f"{name}; resume with --optimizer {saved}, or start from its "
                                 f"weights alone with --init {d}")
    kinds = ("param", *ix.OPTIMIZER_KINDS.get(name, ())) if name else ("param",)
    _fill(executor, Reader(d, index), kinds)
    for opt in executor.optimizers.values():
        opt.steps = index["optimizer"]["steps"]
    return index | {"dir": str(d), "skipped": [str(p) for p in partial]}


def load_params(executor, source: str | Path) -> str:
    """The parameters from a checkpoint dir (latest complete) or a full safetensors file,
    into any layout (optimizer state untouched); a line saying what was loaded. Collective."""
    p = Path(source)
    if p.is_file():
        d, index = p.parent, file_index(p)
        where = str(p)
    else:
        d, _ = ix.find(p)
        index = ix.read(d)
        where = str(d)
    ix.check_model(index, where, executor.graph.model, model_params(executor))
    _fill(executor, Reader(d, index), ("param",))
    return f"{where}: {len(ix.params(index))} parameters"


def file_index(path: Path) -> dict:
    """An index for one full safetensors file (key = parameter name, each one piece)."""
    from safetensors import SafetensorError, safe_open

    names = {c: n for n, c in CODE_OF_NAME.items()}
    if not path.is_file():
        raise ix.CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {}
            for k in f.keys():
                sl = f.get_slice(k)
                shape = list(sl.get_shape())
                tensors[f"param/{k}"] = {
                    "kind": "param", "param": k, "dtype": names.get(sl.get_dtype(), "?"),
                    "shape": shape, "dims": [f"d{i}" for i in range(len(shape))],
                    "pieces": [{"file": path.name, "key": k, "offset": [0] * len(shape),
                                "shape": shape}]}
    except (SafetensorError, OSError) as e:
        raise ix.CheckpointError(f"{path}: not a readable safetensors file ({e}); give one "
                                 "`soapstone ckpt export` wrote, or a checkpoint dir") from None
    return {"format": ix.FORMAT, "model": path.name, "tensors": tensors, "settings": {},
            "files": {path.name: {"bytes": path.stat().st_size}}}


def _fill(executor, reader: Reader, kinds: tuple[str, ...]) -> None:
    """Read every share this rank holds of the given kinds, then republish parameters."""
    import torch

    with torch.no_grad():
        for h in holdings(executor):
            for kind, view in h.views.items():
                if kind not in kinds:
                    continue
                at = 0
                for box in h.boxes:
                    t = reader.read(f"{kind}/{h.name}", box, view.dtype)
                    view[at:at + box.numel].copy_(t.reshape(-1))
                    at += box.numel
        for opt in executor.optimizers.values():
            opt.reducer.publish_params()  # masters -> the parameters every rank computes with
