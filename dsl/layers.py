"""The built-in layers: a registry of name -> LayerDef (signature + expansion into primitives).

Each layer's `expand(ctx, **args)` emits primitive ops (see `ir.PRIMITIVES`) through the
expansion context `ctx` (dsl.checker.Ctx), which owns naming and error reporting:

    ctx.param(local, dims, init)          -> Operand   param "<scope>.<layer><k>.<local>"
    ctx.op(kind, args, dims, dtype, attrs, name=None) -> Operand
                                          name=None: the layer's result; else "<inst>.<name>"
    ctx.call(layer, *args, final=False, **kw) -> Operand   a sub-layer (mlp uses linear)
    ctx.size(dim), ctx.derive(dim, size, alias_of=None), ctx.error(message, hint=None)

The expansion decides which collectives the compiler will emit, so it is fixed and tested.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from soapstone.shard.plan.dtypes import FLOATS, INTS

DTYPES = FLOATS + INTS  # what a spec may declare (bool is no input dtype)
PARAM_DTYPE = "f32"

REQUIRED = object()


@attrs.frozen
class Operand:
    """A tensor a layer takes or returns while it expands: its SSA name and named-dim type.
    (A tensor of the compiled program is soapstone.shard.plan.program.Value.)"""

    name: str
    dtype: str
    dims: tuple[str, ...]

    def __repr__(self) -> str:
        return f"{self.name}: {self.dtype}[{', '.join(self.dims)}]"


@attrs.frozen
class Arg:
    """One layer argument. kind: tensor | dim | map | bool | float | int | choice."""

    name: str
    kind: str
    default: object = REQUIRED
    choices: tuple[str, ...] = ()


@attrs.frozen
class LayerDef:
    name: str
    args: tuple[Arg, ...]
    expand: Callable = attrs.field(eq=False)
    doc: str = ""


LAYERS: dict[str, LayerDef] = {}


def builtin(name: str, *args: Arg, doc: str = "") -> Callable[[Callable], Callable]:
    """Register a built-in layer's expansion under `name`."""

    def register(fn: Callable) -> Callable:
        LAYERS[name] = LayerDef(name, tuple(args), fn, doc or (fn.__doc__ or "").strip())
        return fn

    return register


def _float(ctx, x: Operand, what: str) -> None:
    if x.dtype not in FLOATS:
        ctx.error(f"{what} must be a float tensor, got {x.dtype}", "convert ids with embedding()")


def _dims(dims) -> str:
    return "[" + ", ".join(dims) + "]"


def _last(ctx, x: Operand, what: str) -> str:
    if not x.dims:
        ctx.error(f"{what} needs a tensor with at least one dim, got a scalar")
    return x.dims[-1]


def broadcast(ctx, kind: str, a: Operand, b: Operand, name: str | None = None) -> Operand:
    """add/mul by dim name: the left operand's dims, then the right's new ones."""
    if a.dtype != b.dtype:
        ctx.error(f"{kind} of {a.dtype} and {b.dtype} tensors", "both operands need one dtype")
    _float(ctx, a, f"{kind}'s operands")
    dims = a.dims + tuple(d for d in b.dims if d not in a.dims)
    return ctx.op(kind, (a, b), dims, a.dtype, name=name)


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
        _float(ctx, x, f"{kind}'s input")
        return ctx.op(kind, (x,), x.dims, x.dtype)


for _kind in ("relu", "silu"):
    _unary(_kind)


@builtin("gelu", Arg("x", "tensor"), Arg("approximate", "choice", "none", ("none", "tanh")))
def _gelu(ctx, x, approximate):
    """Elementwise GELU; approximate = tanh is GPT-2's form."""
    _float(ctx, x, "gelu's input")
    return ctx.op("gelu", (x,), x.dims, x.dtype, _gelu_attrs(approximate))


def _gelu_attrs(approximate: str) -> dict | None:
    return {"approximate": approximate} if approximate != "none" else None


def _activation(ctx, kind: str, y: Operand, name: str) -> Operand:
    """An mlp's activation by its choice name (gelu_tanh: gelu, approximate = tanh)."""
    if kind == "gelu_tanh":
        return ctx.op("gelu", (y,), y.dims, y.dtype, _gelu_attrs("tanh"), name=name)
    return ctx.op(kind, (y,), y.dims, y.dtype, name=name)


