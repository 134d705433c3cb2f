"""Elementwise layers: add and mul (broadcast by dim name), activations, dropout, softmax."""

from __future__ import annotations

from soapstone.dsl.layers.registry import Arg, Operand, broadcast, builtin, last_dim, need_float


@builtin("add", Arg("a", "tensor"), Arg("b", "tensor"))
def _add(ctx, a, b):
    """a + b, broadcast by dim name."""
    return broadcast(ctx, "add", a, b)


@builtin("mul", Arg("a", "tensor"), Arg("b", "tensor"))
def _mul(ctx, a, b):
    """a * b, broadcast by dim name."""
    return broadcast(ctx, "mul", a, b)


def _unary(kind: str) -> None:
    @builtin(kind, Arg("x", "tensor"), doc=f"elementwise {kind}")
    def _expand(ctx, x):
        need_float(ctx, x, f"{kind}'s input")
        return ctx.op(kind, (x,), x.dims, x.dtype)


for _kind in ("relu", "silu"):
    _unary(_kind)


@builtin("gelu", Arg("x", "tensor"), Arg("approximate", "choice", "none", ("none", "tanh")))
def _gelu(ctx, x, approximate):
    """Elementwise GELU; approximate = tanh is GPT-2's form."""
    need_float(ctx, x, "gelu's input")
    return ctx.op("gelu", (x,), x.dims, x.dtype, gelu_attrs(approximate))


def gelu_attrs(approximate: str) -> dict | None:
    """The gelu op record's attrs for `approximate` (none: no attrs, the exact erf form)."""
    return {"approximate": approximate} if approximate != "none" else None


def activation_op(ctx, kind: str, y: Operand, name: str) -> Operand:
    """An mlp's activation by its choice name (gelu_tanh: gelu, approximate = tanh)."""
    if kind == "gelu_tanh":
        return ctx.op("gelu", (y,), y.dims, y.dtype, gelu_attrs("tanh"), name=name)
    return ctx.op(kind, (y,), y.dims, y.dtype, name=name)


@builtin("dropout", Arg("x", "tensor"), Arg("p", "float", 0.1))
def _dropout(ctx, x, p):
    """Zero each element with probability p (training only)."""
    need_float(ctx, x, "dropout's input")
    if not 0.0 <= p < 1.0:
        ctx.error(f"dropout p = {p} is not in [0, 1)")
    return ctx.op("dropout", (x,), x.dims, x.dtype, {"p": float(p)})


@builtin("softmax", Arg("x", "tensor"))
def _softmax(ctx, x):
    """Softmax over the last dim."""
    need_float(ctx, x, "softmax's input")
    return ctx.op("softmax", (x,), x.dims, x.dtype, {"over": last_dim(ctx, x, "softmax")})
