"""What each rank writes into a checkpoint, from the layout alone (torch-free, for explain).

The same rule as shard/checkpoint/holdings.py: a rank writes the fp32 master value and the
optimizer state (AdamW: two moments; SGD: the momentum) of each parameter share it updates
(its tensor-parallel shard; under ZeRO >= 1 its flat slice of each gradient bucket, as
plan_buckets lays the buckets out), unless another rank holds the same share: of the
replicas, parameter i is written by replica i mod their number (`writes`), a weight tied
across pipeline stages by its first stage. Every element is written exactly once, so the
total is the parameter count times the bytes per element whatever the layout.

Each rank's share is counted up to COUNTED_RANKS ranks (a loop over the world); above that
explain gives the total alone, which needs no rank (`checkpoint_total`).
"""

from __future__ import annotations

import math

from soapstone.shard.parallel.bucket_plan import plan_buckets
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.layout import Owned, Split
from soapstone.shard.plan.units import format_bytes

STATE_COPIES = {"adamw": 2, "sgd": 1}
COUNTED_RANKS = 16384  # each rank's share up to this world size; above, the total only


def rank_coords(mesh: tuple[tuple[str, int], ...], rank: int) -> dict[str, int]:
    """Row-major coordinates of world rank `rank` (the last axis varies fastest)."""
    out = {}
    for axis, n in reversed(mesh):
        rank, out[axis] = divmod(rank, n)
    return out


def checkpoint_bytes(graph, optimizer: str = "adamw",
                     bucket_mb: float = 25.0) -> list[int] | None:
    """Bytes of tensor data each world rank writes (index = rank; file headers not counted);
    None above COUNTED_RANKS ranks."""
    if graph.world_size > COUNTED_RANKS:
        return None
    first_stage = {n: where[0] for n, where in graph.shared}
    shared = tuple(n for n, _ in graph.shared)
    # what a stage's ranks write does not depend on the rank but through its coordinates:
    # planned once per stage, then each rank only compares coordinates
    rows = {s.index: _stage_rows(s, optimizer, bucket_mb, shared,
                                 {n for n, i in first_stage.items() if i != s.index})
            for s in graph.stages}
    per_rank = []
    for rank in range(graph.world_size):
        coords = rank_coords(graph.mesh, rank)
        pipe = coords.get(graph.axis, 0) if graph.axis else 0
        total = 0
        for stage in graph.stages_of(pipe):
            for dp, sizes, shard, offset, numel, width, want in rows[stage.index]:
                if any(coords[a] != c for a, c in want):
                    continue
                lo = 0
                if dp:  # this rank's flat slice of the bucket
                    k = 0
                    for a in dp:
                        k = k * sizes[a] + coords[a]
                    lo = k * shard
                    numel = max(0, min(lo + shard, offset + numel) - max(lo, offset))
                total += numel * width
        per_rank.append(total)
    return per_rank


def checkpoint_total(graph, optimizer: str = "adamw") -> int:
    """Bytes of tensor data a checkpoint holds in all: each parameter element once (a tied
    weight once), its fp32 master value and optimizer state (no loop over ranks)."""
    seen, out = set(), 0
    for stage in graph.stages:
        for p in stage.program.params:
            if p.name not in seen:
                seen.add(p.name)
                elem = 8 if p.dtype == "f64" else 4
                out += math.prod(p.shape) * elem * (1 + STATE_COPIES.get(optimizer, 0))
    return out


def _stage_rows(stage, optimizer: str, bucket_mb: float, shared: tuple[str, ...],
                not_mine: set[str]) -> list[tuple]:
    """Per parameter share a rank of `stage` may write: (the data axes its bucket is sharded
    over or (), the mesh sizes, the shard length, its offset in the bucket, its elements,
    bytes per element, the coordinates a writer has)."""
    program = stage.program
    sizes = dict(program.mesh)
    specs = {p.name: p for p in program.params}
    order = {p.name: i for i, p in enumerate(program.params)}
    deferred = tuple(n for n in shared if n in specs)
    rows = []
    for b in plan_buckets(program, program.zero, program.zero_axes, deferred, bucket_mb):
        n = math.prod(sizes[a] for a in b.dp)
        sharded = ZeroStage.of(program.zero).on(n).shards_optimizer
        shard = -(-b.numel // n) if sharded else 0
        offset = 0
        for name in b.names:
            spec = specs[name]
            numel = math.prod(spec.local_shape)
            offset += numel
            if name in not_mine:
                continue
            want = writer_coords(spec.layout, sizes, b.dp if sharded else (), order[name])
            width = (8 if spec.dtype == "f64" else 4) * (1 + STATE_COPIES.get(optimizer, 0))
            rows.append((b.dp if sharded else (), sizes, shard, offset - numel, numel, width,
                         want))
    return rows


def writer_coords(layout, sizes: dict[str, int], sharded_over: tuple[str, ...],
                  index: int) -> tuple[tuple[str, int], ...]:
    """The coordinates the rank writing a share has (`writes`' rule, as data)."""
    want, replicas = [], []
    for axis in sizes:
        p = layout.get(axis)
        if isinstance(p, Split) or axis in sharded_over:
            continue
        if isinstance(p, Owned):
            want.append((axis, p.coord))
            continue
        replicas.append(axis)
    k = index % math.prod(sizes[a] for a in replicas)
    for axis in reversed(replicas):
        k, c = divmod(k, sizes[axis])
        want.append((axis, c))
    return tuple(want)


def writes(layout, coords: dict[str, int], sizes: dict[str, int],
           sharded_over: tuple[str, ...], index: int) -> bool:
    """Whether the rank at `coords` writes a parameter share laid out as `layout` (the
    `index`-th parameter of its stage): of the ranks holding the same share (the coordinates
    of the axes it is replicated over), parameter i goes to replica i mod their number, so
    replicated parameters spread over the replicas instead of all landing on coordinate 0.
    A branch's parameter is written by its owner."""
    return all(coords[a] == c for a, c in writer_coords(layout, sizes, sharded_over, index))


def format_checkpoint(per_rank: list[int] | None, total: int = 0, world: int = 0) -> str:
    """explain's line: the most a rank writes, the total, and how many ranks write (with
    per_rank None, the total of a `world` too large to count rank by rank)."""
    if per_rank is None:
        return (f"checkpoint (run --save): {format_bytes(total)} in all over {world} ranks "
                f"(each rank's share is counted up to {COUNTED_RANKS} ranks)")
    top = max(range(len(per_rank)), key=per_rank.__getitem__)
    writers = sum(1 for b in per_rank if b)
    return (f"checkpoint (run --save): {format_bytes(per_rank[top])} from the busiest rank "
            f"(rank {top}), {format_bytes(sum(per_rank))} in all; {writers} of {len(per_rank)} "
            "ranks write (fp32 masters + optimizer state)")