@builtin("positions", Arg("dim", "dim"))
def _positions(ctx, dim):
    """positions(seq) -> i64[seq]: 0, 1, ... along a dim; where the dim is split, each rank
    holds its own slice's global positions (learned position embeddings index with it)."""
    return ctx.op("positions", (), (dim,), "i64", {"over": dim})


def _rope_op(ctx, x: Operand, pos: str, over: str, theta: float, name: str | None = None):
    if theta <= 0:
        ctx.error(f"rope theta = {theta} must be positive", "LLaMA uses 10000.0")
    if ctx.size(over) % 2:
        ctx.error(f"rope rotates pairs: {over} = {ctx.size(over)} must be even")
    return ctx.op("rope", (x,), x.dims, x.dtype,
                  {"over": over, "pos": pos, "theta": float(theta)}, name=name)


@builtin("rope", Arg("x", "tensor"), Arg("pos", "dim"), Arg("theta", "float", 10000.0))
def _rope(ctx, x, pos, theta):
    """Rotary position embedding of x's last dim by the global position along `pos`
    (LLaMA's half-split rotation; exact where pos is split: each rank uses its own positions)."""
    _float(ctx, x, "rope's input")
    over = _last(ctx, x, "rope")
    if pos not in x.dims or pos == over:
        ctx.error(f"rope's position dim {pos} must be a dim of x {_dims(x.dims)} other than "
                  f"the rotated {over}")
    return _rope_op(ctx, x, pos, over, theta)


@builtin("dropout", Arg("x", "tensor"), Arg("p", "float", 0.1))
def _dropout(ctx, x, p):
    """Zero each element with probability p (training only)."""
    _float(ctx, x, "dropout's input")
    if not 0.0 <= p < 1.0:
        ctx.error(f"dropout p = {p} is not in [0, 1)")
    return ctx.op("dropout", (x,), x.dims, x.dtype, {"p": float(p)})


@builtin("softmax", Arg("x", "tensor"))
def _softmax(ctx, x):
    """Softmax over the last dim."""
    _float(ctx, x, "softmax's input")
    return ctx.op("softmax", (x,), x.dims, x.dtype, {"over": _last(ctx, x, "softmax")})


@builtin("layernorm", Arg("x", "tensor"), Arg("eps", "float", 1e-5))
def _layernorm(ctx, x, eps):
    """Layer norm over the last dim d: params gamma[d] (ones), beta[d] (zeros)."""
    _float(ctx, x, "layernorm's input")
    d = _last(ctx, x, "layernorm")
    gamma = ctx.param("gamma", (d,), "ones")
    beta = ctx.param("beta", (d,), "zeros")
    return ctx.op("layernorm", (x, gamma, beta), x.dims, x.dtype, {"eps": float(eps), "over": d})


@builtin("rmsnorm", Arg("x", "tensor"), Arg("eps", "float", 1e-6))
def _rmsnorm(ctx, x, eps):
    """RMS norm over the last dim d: param gamma[d] (ones)."""
    _float(ctx, x, "rmsnorm's input")
    d = _last(ctx, x, "rmsnorm")
    gamma = ctx.param("gamma", (d,), "ones")
    return ctx.op("rmsnorm", (x, gamma), x.dims, x.dtype, {"eps": float(eps), "over": d})


@builtin("embedding", Arg("ids", "tensor"), Arg("dims", "map"))
def _embedding(ctx, ids, dims):
    """embedding(ids, vocab -> hidden): param table[vocab, hidden]; ids.dims + [hidden]."""
    vocab, hidden = dims
    if ids.dtype not in INTS:
        ctx.error(f"embedding ids must be an integer tensor, got {ids.dtype}",
                  "declare the input as i64[...]")
    if vocab in ids.dims or hidden in ids.dims:
        ctx.error(f"embedding {vocab} -> {hidden}: ids {_dims(ids.dims)} already has that dim")
    src = ctx.producer(ids.name)
    if src is not None and src.kind == "positions" and ctx.size(ids.dims[0]) > ctx.size(vocab):
        d = ids.dims[0]
        ctx.error(f"positions({d}) reach {ctx.size(d) - 1}, but the table has only "
                  f"{vocab} = {ctx.size(vocab)} rows",
                  f"--dim {vocab}={ctx.size(d)}, or a shorter {d}")
    table = ctx.param("table", (vocab, hidden), "normal(0.02)")
    return ctx.op("embedding", (ids, table), ids.dims + (hidden,), PARAM_DTYPE,
                  {"hidden": hidden, "vocab": vocab})


