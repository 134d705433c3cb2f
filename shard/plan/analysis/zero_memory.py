"""What ZeRO holds beside a step's working set, from the runtime's own bucket plan (torch-free):
ZeRO-3's gathered parameter buckets (shard/parallel/zero.py: the one in use and the next one,
prefetched) and its compute-dtype copies of the master shards (bf16: kept all step), and
ZeRO-2/3's gradient buffers in flight (shard/parallel/bucket_plan.py's full_grad_peak: the
bucket filling, the reduce-scatter running and its output; never every bucket's).

Backward meets them part by part (activations.py's Phases: the head, the last block, the
others): the head's buckets and the last block's gradients come before any other block's,
so beside the head and the last block ZeRO holds less than its steady state (a block's
bucket and the one before gathered, the previous block's reduce-scatter in flight), which
only the blocks after them meet, holding less activation by then. Each part's bytes go beside
its own working set (explain.estimate); added to backward's largest they over-counted
ZeRO-3 steps by 4-10% (bench_memory.py's live figure, gpt at 2 and 4 ranks).

A function of the parameters alone (not of the batch): `soapstone plan`'s probes compute it
for a stage of any number of blocks from a probe's parameters repeated (`repeat_block`)."""

from __future__ import annotations

import math

import attrs

from soapstone.shard.parallel.bucket_plan import full_grad_peak, plan_buckets
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.dtypes import DTYPES


@attrs.frozen
class Beside:
    """Bytes held beside forward's and backward's working sets, and at backward's end (the
    saved tensors are freed by then: explain counts it above them less the saved bytes)."""

    forward: int
    backward: int
    end: int
    # beside the first two parts of backward (activations.py's Phases): its head (the steps
    # after the last block's) and the last block. Each part's buckets gathered, the one
    # before them (in forward order) prefetched, the gradient buffers up to the part's end;
    # 0 where no parameter is a block's (backward is one part: `backward` beside it)
    head: int = 0
    last: int = 0


def zero_beside(program, zero: int | ZeroStage, deferred: tuple[str, ...] = ()) -> Beside:
    """Beside for `program`'s parameters under `zero` (`deferred`: as plan_buckets): gradient
    buffers in the masters' width, padded to a multiple of the data ranks as the runtime pads."""
    z = ZeroStage.of(zero)
    if not z.shards_grads and not deferred:
        return Beside(0, 0, 0)  # every gradient buffer persists and no parameter is gathered
    mesh = dict(program.mesh)
    floats = [p for p in program.params if DTYPES[p.dtype].is_float]
    master = max(4, DTYPES[floats[0].dtype].nbytes) if floats else 4  # fp64 models: 8
    dtype = {p.name: p.dtype for p in floats}
    # a bucket that also allreduces over other axes is waited at the step (data_parallel.py):
    # its full buffer lives from its first gradient to the step, as a deferred bucket's
    plans = [attrs.evolve(p, deferred=True) if set(p.sync) - set(p.dp) and
             z.on(math.prod(mesh[a] for a in p.dp)).shards_grads else p
             for p in plan_buckets(program, z, program.zero_axes, deferred)]
    full, out, transient, gathers = [], [], [], []
    gathered: dict[int, int] = {}  # bucket -> its gathered bytes (ZeRO-3)
    cached = 0
    for k, plan in enumerate(plans):
        n = math.prod(mesh[a] for a in plan.dp)
        padded = -(-plan.numel // n) * n
        full.append(padded * master)
        out.append(padded // n * master)
        transient.append(z.on(n).shards_grads)
        if z.on(n).shards_params:
            item = DTYPES[dtype[plan.names[0]]].nbytes
            gathers.append(padded * item)
            gathered[k] = padded * item
            cached += padded // n * item if item != master else 0
    arrival = [p.name for p in reversed(floats)]
    grads = full_grad_peak(plans, arrival, full, out, transient)
    # a bucket in use and the next one (in bucket order, backward's), gathered at once; at a
    # launch ZeRO-3 has freed that bucket's own (zero.py's grad_done): one is left
    pair = max((a + b for a, b in zip(gathers, [*gathers[1:], 0], strict=False)), default=0)
    one = max(gathers, default=0)
    head = head_params(program)
    parts = (0, 0)
    if head is not None:
        # backward's first parts: the head's gradients arrive first, then the last block's;
        # a part's buckets are gathered, and a bucket's first unpack prefetches the one
        # before it in forward order (zero.py)
        place = {p.name: k for k, p in enumerate(program.params)}
        forward = sorted(range(len(plans)), key=lambda k: min(place[n] for n in plans[k].names))
        last = [p for p in program.params if p.block is not None][-1].block
        mine = {p.name for p in program.params if p.block == last}
        parts = tuple(cached + _part(plans, forward, gathered, names, [
            n for n in arrival if n in seen], full, out, transient)
            for names, seen in ((head, head), (mine, head | mine)))
    return Beside(pair + cached + grads.left,
                  cached + max(pair + grads.at_make, one + grads.at_launch),
                  cached + grads.at_end, *parts)


def _part(plans, forward: list[int], gathered: dict[int, int], names: set[str],
          arrival: list[str], full, out, transient) -> int:
    """ZeRO's bytes beside a part of backward that reads `names`, as the gradients of
    `arrival` (the part's and those before it) arrive (full_grad_peak): its buckets and the
    one before them gathered when a buffer is made; at a launch the part's own are freed
    (zero.py's grad_done), the one before is left."""
    mine = [k for k in forward if names & set(plans[k].names)]
    ahead = forward.index(mine[0]) - 1 if mine else -1
    before = gathered.get(forward[ahead], 0) if ahead >= 0 and forward[ahead] not in mine \
        else 0
    grads = full_grad_peak(plans, arrival, full, out, transient) if arrival else None
    if grads is None:
        return sum(gathered.get(k, 0) for k in mine) + before
    return max(sum(gathered.get(k, 0) for k in mine) + before + grads.at_make,
               before + max(grads.at_launch, grads.at_end))


def head_params(program) -> set[str] | None:
    """The float parameters the head reads: the steps after the last one that reads a
    block's parameter (activations.py's `_Saves.parts`' head); None where no parameter is a
    block's."""
    blocks = {p.name for p in program.params if p.block is not None}
    floats = {p.name for p in program.params if DTYPES[p.dtype].is_float}
    reads = [set(s.args) if hasattr(s, "args") else {s.src} for s in program.steps]
    last = max((i for i, r in enumerate(reads) if r & blocks), default=None)
    if last is None:
        return None
    return {a for r in reads[last + 1:] for a in r if a in floats}


def repeat_block(program, n: int):
    """`program` (its parameters only) with its last block's parameters n - 2 more times
    after them: a 2-block probe's as a stage of n >= 2 alike blocks holds them."""
    params = list(program.params)
    last = [p.block for p in params if p.block is not None][-1]
    mine = [i for i, p in enumerate(params) if p.block == last]
    more = [attrs.evolve(params[i], name=f"{params[i].name}~{j}", block=f"{last}~{j}")
            for j in range(n - 2) for i in mine]
    return attrs.evolve(program, params=(*params[:mine[-1] + 1], *more,
                                         *params[mine[-1] + 1:]))
