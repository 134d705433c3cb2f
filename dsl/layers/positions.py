"""Positions: position ids along a dim, and rotary position embedding (rope)."""

from __future__ import annotations

import math

from soapstone.dsl.layers.registry import Arg, Operand, builtin, dims_text, last_dim, need_float
from soapstone.shard.plan.sizes import MAX_DIM


@builtin("positions", Arg("dim", "dim"))
def _positions(ctx, dim):
    """positions(seq) -> i64[seq]: 0, 1, ... along a dim; where the dim is split, each rank
    holds its own slice's global positions (learned position embeddings index with it)."""
    return ctx.op("positions", (), (dim,), "i64", {"over": dim})


def scaling_attrs(ctx, factor: float, low: float, high: float, original: int) -> dict:
    """The rope op's scaling attrs (none for factor 1), checked: what Hugging Face's `llama3`
    rope type reads as factor, low_freq_factor, high_freq_factor and
    original_max_position_embeddings."""
    if factor == 1.0:
        return {}
    if not (factor > 1.0 and math.isfinite(factor)):
        ctx.error(f"rope factor = {factor} must be a finite number, at least 1 (1: no scaling)",
                  "LLaMA-3.1 uses factor = 8.0")
    if not 0 < low < high < math.inf:
        ctx.error(f"rope low_freq = {low}, high_freq = {high}: need 0 < low_freq < high_freq, "
                  "both finite",
                  "LLaMA-3.1 uses low_freq = 1.0, high_freq = 4.0")
    if not 1 <= original <= MAX_DIM:  # a context length: positions are int64
        ctx.error(f"rope original_max = {original} must be a positive number of positions "
                  f"(at most {MAX_DIM})",
                  "LLaMA-3.1 uses original_max = 8192")
    return {"factor": float(factor), "low_freq": float(low), "high_freq": float(high),
            "original_max": int(original)}


def rope_op(ctx, x: Operand, pos: str, over: str, theta: float, name: str | None = None,
            scaling: dict | None = None):
    """The rope op rotating x's `over` pairs by the positions along `pos` (scaling: from
    scaling_attrs)."""
    if not (math.isfinite(theta) and theta > 0):
        ctx.error(f"rope theta = {theta}: the rotary base must be a positive number",
                  "LLaMA uses 10000.0; for no rotary embedding leave the argument out")
    if ctx.size(over) % 2:
        ctx.error(f"rope rotates pairs: {over} = {ctx.size(over)} must be even")
    return ctx.op("rope", (x,), x.dims, x.dtype,
                  {"over": over, "pos": pos, "theta": float(theta), **(scaling or {})},
                  name=name)


@builtin("rope", Arg("x", "tensor"), Arg("pos", "dim"), Arg("theta", "float", 10000.0),
         Arg("factor", "float", 1.0), Arg("low_freq", "float", 1.0),
         Arg("high_freq", "float", 4.0), Arg("original_max", "int", 8192))
def _rope(ctx, x, pos, theta, factor, low_freq, high_freq, original_max):
    """Rotary position embedding of x's last dim by the global position along `pos`
    (LLaMA's half-split rotation; exact where pos is split: each rank uses its own positions).
    factor > 1 scales the frequencies as LLaMA-3 does: wavelengths longer than
    original_max / low_freq are stretched by factor, those shorter than original_max /
    high_freq kept, the band between blended."""
    need_float(ctx, x, "rope's input")
    over = last_dim(ctx, x, "rope")
    if pos not in x.dims or pos == over:
        ctx.error(f"rope's position dim {pos} must be a dim of x {dims_text(x.dims)} other than "
                  f"the rotated {over}")
    return rope_op(ctx, x, pos, over, theta,
                   scaling=scaling_attrs(ctx, factor, low_freq, high_freq, original_max))
