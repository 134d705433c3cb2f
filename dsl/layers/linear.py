"""Projections: linear, and the mlp built from it."""

from __future__ import annotations

from soapstone.dsl.layers.elementwise import activation_op
from soapstone.dsl.layers.registry import Arg, builtin, dims_text, last_dim, need_float


@builtin("linear", Arg("x", "tensor"), Arg("dims", "map"), Arg("bias", "bool", True),
         Arg("float8", "bool", True))
def _linear(ctx, x, dims, bias, float8):
    """linear(x, a -> b, bias = true, float8 = true): weight[a, b] normal(0.02), bias[b]
    zeros; float8 = false keeps its matmul in bf16 under `run --precision float8` (as
    torchtitan keeps its output projection)."""
    a, b = dims
    need_float(ctx, x, "linear's input")
    last = last_dim(ctx, x, "linear")
    if last != a:
        ctx.error(f"linear({a} -> {b}) needs an input whose last dim is {a}, got "
                  f"{dims_text(x.dims)}", f"write linear(x, {last} -> {b})")
    if b in x.dims or a == b:
        ctx.error(f"linear({a} -> {b}): the output dim {b} is already a dim of the input",
                  "declare a new dim for the output")
    out = x.dims[:-1] + (b,)
    w = ctx.param("weight", (a, b), "normal(0.02)")
    keep = None if float8 else {"float8": False}  # only when set: Programs stay as they were
    if not bias:
        return ctx.op("einsum", (x, w), out, x.dtype, keep)
    y = ctx.op("einsum", (x, w), out, x.dtype, keep, name="mm")
    bb = ctx.param("bias", (b,), "zeros")
    return ctx.op("add", (y, bb), out, x.dtype)


@builtin("mlp", Arg("x", "tensor"), Arg("ffn", "dim"),
         Arg("activation", "choice", "gelu", ("gelu", "gelu_tanh", "relu", "silu")),
         Arg("bias", "bool", True), Arg("gated", "bool", False))
def _mlp(ctx, x, ffn, activation, bias, gated):
    """mlp(x, ffn, activation = gelu, bias = true, gated = false): linear(h -> ffn),
    activation, linear(ffn -> h); gated (LLaMA's SwiGLU with silu): act(linear0(x)) *
    linear1(x), then linear2(ffn -> h)."""
    h = last_dim(ctx, x, "mlp")
    if ffn in x.dims:
        ctx.error(f"mlp's ffn dim {ffn} is already a dim of the input {dims_text(x.dims)}")
    y = ctx.call("linear", x, (h, ffn), bias=bias)
    y = activation_op(ctx, activation, y, "act")
    if gated:
        up = ctx.call("linear", x, (h, ffn), bias=bias)
        y = ctx.op("mul", (y, up), y.dims, y.dtype, name="gate")
    return ctx.call("linear", y, (ffn, h), final=True, bias=bias)
