"""Normalisation layers over the last dim: layernorm and rmsnorm."""

from __future__ import annotations

from soapstone.dsl.layers.registry import Arg, builtin, last_dim, need_float, positive_number

EPS_HINT = "the small number added to the variance before its root, e.g. eps = 1e-05"


@builtin("layernorm", Arg("x", "tensor"), Arg("eps", "float", 1e-5))
def _layernorm(ctx, x, eps):
    """Layer norm over the last dim d: params gamma[d] (ones), beta[d] (zeros)."""
    need_float(ctx, x, "layernorm's input")
    positive_number(ctx, eps, "layernorm eps", EPS_HINT)
    d = last_dim(ctx, x, "layernorm")
    gamma = ctx.param("gamma", (d,), "ones")
    beta = ctx.param("beta", (d,), "zeros")
    return ctx.op("layernorm", (x, gamma, beta), x.dims, x.dtype, {"eps": float(eps), "over": d})


@builtin("rmsnorm", Arg("x", "tensor"), Arg("eps", "float", 1e-6))
def _rmsnorm(ctx, x, eps):
    """RMS norm over the last dim d: param gamma[d] (ones)."""
    need_float(ctx, x, "rmsnorm's input")
    positive_number(ctx, eps, "rmsnorm eps", EPS_HINT)
    d = last_dim(ctx, x, "rmsnorm")
    gamma = ctx.param("gamma", (d,), "ones")
    return ctx.op("rmsnorm", (x, gamma), x.dims, x.dtype, {"eps": float(eps), "over": d})
