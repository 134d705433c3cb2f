"""Gradient buckets planned from the Program alone (pure data, no torch).

The runtime (shard/parallel/data_parallel.py, GradReducer) builds exactly these buckets and
`soapstone explain` counts their collectives, so the two agree by construction. Float parameters go
in
reverse program order (the order backward produces their gradients) into buckets of at most
`bucket_mb` MiB, the first at most 1 MiB as in PyTorch DDP so communication starts early.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.dtypes import is_float

FIRST_BUCKET_BYTES = 1 << 20


@attrs.frozen
class BucketPlan:
    """One bucket as planned from the Program alone: its parameters (in slot order) and keys."""

    names: tuple[str, ...]
    numel: int  # local elements of its parameters, before padding
    sync: tuple[str, ...]
    dp: tuple[str, ...]
    split: tuple[str, ...]
    block: str | None
    deferred: bool


def plan_buckets(program, zero: int | ZeroStage, data_axes: tuple[str, ...],
                 deferred: tuple[str, ...] = (), bucket_mb: float = 25.0) -> list[BucketPlan]:
    """The buckets GradReducer builds for `program` (the module doc's rules), from the Program
    alone (torch-free, so `soapstone explain` counts the same collectives the runtime issues).
    Float parameters in reverse program order; a bucket's key is (grad_sync, data axes among
    them, split axes, block under ZeRO-3, own name if deferred); buckets are numbered by their
    first parameter, or under ZeRO-2/3 by their last (the order they fill)."""
    per_block = ZeroStage.of(zero).shards_params
    cap = max(int(bucket_mb * (1 << 20)), 1)
    axes_order = [a for a, _ in program.mesh]
    open_: dict[tuple, list[str]] = {}
    open_bytes: dict[tuple, int] = {}
    order: list[tuple[tuple, list[str]]] = []  # closed or open groups, by first param
    numel: dict[str, int] = {}
    first_cap = min(cap, FIRST_BUCKET_BYTES)
    for spec in reversed(program.params):
        if not is_float(spec.dtype):
            continue
        split = spec.layout.split_axes()
        dp = tuple(a for a in axes_order if a in spec.grad_sync and a in data_axes)
        key = (spec.grad_sync, dp, split, spec.block if per_block else None,
               spec.name if spec.name in deferred else None)
        n = numel[spec.name] = math.prod(spec.local_shape)
        group = open_.get(key)
        limit = first_cap if not order or group is order[0][1] else cap
        if group is not None and open_bytes[key] + n * 4 > limit:
            group = None
        if group is None:
            group = open_[key] = []
            open_bytes[key] = 0
            order.append((key, group))
        group.append(spec.name)
        open_bytes[key] += n * 4
    if ZeroStage.of(zero).shards_grads:
        # launched in index order: number them in the order they fill (their last gradient),
        # so a bucket that spans the stage (layernorm weights under sequence parallelism, the
        # output layer beside the embedding) holds back no other's reduce-scatter, nor its
        # full buffer, until backward's end
        arrival = {name: i for i, name in enumerate(numel)}
        order.sort(key=lambda group: arrival[group[1][-1]])
    return [BucketPlan(tuple(names), sum(numel[x] for x in names), sync, dp, split, block,
                       own is not None)
            for (sync, dp, split, block, own), names in order]


# ZeRO-2/3: reduce-scatters launched and not yet waited, at most. Launching bucket n + K waits
# bucket n's and frees its full gradient buffer (FSDP2 keeps one in flight likewise), so
# backward holds K + 1 full buffers, not every bucket's until the step.
REDUCTIONS_IN_FLIGHT = 1


@attrs.frozen
class GradBuffers:
    """Bytes of the gradient buffers a backward makes beside the kept shards (full_grad_peak):
    the most held when a bucket's full buffer is made (its first gradient), the most held at a
    launch (ZeRO-3 has freed that bucket's gathered parameters by then: zero.py's grad_done),
    the most at the launches of the last gradient (backward's end: its saved tensors are
    freed), and what is still held after backward (deferred buckets: the rest is waited)."""

    at_make: int
    at_launch: int
    at_end: int
    left: int


def full_grad_peak(plans: list[BucketPlan], arrival: list[str], full: list[int],
                   out: list[int], transient: list[bool]) -> GradBuffers:
    """The gradient buffers GradReducer holds in backward beside the kept shards: the full
    buffer of each bucket whose buffer lives only until its reduce-scatter (`transient[i]`:
    ZeRO-2/3 over several data ranks; `full[i]` bytes, padded) and the reduce-scatter's output
    (`out[i]` bytes) until it is waited and added to the shard; a deferred bucket's full
    buffer, until the step. Gradients arrive in `arrival` order (reverse program order); a
    buffer is made at its bucket's first gradient; full buckets launch in index order; a
    transient bucket's launch waits the one launched REDUCTIONS_IN_FLIGHT before it; the end of
    backward waits the rest."""
    where = {name: i for i, plan in enumerate(plans) for name in plan.names}
    filled = [0] * len(plans)
    window: list[int] = []
    live = at_make = at_launch = at_end = nxt = 0
    for k, name in enumerate(arrival):
        i = where[name]
        if filled[i] == 0 and (transient[i] or plans[i].deferred):
            live += full[i]
            at_make = max(at_make, live)
        filled[i] += 1
        while nxt < len(plans) and filled[nxt] == len(plans[nxt].names):
            if transient[nxt] and not plans[nxt].deferred:
                window.append(nxt)
                live += out[nxt]
                if k == len(arrival) - 1:
                    at_end = max(at_end, live)
                else:
                    at_launch = max(at_launch, live)
                if len(window) > REDUCTIONS_IN_FLIGHT:
                    done = window.pop(0)
                    live -= full[done] + out[done]
            nxt += 1
    return GradBuffers(at_make, at_launch, at_end,
                       live - sum(full[i] + out[i] for i in window))

