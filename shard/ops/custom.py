"""The record every custom layer's op (kind "custom:<name>", dsl/layers/custom.py) shares: its
sharding comes from the op itself, its kernel is the layer's Python function (the runtime's
`custom=` argument), its saves are bounded, and what the function returns is checked
(`checked_result`; its shape, which only the runtime knows, by `wrong_shape`'s error)."""

from __future__ import annotations

from soapstone.comm.errors import UserError
from soapstone.shard.ops.record import OpRecord, Role, keeps_args

PREFIX = "custom:"


class LayerResultError(UserError, TypeError):
    """A custom layer's function returned something the runtime cannot use (not a tensor, or
    not in the dtype it computes in): names the layer, what it returned and what it must."""


def checked_result(step, args: list, y):
    """`y`, the result of custom layer `step`'s function on `args`, if it is a tensor in the
    dtype of the layer's float inputs; else LayerResultError."""
    # checked here, where the layer returns, before any collective reads it: a wrong dtype met
    # by a collective on one rank only is an MPI truncation error, not a message
    import torch

    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    want = floats[0] if floats else None
    if isinstance(y, torch.Tensor) and (want is None or y.dtype == want):
        return y
    got = f"a tensor of dtype {y.dtype}" if isinstance(y, torch.Tensor) else _short(y)
    should = "a torch.Tensor" + (f" of dtype {want} (the dtype of its float inputs, which the "
                                 "runtime computes in)" if want is not None else "")
    fix = f"; cast it, e.g. `.to({want})`" if isinstance(y, torch.Tensor) else ""
    name = step.kind.removeprefix(PREFIX)
    where = f" computing {step.source}" if step.source else ""
    raise LayerResultError(f"custom layer {name!r}{where} returned {got}; it must return "
                           f"{should}{fix}")


def wrong_shape(step, got: list[int], want: list[int], dims) -> LayerResultError:
    """The LayerResultError for custom layer `step` returning a local shape `got` where the
    compiled one is `want` (over `dims`)."""
    name = step.kind.removeprefix(PREFIX)
    where = f" computing {step.source}" if step.source else ""
    return LayerResultError(
        f"custom layer {name!r}{where} returned a tensor of local shape {got}; it must return "
        f"the compiled local shape {want} (dims {', '.join(dims)}): a layer's function gets "
        "this rank's shards and returns this rank's shard of its result")


def _short(y) -> str:
    """What a wrong result is, as a message shows it: None, a sequence's item types, or the
    type and its repr cut to one short line."""
    if y is None:
        return "None"
    if isinstance(y, tuple | list):
        items = ", ".join(type(v).__name__ for v in y[:4]) + (", ..." if len(y) > 4 else "")
        return f"a {type(y).__name__} of {len(y)} ({items})"
    text = " ".join(repr(y).split())
    return f"{type(y).__name__} " + (text if len(text) <= 40 else text[:37] + "...")


def custom_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Roles of a custom layer's op: its leading `...` dims are free; `op.shard` names the rest.

    The op's attrs bind each of the layer's dim variables to a model dim."""
    named = {dim for _, dim in op.attrs if isinstance(dim, str)}
    result = {d: Role.FREE for dims in arg_dim_lists for d in dims if d not in named}
    for dim, how in op.shard:
        result[dim] = Role.FREE if how == "split" else Role.SUM
    return result


def custom_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Its float operands and its output: an upper bound of what the function keeps."""
    return floats + [step.out], 0


CUSTOM = OpRecord(
    "custom", "a custom layer's op: args its inputs then its weights; attrs bind the layer's "
    "dim variables; `shard` says how each may split (dsl/layers/custom.py)",
    roles=custom_roles, saves=custom_saves, keeps=keeps_args)
