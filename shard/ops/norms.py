"""Normalisations over one dim: layernorm and rmsnorm, each with its distributed form."""

from __future__ import annotations

from soapstone.shard.ops.record import DistStat, OpRecord, Reduce, Role, keeps_args, per_element


def over_roles(op, arg_dim_lists) -> dict[str, Role]:
    """The dim the op reduces over (`over`) STAT, the other output dims FREE."""
    over = op.attr("over")
    return {d: (Role.STAT if d == over else Role.FREE) for d in op.type.dims}


def layernorm(step, args, ctx):
    """Normalise over `over`; split, mean and variance combine partial sums across ranks."""
    import torch
    import torch.nn.functional as F

    from soapstone.shard.ops.kernels import Stats, align

    x, gamma, beta = args
    xv = ctx.arg(step, 0)
    over, eps = step.attr("over"), float(step.attr("eps", 1e-5))
    d = xv.dims.index(over)
    g, b = align(gamma, (over,), xv.dims), align(beta, (over,), xv.dims)
    if not step.dist and d == x.dim() - 1:
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    n, stats = ctx.sizes[over], Stats(step, ctx, RECORDS)
    centred = x - stats.reduce(x.sum(d, keepdim=True), Reduce.SUM) / n
    var = stats.reduce((centred * centred).sum(d, keepdim=True), Reduce.SUM) / n
    return centred * torch.rsqrt(var + eps) * g + b


def layernorm_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Over the last dim (F.layer_norm): the input and per-row mean and 1/std (in the
    input's dtype, as the CPU kernel keeps them); the composite form (distributed, or over
    another dim): the input and two products of its size."""
    x = program.value(step.args[0])
    if x.dims[-1] == step.attr("over") and not step.dist:
        return floats[:1], 2 * x.nbytes // max(1, x.local_shape[-1])
    return floats[:1], 2 * x.nbytes


def rmsnorm(step, args, ctx):
    """x / rms(x) * gamma over `over`, the mean square combined across ranks when split."""
    import torch

    from soapstone.shard.ops.kernels import Stats, align

    x, gamma = args
    xv = ctx.arg(step, 0)
    over, eps = step.attr("over"), float(step.attr("eps", 1e-6))
    d = xv.dims.index(over)
    ms = Stats(step, ctx, RECORDS).reduce((x * x).sum(d, keepdim=True), Reduce.SUM)
    ms = ms / ctx.sizes[over]
    return x * torch.rsqrt(ms + eps) * align(gamma, (over,), xv.dims)


def rmsnorm_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """The input and one product of its size."""
    return floats[:1], program.value(step.args[0]).nbytes


RECORDS = (
    OpRecord("layernorm", "args (x, gamma[d], beta[d]). attrs: over=d, eps",
             kernel=layernorm, roles=over_roles,
             dist_stats=(DistStat(Reduce.SUM, True), DistStat(Reduce.SUM, True)),
             flops=per_element(8), saves=layernorm_saves, keeps=keeps_args),
    OpRecord("rmsnorm", "args (x, gamma[d]). attrs: over=d, eps",
             kernel=rmsnorm, roles=over_roles, dist_stats=(DistStat(Reduce.SUM, True),),
             flops=per_element(5), saves=rmsnorm_saves, keeps=keeps_args),
)
