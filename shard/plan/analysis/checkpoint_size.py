"""What each rank writes into a checkpoint, from the layout alone (torch-free, for explain).

The same rule as shard/checkpoint/holdings.py: a rank writes the fp32 master value and the
optimizer state (AdamW: two moments; SGD: the momentum) of each parameter share it updates
(its tensor-parallel shard; under ZeRO >= 1 its flat slice of each gradient bucket, as
plan_buckets lays the buckets out), unless another rank holds the same share: of the
replicas, parameter i is written by replica i mod their number (`writes`), a weight tied
across pipeline stages by its first stage. Every element is written exactly once, so the
total is the parameter count times the bytes per element whatever the layout.
"""

from __future__ import annotations

import math

from soapstone.shard.parallel.bucket_plan import plan_buckets
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.layout import Owned, Split
from soapstone.shard.plan.units import format_bytes

STATE_COPIES = {"adamw": 2, "sgd": 1}


def rank_coords(mesh: tuple[tuple[str, int], ...], rank: int) -> dict[str, int]:
    """Row-major coordinates of world rank `rank` (the last axis varies fastest)."""
    out = {}
    for axis, n in reversed(mesh):
        rank, out[axis] = divmod(rank, n)
    return out


def checkpoint_bytes(graph, optimizer: str = "adamw", bucket_mb: float = 25.0) -> list[int]:
    """Bytes of tensor data each world rank writes (index = rank; file headers not counted)."""
    first_stage = {n: where[0] for n, where in graph.shared}
    per_rank = []
    for rank in range(graph.world_size):
        coords = rank_coords(graph.mesh, rank)
        pipe = coords.get(graph.axis, 0) if graph.axis else 0
        total = 0
        for stage in graph.stages_of(pipe):
            total += _stage_bytes(stage, coords, optimizer, bucket_mb,
                                  {n for n, s in first_stage.items() if s != stage.index},
                                  tuple(n for n, _ in graph.shared))
        per_rank.append(total)
    return per_rank


def _stage_bytes(stage, coords, optimizer, bucket_mb, not_mine, shared) -> int:
    program = stage.program
    sizes = dict(program.mesh)
    specs = {p.name: p for p in program.params}
    order = {p.name: i for i, p in enumerate(program.params)}
    deferred = tuple(n for n in shared if n in specs)
    out = 0
    for b in plan_buckets(program, program.zero, program.data_axes, deferred, bucket_mb):
        n = math.prod(sizes[a] for a in b.dp)
        sharded = ZeroStage.of(program.zero).on(n).shards_optimizer
        padded = -(-b.numel // n) * n
        if sharded:
            k = 0
            for a in b.dp:
                k = k * sizes[a] + coords[a]
            lo, hi = k * (padded // n), (k + 1) * (padded // n)
        else:
            lo, hi = 0, padded
        offset = 0
        for name in b.names:
            spec = specs[name]
            numel = math.prod(spec.local_shape)
            mine = max(0, min(hi, offset + numel) - max(lo, offset))
            offset += numel
            if not mine or name in not_mine:
                continue
            if not writes(spec.layout, coords, sizes, b.dp if sharded else (), order[name]):
                continue
            elem = 8 if spec.dtype == "f64" else 4
            out += mine * elem * (1 + STATE_COPIES.get(optimizer, 0))
    return out


def writes(layout, coords: dict[str, int], sizes: dict[str, int],
           sharded_over: tuple[str, ...], index: int) -> bool:
    """Whether the rank at `coords` writes a parameter share laid out as `layout` (the
    `index`-th parameter of its stage): of the ranks holding the same share (the coordinates
    of the axes it is replicated over), parameter i goes to replica i mod their number, so
    replicated parameters spread over the replicas instead of all landing on coordinate 0.
    A branch's parameter is written by its owner."""
    replicas = []
    for axis in sizes:
        p = layout.get(axis)
        if isinstance(p, Split) or axis in sharded_over:
            continue
        if isinstance(p, Owned):
            if coords[axis] != p.coord:
                return False
            continue
        replicas.append(axis)
    k = index % math.prod(sizes[a] for a in replicas)
    for axis in reversed(replicas):
        k, want = divmod(k, sizes[axis])
        if coords[axis] != want:
            return False
    return True


def format_checkpoint(per_rank: list[int]) -> str:
    """explain's line: the most a rank writes, the total, and how many ranks write."""
    top = max(range(len(per_rank)), key=per_rank.__getitem__)
    writers = sum(1 for b in per_rank if b)
    return (f"checkpoint (run --save): {format_bytes(per_rank[top])} from the busiest rank "
            f"(rank {top}), {format_bytes(sum(per_rank))} in all; {writers} of {len(per_rank)} "
            "ranks write (fp32 masters + optimizer state)")