@builtin("linear", Arg("x", "tensor"), Arg("dims", "map"), Arg("bias", "bool", True))
def _linear(ctx, x, dims, bias):
    """linear(x, a -> b, bias = true): weight[a, b] normal(0.02), bias[b] zeros."""
    a, b = dims
    _float(ctx, x, "linear's input")
    last = _last(ctx, x, "linear")
    if last != a:
        ctx.error(f"linear({a} -> {b}) needs an input whose last dim is {a}, got "
                  f"{_dims(x.dims)}", f"write linear(x, {last} -> {b})")
    if b in x.dims or a == b:
        ctx.error(f"linear({a} -> {b}): the output dim {b} is already a dim of the input",
                  "declare a new dim for the output")
    out = x.dims[:-1] + (b,)
    w = ctx.param("weight", (a, b), "normal(0.02)")
    if not bias:
        return ctx.op("einsum", (x, w), out, x.dtype)
    y = ctx.op("einsum", (x, w), out, x.dtype, name="mm")
    bb = ctx.param("bias", (b,), "zeros")
    return ctx.op("add", (y, bb), out, x.dtype)


@builtin("mlp", Arg("x", "tensor"), Arg("ffn", "dim"),
         Arg("activation", "choice", "gelu", ("gelu", "gelu_tanh", "relu", "silu")),
         Arg("bias", "bool", True), Arg("gated", "bool", False))
def _mlp(ctx, x, ffn, activation, bias, gated):
    """mlp(x, ffn, activation = gelu, bias = true, gated = false): linear(h -> ffn),
    activation, linear(ffn -> h); gated (LLaMA's SwiGLU with silu): act(linear0(x)) *
    linear1(x), then linear2(ffn -> h)."""
    h = _last(ctx, x, "mlp")
    if ffn in x.dims:
        ctx.error(f"mlp's ffn dim {ffn} is already a dim of the input {_dims(x.dims)}")
    y = ctx.call("linear", x, (h, ffn), bias=bias)
    y = _activation(ctx, activation, y, "act")
    if gated:
        up = ctx.call("linear", x, (h, ffn), bias=bias)
        y = ctx.op("mul", (y, up), y.dims, y.dtype, name="gate")
    return ctx.call("linear", y, (ffn, h), final=True, bias=bias)


@builtin("attention", Arg("x", "tensor"), Arg("heads", "dim"), Arg("causal", "bool", True),
         Arg("kv_heads", "dim", None), Arg("rope", "float", 0.0), Arg("bias", "bool", True),
         Arg("qkv_bias", "bool", False))
