"""Positions: position ids along a dim, and rotary position embedding (rope)."""

from __future__ import annotations

import math

from soapstone.dsl.layers.registry import Arg, Operand, builtin, dims_text, last_dim, need_float


@builtin("positions", Arg("dim", "dim"))
def _positions(ctx, dim):
    """positions(seq) -> i64[seq]: 0, 1, ... along a dim; where the dim is split, each rank
    holds its own slice's global positions (learned position embeddings index with it)."""
    return ctx.op("positions", (), (dim,), "i64", {"over": dim})


def rope_op(ctx, x: Operand, pos: str, over: str, theta: float, name: str | None = None):
    if not (math.isfinite(theta) and theta > 0):
        ctx.error(f"rope theta = {theta}: the rotary base must be a positive number",
                  "LLaMA uses 10000.0; for no rotary embedding leave the argument out")
    if ctx.size(over) % 2:
        ctx.error(f"rope rotates pairs: {over} = {ctx.size(over)} must be even")
    return ctx.op("rope", (x,), x.dims, x.dtype,
                  {"over": over, "pos": pos, "theta": float(theta)}, name=name)


@builtin("rope", Arg("x", "tensor"), Arg("pos", "dim"), Arg("theta", "float", 10000.0))
def _rope(ctx, x, pos, theta):
    """Rotary position embedding of x's last dim by the global position along `pos`
    (LLaMA's half-split rotation; exact where pos is split: each rank uses its own positions)."""
    need_float(ctx, x, "rope's input")
    over = last_dim(ctx, x, "rope")
    if pos not in x.dims or pos == over:
        ctx.error(f"rope's position dim {pos} must be a dim of x {dims_text(x.dims)} other than "
                  f"the rotated {over}")
    return rope_op(ctx, x, pos, over, theta)
