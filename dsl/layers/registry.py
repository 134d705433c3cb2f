"""The layer registry: how a layer declares its arguments and expands into primitive ops.

Each layer's `expand(ctx, **args)` emits primitive ops (their records: shard/ops/) through the
expansion context `ctx` (dsl/model/checker.py's Ctx), which owns naming and error reporting:

    ctx.param(local, dims, init)          -> Operand   param "<scope>.<layer><k>.<local>"
    ctx.op(kind, args, dims, dtype, attrs, name=None) -> Operand
                                          name=None: the layer's result; else "<inst>.<name>"
    ctx.call(layer, *args, final=False, **kw) -> Operand   a sub-layer (mlp uses linear)
    ctx.size(dim), ctx.derive(dim, size, alias_of=None), ctx.error(message, hint=None)

The expansion decides which collectives the compiler will emit, so it is fixed and tested.
The built-in layers register themselves here, one module each in this room.
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

def need_float(ctx, x: Operand, what: str) -> None:
    """Refuse a non-float tensor where a layer computes in floating point."""
    if x.dtype not in FLOATS:
        ctx.error(f"{what} must be a float tensor, got {x.dtype}", "convert ids with embedding()")


def positive_number(ctx, value: float, what: str, hint: str | None = None) -> float:
    """Refuse a float argument that is no finite number above 0 (an eps, a scale): such a
    value checks fine and only shows in a run as a non-finite loss."""
    if not (math.isfinite(value) and value > 0):
        ctx.error(f"{what} = {value} must be a finite number above 0", hint)
    return value


def finite_number(ctx, value: float, what: str, hint: str | None = None) -> float:
    """Refuse a float argument that is infinite (a literal like 1e400 reads as inf)."""
    if not math.isfinite(value):
        ctx.error(f"{what} = {value} must be a finite number", hint)
    return value


def dims_text(dims) -> str:
    """Dims as a spec writes them: [a, b]."""
    return "[" + ", ".join(dims) + "]"


def last_dim(ctx, x: Operand, what: str) -> str:
    """The last dim of x (the one norms, softmax and projections work over)."""
    if not x.dims:
        ctx.error(f"{what} needs a tensor with at least one dim, got a scalar")
    return x.dims[-1]


def broadcast(ctx, kind: str, a: Operand, b: Operand, name: str | None = None) -> Operand:
    """add/mul by dim name: the left operand's dims, then the right's new ones."""
    if a.dtype != b.dtype:
        ctx.error(f"{kind} of {a.dtype} and {b.dtype} tensors", "both operands need one dtype")
    need_float(ctx, a, f"{kind}'s operands")
    dims = a.dims + tuple(d for d in b.dims if d not in a.dims)
    return ctx.op(kind, (a, b), dims, a.dtype, name=name)
