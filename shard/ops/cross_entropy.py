"""cross_entropy: the mean token loss, with its distributed form over a split class dim."""

from __future__ import annotations

import math

from soapstone.shard.ops.record import DistStat, OpRecord, Reduce, Role, StatShape


def cross_entropy_roles(op, arg_dim_lists) -> dict[str, Role]:
    """The class dim STAT (log-sum-exp); the positions SUM (the mean sums over them)."""
    over = op.attr("over")
    return {d: (Role.STAT if d == over else Role.SUM) for d in arg_dim_lists[0]}


def cross_entropy(step, args, ctx):
    """Mean token loss. Split positions give partial sums (divided by the global count);
    a split class dim combines max, log-sum-exp and the target logit across ranks."""
    import torch
    import torch.nn.functional as F

    from soapstone.shard.ops.kernels import Stats, align

    logits, targets = args
    lv, tv = ctx.arg(step, 0), ctx.arg(step, 1)
    over = step.attr("over")
    lead = tuple(d for d in lv.dims if d != over)
    x = align(logits, lv.dims, (*lead, over))
    t = align(targets, tv.dims, lead)
    count = math.prod(ctx.sizes[d] for d in lead)
    classes = step.attr("classes")
    if not step.dist:
        x = x if classes is None else x[..., :classes]  # padded classes: no part in the loss
        c = x.shape[-1]
        return F.cross_entropy(x.reshape(-1, c), t.reshape(-1), reduction="sum") / count
    if classes is not None:  # this rank's padded classes (global index >= classes) masked out
        first = ctx.offset(lv, over)
        pad = torch.arange(first, first + x.shape[-1], device=x.device) >= classes
        x = x.masked_fill(pad, float("-inf"))
    stats = Stats(step, ctx, RECORDS)
    m = stats.reduce(x.detach().amax(-1, keepdim=True), Reduce.MAX)
    se = stats.reduce(torch.exp(x - m).sum(-1), Reduce.SUM)
    lse = torch.log(se) + m.squeeze(-1)
    lo, n = ctx.offset(lv, over), x.shape[-1]
    inside = (t >= lo) & (t < lo + n)
    local = torch.where(inside, t - lo, torch.zeros_like(t))
    # indexing, not gather: gather's backward keeps all of x, indexing only the indices
    rows = tuple(torch.arange(n, device=x.device).view(*(-1 if j == i else 1
                                                          for j in range(local.dim())))
                 for i, n in enumerate(local.shape))
    picked = stats.reduce(x[(*rows, local)] * inside.to(x.dtype), Reduce.SUM)
    return (lse - picked).sum() / count


def cross_entropy_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """The log-probabilities: a tensor of the logits' size."""
    return [], program.value(step.args[0]).nbytes


RECORDS = (
    OpRecord(
        "cross_entropy",
        "args (logits[..., C], targets[...] int). attrs: over=C, optional classes=N (the "
        "first N classes are real, the rest padding left out of the loss). "
        "-> f32[] mean over all target positions",
        kernel=cross_entropy, roles=cross_entropy_roles,
        # the max and the sums are taken with the class dim moved last: the max keeps it
        dist_stats=(DistStat(Reduce.MAX, False, StatShape.LAST),
                    DistStat(Reduce.SUM, False, StatShape.DROP),
                    DistStat(Reduce.SUM, False, StatShape.DROP)),
        saves=cross_entropy_saves,
    ),
)
