"""Save a training state: each rank writes its own pieces, rank 0 writes the index last.

    save(executor, "ckpt", step=3, seed=0, settings={...}, keep=2)   # collective

1. rank 0 clears DIR/step-NNNNNNNN (a partial save of that step left by a crash), barrier;
2. every rank writes rankRRRRR.safetensors (the boxes it is the writer of: fp32 masters and
   optimizer state, straight from the live flat buffers, no gather, no copy) and
   rankRRRRR.json (its pieces), each through temp file + fsync + rename; barrier;
3. rank 0 merges the parts into index.json (temp + fsync + rename + directory fsync): from
   that moment the checkpoint exists; it then drops checkpoints beyond the newest `keep` and
   partial saves of earlier steps; barrier, so no rank runs ahead of a checkpoint in progress.
A rank killed before step 3 leaves a directory without index.json, which readers pass over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint import tensorfile
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
    directory. settings: the run's settings, recorded as they are (JSON-ready)."""
    mesh = executor.mesh
    world = mesh.world if mesh is not None else None
    rank = world.rank if world is not None else 0
    size = world.size if world is not None else 1
    from soapstone.shard.train.nonfinite import refuse_nonfinite_state

    refuse_nonfinite_state(executor, step)  # NonFinite on every rank, before a byte is written
    d = ix.step_dir(root, step)
    if rank == 0:
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    _barrier(world)
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
    nbytes = tensorfile.write(d / ix.rank_file(rank), tensors,
                              {"format": ix.FORMAT, "rank": str(rank), "step": str(step)},
                              tensorfile.slow_hook(step, rank))
    ix.write_json_atomic(d / f"rank{rank:05d}.json",
                         {"rank": rank, "file": ix.rank_file(rank), "bytes": nbytes,
                          "tensors": part})
    _barrier(world)
    if rank == 0:
        parts = [json.loads((d / f"rank{r:05d}.json").read_text()) for r in range(size)]
        opt = next(iter(executor.optimizers.values()), None)
        header = {
            "model": executor.graph.model, "parallel": executor.graph.parallel,
            "zero": executor.graph.stages[0].program.zero,
            "mesh": dict(executor.graph.mesh), "world_size": size, "step": step,
            "seed": seed, "settings": settings,
            "optimizer": {"name": optimizer_name(executor),
                          "steps": opt.steps if opt is not None else 0},
            "rng": {"seed": seed, "next_step": step,
                    "dropout": "counter-based: each mask is a function of (seed, step, value)"},
            "data": {"next_batch": step * settings.get("accumulate", 1), "seed": seed,
                     "source": settings.get("data") or "synthetic"},
            "torch": torch.__version__,
        }
        ix.write_json_atomic(d / ix.INDEX, ix.merge(parts, header))
        if keep is not None:
            prune(root, keep, step)
    _barrier(world)
    return d


def prune(root: str | Path, keep: int, current: int) -> None:
    """Keep the newest `keep` complete checkpoints under root; drop partial saves of steps
    before `current` (what a crash left)."""
    done, partial = ix.scan(root)
    for _, d in done[:-keep] if keep > 0 else done:
        shutil.rmtree(d, ignore_errors=True)
    for d in partial:
        m = ix.STEP_DIR.match(d.name)
        if m and int(m.group(1)) < current:
            shutil.rmtree(d, ignore_errors=True)


def _barrier(world) -> None:
    if world is not None and world.size > 1:
        world.barrier()
