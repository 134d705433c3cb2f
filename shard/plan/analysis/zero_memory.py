"""What ZeRO holds beside a step's working set, from the runtime's own bucket plan (torch-free):
ZeRO-3's gathered parameter buckets (shard/parallel/zero.py: the one in use and the next one,
prefetched) and its compute-dtype copies of the master shards (bf16: kept all step), and
ZeRO-2/3's gradient buffers in flight (shard/parallel/bucket_plan.py's full_grad_peak: the
bucket filling, the reduce-scatter running and its output; never every bucket's)."""

from __future__ import annotations

import math

import attrs

from soapstone.shard.parallel.bucket_plan import BucketPlan, full_grad_peak
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.dtypes import DTYPES


@attrs.frozen
class Beside:
    """Bytes held beside forward's and backward's working sets, and at backward's end (its
    saved tensors freed by then: a floor on the working set above them, not an addition)."""

    forward: int
    backward: int
    end: int


def zero_beside(program, plans: list[BucketPlan], zero: int | ZeroStage, master: int,
                saved: int) -> Beside:
    """Beside for `program` under `zero`, its buckets `plans`: gradient buffers of `master`
    bytes an element, padded to a multiple of the data ranks as the runtime pads; `saved`: the
    bytes saved for backward (freed at its end)."""
    z = ZeroStage.of(zero)
    mesh = dict(program.mesh)
    full, out, transient, gathers = [], [], [], []
    cached = 0
    for plan in plans:
        n = math.prod(mesh[a] for a in plan.dp)
        padded = -(-plan.numel // n) * n
        full.append(padded * master)
        out.append(padded // n * master)
        transient.append(z.on(n).shards_grads)
        if z.on(n).shards_params:
            item = DTYPES[program.value(plan.names[0]).dtype].nbytes
            gathers.append(padded * item)
            cached += padded // n * item if item != master else 0
    arrival = [p.name for p in reversed(program.params) if DTYPES[p.dtype].is_float]
    grads = full_grad_peak(plans, arrival, full, out, transient)
    # a bucket in use and the next one (in bucket order, backward's), gathered at once; at a
    # launch ZeRO-3 has freed that bucket's own (zero.py's grad_done): one is left
    pair = max((a + b for a, b in zip(gathers, [*gathers[1:], 0], strict=False)), default=0)
    one = max(gathers, default=0)
    return Beside(pair + cached + grads.left,
                  cached + max(pair + grads.at_make, one + grads.at_launch),
                  cached + grads.at_end - saved)
