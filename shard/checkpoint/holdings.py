"""What one rank holds of a model's training state, as boxes of global tensors.

A holding is one parameter's share on this rank: the boxes of the global tensor it covers (its
tensor-parallel shard, or under ZeRO the flat range of that shard its optimizer updates, cut
into boxes) and the flat views they live in: the fp32 master values and each optimizer state
buffer. Save writes the views; load fills them. Several ranks hold the same box (replicas over
an axis the parameter is not split on); `writer` marks the one that writes it (the rule of
shard/plan/analysis/checkpoint_size.py, which explain counts with: replicated parameters spread over
their replicas), the first virtual stage of a weight tied across pipeline stages.
"""

from __future__ import annotations

import attrs
import torch

from soapstone.shard.checkpoint.boxes import Box, flat_boxes
from soapstone.shard.plan.analysis.checkpoint_size import writes
from soapstone.shard.plan.layout import Split


@attrs.define
class Holding:
    """One parameter's share on this rank: boxes (in flat order) and kind -> flat view."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    layout: dict[str, str]
    boxes: list[Box]
    views: dict[str, torch.Tensor]
    writer: bool


def holdings(executor) -> list[Holding]:
    """Every share of every parameter this rank's executor holds (masters and optimizer state
    under its optimizers; the parameters themselves without one)."""
    first_stage = {n: where[0] for n, where in executor.graph.shared}
    out = []
    for i, model in executor.models.items():
        opt = executor.optimizers.get(i)
        for h in (_with_optimizer(model, opt) if opt is not None else _plain(model)):
            h.writer = h.writer and first_stage.get(h.name, i) == i
            out.append(h)
    return out


def local_box(model, name: str) -> Box:
    """The box of parameter `name` that this rank's shard covers."""
    v = model.program.value(name)
    sl = model.ctx.local_slices(v)
    return Box(tuple(s.start for s in sl), tuple(v.local_shape))


def _placements(model, name: str) -> dict[str, str]:
    v = model.program.value(name)
    return {a: str(p) if not isinstance(p, Split) else f"split:{p.dim}"
            for a, p in v.layout.placements}


def _writes(model, name: str, sharded_over: tuple[str, ...]) -> bool:
    """Whether this rank is the one of its replicas that writes its boxes."""
    mesh = model.mesh
    if mesh is None:
        return True
    index = next(i for i, p in enumerate(model.program.params) if p.name == name)
    sizes = {a: mesh.size(a) for a in mesh.axes}
    coords = {a: mesh.coord(a) for a in mesh.axes}
    return writes(model.program.value(name).layout, coords, sizes, sharded_over, index)


def _spec(model, name: str):
    return next(p for p in model.program.params if p.name == name)


def _plain(model) -> list[Holding]:
    out = []
    for name, p in model.params.items():
        spec = _spec(model, name)
        box = local_box(model, name)
        out.append(Holding(name, spec.dims, spec.shape, _placements(model, name), [box],
                           {"param": p.data.reshape(-1)}, _writes(model, name, ())))
    return out


def _with_optimizer(model, opt) -> list[Holding]:
    out = []
    reducer = opt.reducer
    for b, state in zip(reducer.buckets, opt.state, strict=True):
        mine = b.shard_range() if b.sharded else slice(0, b.numel)
        flat = {"param": b.master}
        flat.update({k: t for k, t in state.items() if t.shape == b.master.shape})
        sharded_over = b.dp if b.sharded else ()
        for s in b.slots:
            lo, hi = max(mine.start, s.offset), min(mine.stop, s.offset + s.numel)
            if lo >= hi:
                continue
            spec = _spec(model, s.name)
            boxes = flat_boxes(local_box(model, s.name), lo - s.offset, hi - s.offset)
            views = {k: t[lo - mine.start:hi - mine.start] for k, t in flat.items()}
            out.append(Holding(s.name, spec.dims, spec.shape, _placements(model, s.name),
                               boxes, views, _writes(model, s.name, sharded_over)))
    return out
