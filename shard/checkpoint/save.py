"""Save a training state: each rank writes its own pieces, rank 0 the index; one rename publishes.

    save(executor, "ckpt", step=3, seed=0, settings={...}, keep=2)   # collective

1. rank 0 makes DIR/step-NNNNNNNN.tmp-XXXXXXXX and tells every rank its name;
2. every rank writes rankRRRRR.safetensors there (the boxes it is the writer of: fp32 masters
   and optimizer state, straight from the live flat buffers, no gather, no copy; the CRC-32 of
   each 1 MiB chunk taken as it goes; its header's metadata names rank, step, model and
   optimizer step count) and rankRRRRR.json (its pieces and checksums), each fsynced;
3. the ranks agree: a rank whose write failed (a full disk: ENOSPC, EDQUOT, EIO) makes every
   rank raise the same CheckpointError naming the disk, the bytes written and the last
   complete checkpoint, after rank 0 removed the temp directory;
4. rank 0 merges the parts into index.json (fsynced), fsyncs the directory and renames it to
   DIR/step-NNNNNNNN (an existing one is swapped out whole and then deleted: durable.py); it
   then drops checkpoints beyond the newest `keep` (each renamed step-N.del-XXXXXXXX, the
   directory fsynced, before its files are deleted: a kill mid-delete leaves no half step-N)
   and what crashed saves of steps up to this one, or earlier prunes, left;
   the ranks agree again, so none runs ahead of a checkpoint in progress or past a failure.
A rank killed before the rename leaves only a .tmp directory, which readers pass over.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import shutil
import uuid
from pathlib import Path

import attrs
import torch

from soapstone.shard.checkpoint import durable, tensorfile
from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint.agree import agree, share
from soapstone.shard.checkpoint.holdings import holdings


def optimizer_name(executor) -> str | None:
    """"adamw" | "sgd" | None (no optimizer)."""
    from soapstone.shard.train.optim import FlatAdamW

    opt = next(iter(executor.optimizers.values()), None)
    if opt is None:
        return None
    return "adamw" if isinstance(opt.rule, FlatAdamW) else "sgd"


def save(executor, root: str | Path, step: int, seed: int, settings: dict,
         keep: int | None = None) -> Path:
    """Write the checkpoint after `step` optimizer steps under `root` (collective); its
    directory. settings: the run's settings, recorded as they are (JSON-ready). A failed write
    on any rank is a CheckpointError on every rank, the partial save removed."""
    check_args(step, seed, settings, keep)
    step, seed = int(step), int(seed)  # numpy's integers are no JSON
    mesh = executor.mesh
    world = mesh.world if mesh is not None else None
    rank = world.rank if world is not None else 0
    size = world.size if world is not None else 1
    from soapstone.shard.train.nonfinite import refuse_nonfinite_state

    refuse_nonfinite_state(executor, step)  # NonFinite on every rank, before a byte is written
    root = Path(root)
    tmp, problem = Path(), None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = durable.make_temp(root, step)
        except OSError as e:
            problem = durable.failure(e, f"making a directory in {root}")
    raise_agreed(agree(world, problem), root, step, None, rank)
    tmp = Path(share(world, str(tmp)))
    tally, problem = tensorfile.Tally(), None
    try:
        write_part(executor, tmp, step, rank, size, tally)
    except OSError as e:
        problem = durable.failure(e, f"writing {tmp / ix.rank_file(rank)}")
    raise_agreed(agree(world, problem, tally.bytes), root, step, tmp, rank)
    final = ix.step_dir(root, step)
    if rank == 0:
        try:
            write_index(executor, tmp, step, seed, settings, size)
            durable.publish(tmp, final)
        except OSError as e:
            problem = durable.failure(e, f"writing {tmp / ix.INDEX}")
        else:
            prune(root, keep, step)
    raise_agreed(agree(world, problem, tally.bytes), root, step, tmp, rank)
    return final


def check_args(step: int, seed: int, settings: dict, keep: int | None) -> None:
    """CheckpointError naming the argument of save() (or AsyncSaver) that cannot work, on
    every rank alike before a byte is written: a negative or non-int step names no step
    directory, settings that are no JSON object fail on rank 0 alone mid-save, and keep=0
    would prune the checkpoint just written."""
    def whole(v) -> bool:  # numpy's integers too, as train_step takes them
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if not whole(step) or step < 0:
        raise ix.CheckpointError(f"save: step={step!r}; give an int >= 0 (optimizer steps done)")
    if not whole(seed):
        raise ix.CheckpointError(f"save: seed={seed!r}; give the run's int seed")
    if keep is not None and (not whole(keep) or keep < 1):
        raise ix.CheckpointError(f"save: keep={keep!r}; give at least 1 (the newest "
                                 "checkpoints kept), or None to keep every one")
    try:
        ok = isinstance(settings, dict) and bool(json.dumps(settings))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ix.CheckpointError(f"save: settings={settings!r:.60}; give a dict of JSON "
                                 "values (the run's settings, recorded in the index)")


def raise_agreed(verdict, root: Path, step: int, tmp: Path | None, rank: int) -> None:
    """Raise the agreed failure on every rank, rank 0 first removing the partial save."""
    if verdict.problem is None:
        return
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    raise ix.CheckpointError(durable.disk_message(root, step, verdict.total, verdict.problem,
                                                  verdict.where()))


def write_part(executor, tmp: Path, step: int, rank: int, size: int,
               tally: tensorfile.Tally) -> None:
    """This rank's safetensors file and its part of the index, into `tmp` (OSError when the
    disk fails; `tally` counts the bytes)."""
    write_planned(plan_part(executor, step, rank, size), tmp, step, rank, tally)


@attrs.frozen
class Part:
    """What one rank writes into a checkpoint: (key, tensor) in file order, its part of the
    index (tensor name -> entry, pieces without checksums yet) and its file's header metadata."""

    tensors: list[tuple[str, torch.Tensor]]
    index: dict[str, dict]
    metadata: dict[str, str]


