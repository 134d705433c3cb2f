"""Positions: the global index along a dim, and the rotary embedding (rope) by it."""

from __future__ import annotations

from soapstone.shard.ops.record import OpRecord, Partial, Role, per_element


def positions(step, args, ctx):
    """0, 1, ... along `over`, shifted to this rank's slice where it is split."""
    import torch

    v = ctx.out(step)
    return torch.arange(v.local_shape[0], dtype=torch.int64, device=ctx.device) \
        + ctx.offset(v, step.attr("over"))


def rope_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Rotates pairs across the whole `over` dim: it never splits; the rest are FREE."""
    return {d: Role.FREE for d in op.type.dims if d != op.attr("over")}


def rope(step, args, ctx):
    """x * cos + rotate_half(x) * sin at the global positions of this rank's slice, the angles
    pos * theta^(-2i/d) in fp32 (fp64 for fp64 x) as Hugging Face's LLaMA computes them."""
    import torch

    from soapstone.shard.ops.kernels import align

    x = args[0]
    v = ctx.arg(step, 0)
    pos, over, theta = step.attr("pos"), step.attr("over"), float(step.attr("theta"))
    first, count = ctx.offset(v, pos), v.local_shape[v.dims.index(pos)]
    key = ("rope", pos, over, theta, first, count, v.dims, x.dtype, x.device)
    if key not in ctx.constants:
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        n = ctx.sizes[over]
        inv = 1.0 / theta ** (torch.arange(0, n, 2, dtype=torch.int64).to(wide) / n)
        p = torch.arange(count) + first
        angles = torch.outer(p.to(wide), inv)
        angles = torch.cat((angles, angles), dim=-1).to(x.device)
        ctx.constants[key] = (align(angles.cos().to(x.dtype), (pos, over), v.dims),
                              align(angles.sin().to(x.dtype), (pos, over), v.dims))
    cos, sin = ctx.constants[key]
    d = v.dims.index(over)
    x1, x2 = x.chunk(2, dim=d)
    return x * cos + torch.cat((-x2, x1), dim=d) * sin


RECORDS = (
    OpRecord("positions", "no args -> i64[d]: the global index along d (a rank's own slice "
             "where d is split). attrs: over=d", kernel=positions),
    OpRecord("rope", "args (x[..., pos, ..., d]). attrs: pos, over=d, theta: rotary "
             "embedding, x's halves along d rotated by the global position along pos times "
             "theta^(-2i/|d|)", kernel=rope, roles=rope_roles, partial_pass=Partial.ONE,
             flops=per_element(6)),
)
