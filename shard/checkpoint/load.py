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

import json
from pathlib import Path

from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint.agree import agree
from soapstone.shard.checkpoint.checksum import CHUNK, chunks
from soapstone.shard.checkpoint.holdings import holdings
from soapstone.shard.checkpoint.schema import File, Index, Optimizer, Piece, Tensor
from soapstone.shard.checkpoint.tensorfile import Reader
from soapstone.shard.checkpoint.verify import check_files, latest, read_header


def open_resume(path: str | Path, graph, optimizer: str | None
                ) -> tuple[Path, Index, list[tuple[Path, str]]]:
    """The checkpoint `path` names (a step dir, or the newest usable one under a --save DIR),
    checked against the model of `graph` and the optimizer without reading tensor data:
    (its dir, its index, the directories passed over and why); CheckpointError."""
    d, index, skipped = latest(path)
    ix.check_model(index, str(d), graph.model, ix.graph_params(graph))
    saved = index.optimizer.name
    if optimizer is not None and saved != optimizer:
        raise ix.CheckpointError(f"checkpoint {d}: saved with optimizer {saved}, this run uses "
                                 f"{optimizer}; resume with --optimizer {saved}, or start from "
                                 f"its weights alone with --init {d}")
    return d, index, skipped


def open_params(source: str | Path, graph) -> tuple[Path, Index, str]:
    """The parameters a checkpoint dir (newest usable) or a full safetensors file offers,
    checked against the model of `graph`: (dir, index, what to call it). CheckpointError."""
    p = Path(source)
    if p.is_file():
        d, index, where = p.parent, file_index(p), str(p)
        check_files(d, index)
    else:
        d, index, _ = latest(p)
        where = str(d)
    ix.check_model(index, where, graph.model, ix.graph_params(graph))
    return d, index, where


def resume(executor, path: str | Path) -> dict:
    """Load parameters, masters, optimizer state and step count from the checkpoint `path`
    names (a step dir, or the newest usable one under a --save DIR), every byte read checked
    against its checksum; its index (as JSON), with "dir", "skipped" (directories passed
    over) and "bytes_read" (the bytes this rank read and checked) added. Collective."""
    from soapstone.shard.checkpoint.save import optimizer_name

    name = optimizer_name(executor)
    d, index, skipped = open_resume(path, executor.graph, name)
    kinds = ("param", *ix.OPTIMIZER_KINDS.get(name, ())) if name else ("param",)
    read = fill_shares(executor, Reader(d, index), kinds)
    for opt in executor.optimizers.values():
        opt.steps = index.optimizer.steps
    return index.raw | {"dir": str(d), "skipped": [str(p) for p, _ in skipped],
                        "bytes_read": read}


def load_params(executor, source: str | Path) -> str:
    """The parameters from a checkpoint dir (newest usable) or a full safetensors file, into
    any layout (optimizer state untouched); a line saying what was loaded. Collective."""
    d, index, where = open_params(source, executor.graph)
    fill_shares(executor, Reader(d, index), ("param",))
    return f"{where}: {len(ix.params(index))} parameters"


def file_index(path: Path) -> Index:
    """An index for one full safetensors file (key = parameter name, each one piece), with the
    checksums `ckpt export` puts in its metadata (a file from elsewhere has none)."""
    names = {c: n for n, (c, _) in ix.DTYPES.items()}
    if not path.is_file():
        raise ix.CheckpointError(f"{path}: no such file")
    h = read_header(path)
    crcs = exported_crcs(path, h.metadata)
    tensors = {}
    for k, e in h.keys.items():
        if e["dtype"] not in names:
            raise ix.CheckpointError(f"{path}: {k} is {e['dtype']}; a checkpoint holds "
                                     + ", ".join(ix.DTYPES))
        shape = tuple(e["shape"])
        crc = crcs.get(k) if crcs is not None else None
        if crcs is not None and (crc is None or len(crc) != chunks(e["data_offsets"][1]
                                                                   - e["data_offsets"][0])):
            raise ix.CheckpointError(f"{path}: its metadata's crc32 has no checksums of {k} "
                                     "for its size; the file is damaged")
        tensors[f"param/{k}"] = Tensor(
            f"param/{k}", "param", k, names[e["dtype"]], shape,
            tuple(f"d{i}" for i in range(len(shape))), {},
            (Piece(path.name, k, (0,) * len(shape), shape, crc),))
    step = h.metadata.get("step", "")  # what `ckpt export` records, for messages
    return Index(model=path.name, parallel=None, zero=0, mesh={}, world_size=1,
                 step=int(step) if isinstance(step, str) and step.isdigit() else None,
                 seed=0, settings={}, optimizer=Optimizer(None, 0),
                 files={path.name: File(path.name, None, h.size)}, tensors=tensors,
                 chunk_bytes=CHUNK, raw={})


