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
from soapstone.shard.checkpoint.tensorfile import Reader
from soapstone.shard.checkpoint.verify import verify


def open_resume(path: str | Path, graph, optimizer: str | None) -> tuple[Path, dict, list]:
    """The checkpoint `path` names (a step dir, or the latest complete one under a --save
    DIR), checked against the model of `graph` and the optimizer without reading tensor data:
    (its dir, its index, the partial saves passed over); CheckpointError."""
    d, partial = ix.find(path)
    index = ix.read(d)
    verify(d, index)
    ix.check_model(index, str(d), graph.model, ix.graph_params(graph))
    saved = index["optimizer"]["name"]
    if optimizer is not None and saved != optimizer:
        raise ix.CheckpointError(f"checkpoint {d}: saved with optimizer {saved}, this run uses "
                                 f"{optimizer}; resume with --optimizer {saved}, or start from "
                                 f"its weights alone with --init {d}")
    return d, index, partial


def open_params(source: str | Path, graph) -> tuple[Path, dict, str]:
    """The parameters a checkpoint dir (latest complete) or a full safetensors file offers,
    checked against the model of `graph`: (dir, index, what to call it). CheckpointError."""
    p = Path(source)
    if p.is_file():
        d, index, where = p.parent, file_index(p), str(p)
    else:
        d, _ = ix.find(p)
        index = ix.read(d)
        where = str(d)
    verify(d, index)
    ix.check_model(index, where, graph.model, ix.graph_params(graph))
    return d, index, where


def resume(executor, path: str | Path) -> dict:
    """Load parameters, masters, optimizer state and step count from the checkpoint `path`
    names (a step dir, or the latest complete one under a --save DIR); its index, with
    "dir", "skipped" (partial saves passed over) and "bytes_read" (tensor data this rank
    read) added. Collective."""
    from soapstone.shard.checkpoint.save import optimizer_name

    name = optimizer_name(executor)
    d, index, partial = open_resume(path, executor.graph, name)
    kinds = ("param", *ix.OPTIMIZER_KINDS.get(name, ())) if name else ("param",)
    read = fill_shares(executor, Reader(d, index), kinds)
    for opt in executor.optimizers.values():
        opt.steps = index["optimizer"]["steps"]
    return index | {"dir": str(d), "skipped": [str(p) for p in partial], "bytes_read": read}


def load_params(executor, source: str | Path) -> str:
    """The parameters from a checkpoint dir (latest complete) or a full safetensors file,
    into any layout (optimizer state untouched); a line saying what was loaded. Collective."""
    d, index, where = open_params(source, executor.graph)
    fill_shares(executor, Reader(d, index), ("param",))
    return f"{where}: {len(ix.params(index))} parameters"


def file_index(path: Path) -> dict:
    """An index for one full safetensors file (key = parameter name, each one piece)."""
    from soapstone.shard.checkpoint.verify import read_header

    names = {c: n for n, (c, _) in ix.DTYPES.items()}
    if not path.is_file():
        raise ix.CheckpointError(f"{path}: no such file")
    header, _ = read_header(path)
    tensors = {}
    for k, h in header.items():
        if k == "__metadata__":
            continue
        shape = list(h["shape"])
        tensors[f"param/{k}"] = {
            "kind": "param", "param": k, "dtype": names.get(h["dtype"], h["dtype"]),
            "shape": shape, "dims": [f"d{i}" for i in range(len(shape))],
            "pieces": [{"file": path.name, "key": k, "offset": [0] * len(shape),
                        "shape": shape}]}
    return {"format": ix.FORMAT, "model": path.name, "tensors": tensors, "settings": {},
            "files": {path.name: {"bytes": path.stat().st_size}}}


def fill_shares(executor, reader: Reader, kinds: tuple[str, ...]) -> int:
    """Read every share this rank holds of the given kinds from `reader` (a checkpoint's, or
    anything with `read(key, box, dtype)` and `bytes_read`: hf.py's), then republish
    parameters; the bytes of tensor data read."""
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
    return reader.bytes_read
