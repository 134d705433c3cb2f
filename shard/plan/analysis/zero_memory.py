"""What ZeRO holds beside a step's working set, from the runtime's own bucket plan (torch-free):
ZeRO-3's gathered parameter buckets (shard/parallel/zero.py: the one in use and the next one,
prefetched) and its compute-dtype copies of the master shards (bf16: kept all step), and
ZeRO-2/3's gradient buffers in flight (shard/parallel/bucket_plan.py's full_grad_peak: the
bucket filling, the reduce-scatter running and its output; never every bucket's).

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
    cached = 0
    for plan in plans:
        n = math.prod(mesh[a] for a in plan.dp)
        padded = -(-plan.numel // n) * n
        full.append(padded * master)
        out.append(padded // n * master)
        transient.append(z.on(n).shards_grads)
        if z.on(n).shards_params:
            item = DTYPES[dtype[plan.names[0]]].nbytes
            gathers.append(padded * item)
            cached += padded // n * item if item != master else 0
    grads = full_grad_peak(plans, [p.name for p in reversed(floats)], full, out, transient)
    # a bucket in use and the next one (in bucket order, backward's), gathered at once; at a
    # launch ZeRO-3 has freed that bucket's own (zero.py's grad_done): one is left
    pair = max((a + b for a, b in zip(gathers, [*gathers[1:], 0], strict=False)), default=0)
    one = max(gathers, default=0)
    return Beside(pair + cached + grads.left,
                  cached + max(pair + grads.at_make, one + grads.at_launch),
                  cached + grads.at_end)


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