def _attention(ctx, x, heads, causal, kv_heads, rope, bias, qkv_bias):
    """Multi-head self-attention over x[..., S, h]: q, k, v projections (einsum with wq, wk,
    wv[h, heads, head_dim]), scores[..., heads, S, S_k] scaled by 1/sqrt(head_dim), an optional
    causal_mask, softmax over S_k, o = probs x v, then the output projection wo and bias bo.
    kv_heads: grouped-query attention (wk, wv[h, kv_heads, head_dim], each kv head serving
    heads / kv_heads query heads through repeat_dim); rope = THETA rotates q and k by their
    global positions along S; bias = false drops bo; qkv_bias = true adds bq, bk, bv.
    The primitives it emits are listed in ir.PRIMITIVES."""
    _float(ctx, x, "attention's input")
    if len(x.dims) < 2:
        ctx.error(f"attention needs x[..., seq, hidden], got {_dims(x.dims)}")
    lead, S, h = x.dims[:-2], x.dims[-2], x.dims[-1]
    H = heads
    if H in x.dims:
        ctx.error(f"attention heads dim {H} is already a dim of the input {_dims(x.dims)}")
    hs, Hs = ctx.size(h), ctx.size(H)
    if hs % Hs:
        ok = [n for n in range(1, hs + 1) if hs % n == 0]
        near = min(ok, key=lambda n: (abs(n - Hs), -n))
        ctx.error(f"{h} = {hs} does not divide evenly over {H} = {Hs}",
                  f"use {H} = {near} (head_dim = {hs // near})")
    hd = ctx.derive("head_dim", hs // Hs, why=f"{h} / {H}")
    Sk = ctx.derive(f"{S}_k", ctx.size(S), alias_of=S, why=f"the key positions of {S}")
    if hd in x.dims or Sk in x.dims:
        ctx.error(f"attention's derived dims {hd}, {Sk} clash with the input {_dims(x.dims)}")
    KV = _kv_heads(ctx, x, H, kv_heads)
    wq = ctx.param("wq", (h, H, hd), "normal(0.02)")
    wk = ctx.param("wk", (h, KV, hd), "normal(0.02)")
    wv = ctx.param("wv", (h, KV, hd), "normal(0.02)")
    wo = ctx.param("wo", (H, hd, h), "normal(0.02)")
    dt = x.dtype
    heads_dims = lead + (S, H, hd)

    def project(w: Operand, nh: str, name: str) -> Operand:
        if not qkv_bias:
            return ctx.op("einsum", (x, w), lead + (S, nh, hd), dt, name=name)
        y = ctx.op("einsum", (x, w), lead + (S, nh, hd), dt, name=f"{name}_mm")
        b = ctx.param(f"b{name}", (nh, hd), "zeros")
        return ctx.op("add", (y, b), y.dims, dt, name=name)

    q, k, v = project(wq, H, "q"), project(wk, KV, "k"), project(wv, KV, "v")
    if rope:
        q = _rope_op(ctx, q, S, hd, rope, name="q_rot")
        k = _rope_op(ctx, k, S, hd, rope, name="k_rot")
    k2 = ctx.op("rename", (k,), lead + (Sk, KV, hd), dt, {"dst": Sk, "src": S}, name="k2")
    v2 = ctx.op("rename", (v,), lead + (Sk, KV, hd), dt, {"dst": Sk, "src": S}, name="v2")
    if KV != H:  # each kv head serves heads / kv_heads query heads
        kdims = lead + (Sk, H, hd)
        k2 = ctx.op("repeat_dim", (k2,), kdims, dt, {"dst": H, "src": KV}, name="k_rep")
        v2 = ctx.op("repeat_dim", (v2,), kdims, dt, {"dst": H, "src": KV}, name="v_rep")
    sdims = lead + (H, S, Sk)
    s = ctx.op("einsum", (q, k2), sdims, dt, {"scale": 1.0 / math.sqrt(ctx.size(hd))},
               name="scores")
    if causal:
        s = ctx.op("causal_mask", (s,), sdims, dt, {"key": Sk, "query": S}, name="masked")
    p = ctx.op("softmax", (s,), sdims, dt, {"over": Sk}, name="probs")
    o = ctx.op("einsum", (p, v2), heads_dims, dt, name="o")
    if not bias:
        return ctx.op("einsum", (o, wo), lead + (S, h), dt)
    y = ctx.op("einsum", (o, wo), lead + (S, h), dt, name="y")
    bo = ctx.param("bo", (h,), "zeros")
    return ctx.op("add", (y, bo), lead + (S, h), dt)


def _kv_heads(ctx, x: Operand, H: str, kv: str | None) -> str:
    """The key/value heads dim: heads itself, or a dim whose size divides heads."""
    if kv is None or kv == H:
        return H
    if kv in x.dims:
        ctx.error(f"attention kv_heads dim {kv} is already a dim of the input {_dims(x.dims)}")
    hs, ks = ctx.size(H), ctx.size(kv)
    if hs % ks:
        ok = [n for n in range(1, hs + 1) if hs % n == 0]
        ctx.error(f"{kv} = {ks} does not divide {H} = {hs}: each kv head serves a whole group "
                  "of query heads", f"use {kv} = one of {', '.join(map(str, ok))}")
    return kv


@builtin("cross_entropy", Arg("logits", "tensor"), Arg("targets", "tensor"))
def _cross_entropy(ctx, logits, targets):
    """Mean cross entropy of logits[..., C] (float) against targets[...] (integer) -> f32[]."""
    _float(ctx, logits, "cross_entropy's logits")
    C = _last(ctx, logits, "cross_entropy")
    if targets.dtype not in INTS:
        ctx.error(f"cross_entropy targets must be an integer tensor, got {targets.dtype}",
                  "declare targets as i64[...]")
    if targets.dims != logits.dims[:-1]:
        ctx.error(f"cross_entropy targets {_dims(targets.dims)} must have the logits' leading "
                  f"dims {_dims(logits.dims[:-1])}")
    return ctx.op("cross_entropy", (logits, targets), (), "f32", {"over": C})


from . import moe_layer  # noqa: E402, F401 - registers `moe` (its own module: dsl/moe_layer.py)