def plan_part(executor, step: int, rank: int, size: int) -> Part:
    """What this rank writes for the checkpoint of `step`: views of its live buffers (no
    copy), the order and keys the file will have, and its header's metadata."""
    tensors, part = [], {}
    counts: dict[str, int] = {}
    for h in holdings(executor):
        if not h.writer:
            continue
        for kind, view in h.views.items():
            name = f"{kind}/{h.name}"
            meta = part.setdefault(name, {
                "kind": kind, "param": h.name, "dtype": tensorfile.NAMES[view.dtype],
                "shape": list(h.shape), "dims": list(h.dims), "layout": h.layout,
                "pieces": []})
            at = 0
            for box in h.boxes:
                key = f"{name}#{counts.get(name, 0)}"
                counts[name] = counts.get(name, 0) + 1
                tensors.append((key, view[at:at + box.numel].view(box.shape)))
                at += box.numel
                meta["pieces"].append({"file": ix.rank_file(rank), "key": key, **box.to_data()})
    opt = next(iter(executor.optimizers.values()), None)
    # the header says whose file this is: a swapped or stray file, or an index whose step was
    # edited, cannot pass as this checkpoint's (verify.check_file)
    metadata = {"format": ix.FORMAT, "rank": str(rank), "step": str(step),
                "model": executor.graph.model, "world_size": str(size),
                "optimizer_steps": str(opt.steps if opt is not None else 0)}
    return Part(tensors, part, metadata)


