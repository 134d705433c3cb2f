"""Positions: the global index along a dim, and the rotary embedding (rope) by it."""

from __future__ import annotations

import math

from soapstone.shard.ops.record import OpRecord, Partial, Role, per_element


def positions(step, args, ctx):
    """0, 1, ... along `over`: the global positions of this rank's slice where it is split."""
    return ctx.index(ctx.out(step), step.attr("over"))


def rope_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Rotates pairs across the whole `over` dim: it never splits; the rest are FREE."""
    return {d: Role.FREE for d in op.type.dims if d != op.attr("over")}


def inverse_frequencies(n: int, theta: float, scaling: tuple | None, dtype):
    """theta^(-2i/n) for i < n/2; with LLaMA-3 scaling (factor, low_freq, high_freq,
    original_max) the long wavelengths are divided by factor and the middle band blended, as
    Hugging Face's `llama3` rope type computes them (same dtype, same order of operations)."""
    import torch

    inv = 1.0 / theta ** (torch.arange(0, n, 2, dtype=torch.int64).to(dtype) / n)
    if scaling is None:
        return inv
    factor, low, high, original = (float(a) for a in scaling)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def scaling_of(step) -> tuple | None:
    """The rope op's LLaMA-3 frequency scaling (factor, low_freq, high_freq, original_max),
    None when it has none (factor 1)."""
    factor = step.attr("factor")
    if factor is None:
        return None
    return (factor, step.attr("low_freq"), step.attr("high_freq"), step.attr("original_max"))


def rope(step, args, ctx):
    """x * cos + rotate_half(x) * sin at the global positions of this rank's slice, the angles
    pos * theta^(-2i/d) (LLaMA-3 scaled when the op says so) in fp32 (fp64 for fp64 x) as
    Hugging Face's LLaMA computes them."""
    import torch

    from soapstone.shard.ops.kernels import align

    x = args[0]
    v = ctx.arg(step, 0)
    pos, over, theta = step.attr("pos"), step.attr("over"), float(step.attr("theta"))
    scaling = scaling_of(step)
    axis = ctx.balanced_over(v, pos)
    where = ("balanced", *(ctx.mesh.coord(a) for a in v.layout.dim_axes(pos))) if axis else \
        (ctx.offset(v, pos), v.local_shape[v.dims.index(pos)])
    key = ("rope", pos, over, theta, scaling, where, v.dims, x.dtype, x.device)
    if key not in ctx.constants:
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        inv = inverse_frequencies(ctx.sizes[over], theta, scaling, wide)
        p = ctx.index(v, pos).cpu()  # balanced: the zigzag chunks' own positions
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
             "theta^(-2i/|d|); optional factor, low_freq, high_freq, original_max: LLaMA-3's "
             "frequency scaling (long wavelengths / factor, the band between blended)", kernel=rope,
             roles=rope_roles, partial_pass=Partial.ONE, flops=per_element(6)),
)