def exported_crcs(path: Path, metadata: dict) -> dict[str, tuple[int, ...]] | None:
    """The checksums `ckpt export` wrote into a file's metadata (key -> CRC-32 per chunk), or
    None when it has none."""
    text = metadata.get("crc32")
    if text is None:
        return None
    try:
        crcs = json.loads(text)
        return {k: tuple(int(c) for c in v) for k, v in crcs.items()}
    except (ValueError, TypeError, AttributeError):
        raise ix.CheckpointError(f"{path}: its metadata's crc32 is not a JSON object of "
                                 "checksum lists; the file is damaged") from None


def source_of(reader, name: str) -> str:
    """Where tensor `name` is read from, for messages: its first piece's file."""
    meta = reader.index.tensors.get(name) if hasattr(reader, "index") else None
    if meta is None or not meta.pieces:
        return str(getattr(reader, "dir", "the weights"))
    return str(Path(reader.dir) / meta.pieces[0].file)


def check_kind(reader, name: str, into) -> None:
    """CheckpointError where a float tensor of the model would be filled from integers (a
    file from elsewhere: cast, they would train silently). A reader without an index (a
    Hugging Face directory's) checks what it reads itself, naming the file and its tensor."""
    meta = reader.index.tensors.get(name) if hasattr(reader, "index") else None
    if meta is not None and into.is_floating_point() and not meta.dtype.startswith(
            ("float", "bfloat")):
        raise ix.CheckpointError(f"{source_of(reader, name)}: {name} is {meta.dtype}, but "
                                 f"the model's {name.split('/', 1)[1]} is a float tensor; give "
                                 "weights saved as floats")


def check_finite(reader, name: str, share) -> None:
    """CheckpointError where what was read holds NaN or infinity: such weights or state would
    only show in training as a non-finite loss (a checkpoint's own saves refuse them)."""
    if share.is_floating_point() and not bool(share.isfinite().all()):
        raise ix.CheckpointError(f"{source_of(reader, name)}: {name} holds NaN or infinity; "
                                 "load finite weights (a checkpoint of a run that stopped on "
                                 "a non-finite step is not one)")


def fill_shares(executor, reader, kinds: tuple[str, ...]) -> int:
    """Read every share this rank holds of the given kinds (`reader.read(tensor, box, dtype)`),
    agree with the other ranks that every read succeeded (else the same CheckpointError on
    every rank), then republish parameters; the bytes read. Collective."""
    import torch

    problem = None
    with torch.no_grad():
        try:
            for h in holdings(executor):
                for kind, view in h.views.items():
                    if kind not in kinds:
                        continue
                    at = 0
                    name = f"{kind}/{h.name}"
                    check_kind(reader, name, view)
                    for box in h.boxes:
                        dest = view[at:at + box.numel]
                        if hasattr(reader, "read_into"):  # a checkpoint: straight in
                            reader.read_into(name, box, dest)
                        else:
                            dest.copy_(reader.read(name, box, view.dtype).reshape(-1))
                        at += box.numel
                    check_finite(reader, name, view[:at])
        except ix.CheckpointError as e:
            problem = str(e)
        except OSError as e:  # a disk that fails under the read
            problem = f"reading the checkpoint: {e}; resume from another checkpoint"
        finally:
            if hasattr(reader, "close"):
                reader.close()
        mesh = executor.mesh
        verdict = agree(mesh.world if mesh is not None else None, problem)
        if verdict.problem is not None:
            raise ix.CheckpointError(verdict.where() + verdict.problem)
        for opt in executor.optimizers.values():
            opt.reducer.publish_params()  # masters -> the parameters every rank computes with
    return reader.bytes_read