def write_planned(part: Part, tmp: Path, step: int, rank: int,
                  tally: tensorfile.Tally) -> None:
    """Write a planned part (its tensors as they are now) into `tmp`: the safetensors file and
    rankRRRRR.json, each fsynced (OSError when the disk fails). Touches no collective, so it
    may run beside training (async_save.py)."""
    w = tensorfile.write(tmp / ix.rank_file(rank), part.tensors, part.metadata,
                         tensorfile.slow_hook(step, rank), tally)
    for meta in part.index.values():
        for p in meta["pieces"]:
            p["crc32"] = w.crc32[p["key"]]
    ix.write_json_atomic(tmp / f"rank{rank:05d}.json",
                         {"rank": rank, "file": ix.rank_file(rank), "bytes": w.bytes,
                          "header_bytes": w.header_bytes, "header_crc32": w.header_crc32,
                          "tensors": part.index})


def write_index(executor, tmp: Path, step: int, seed: int, settings: dict, size: int) -> None:
    """Rank 0: merge every rank's part into tmp/index.json (fsynced)."""
    write_index_from(tmp, index_header(executor, step, seed, settings, size), size)


def index_header(executor, step: int, seed: int, settings: dict, size: int) -> dict:
    """The index's fields besides the tensors and files, as of now (the optimizer's update
    count moves on with training: an asynchronous save takes it when it stages)."""
    opt = next(iter(executor.optimizers.values()), None)
    return {
        "model": executor.graph.model, "parallel": executor.graph.parallel,
        "zero": executor.graph.stages[0].program.zero,
        "mesh": dict(executor.graph.mesh), "world_size": size, "step": step,
        "seed": seed, "settings": settings, "chunk_bytes": tensorfile.checksum.CHUNK,
        "optimizer": {"name": optimizer_name(executor),
                      "steps": opt.steps if opt is not None else 0},
        "rng": {"seed": seed, "next_step": step,
                "dropout": "counter-based: each mask is a function of (seed, step, value)"},
        "data": {"next_batch": step * settings.get("accumulate", 1), "seed": seed,
                 "source": settings.get("data") or "synthetic"},
        "torch": torch.__version__,
    }


def write_index_from(tmp: Path, header: dict, size: int) -> None:
    """Rank 0: every rank's part in `tmp` and `header` merged into tmp/index.json (fsynced);
    the parts go once merged (a checkpoint is its rank files and index.json, nothing else)."""
    files = [tmp / f"rank{r:05d}.json" for r in range(size)]
    parts = [json.loads(f.read_text()) for f in files]
    ix.write_json_atomic(tmp / ix.INDEX, ix.merge(parts, header))
    for f in files:  # before the directory's fsync and rename: gone in the whole checkpoint
        f.unlink()


def prune(root: str | Path, keep: int | None, current: int) -> None:
    """Keep the newest `keep` complete checkpoints under root (None: all); drop what crashes
    left of saves up to `current` (unfinished saves; replaced checkpoints whose replacement is
    in place) and of earlier prunes (any step). Housekeeping: what it cannot delete stays, for
    the next save."""
    try:
        done, skipped = ix.scan(root)
    except OSError:
        return
    if keep is not None:
        for _, d in done[:-keep] if keep > 0 else done:
            drop(d)
    complete = {s for s, _ in done}
    for d, _ in skipped:
        m = ix.UNFINISHED.match(d.name)
        how = m.group(2) if m else "step"  # step: a step-N without its index
        step = int(re.match(r"step-(\d+)", d.name).group(1))
        # nothing writes into a .del- directory again: garbage whatever its step
        if how == "del" or step <= current and (how != "old" or step in complete):
            if how == "step":
                drop(d)  # a step-N name: readers must never see it half deleted
            else:
                shutil.rmtree(d, ignore_errors=True)  # a name readers already pass over


def drop(d: Path) -> None:
    """Delete the checkpoint directory `d` as readers see it at once: renamed to
    step-N.del-XXXXXXXX (durably) before its files go, so a kill mid-delete leaves a name
    index.scan passes over and the next prune removes, never a half step-N."""
    gone = d.with_name(f"{d.name}.del-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, gone)
        ix.fsync_dir(d.parent)
    except OSError:
        return  # still whole under its own name: the next prune tries again
    shutil.rmtree(gone, ignore_errors=True)
