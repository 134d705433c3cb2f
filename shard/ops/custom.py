"""The record every custom layer's op (kind "custom:<name>", dsl/layers/custom.py) shares: its
sharding comes from the op itself, its kernel is the layer's Python function (the runtime's
`custom=` argument), its saves are bounded."""

from __future__ import annotations

from soapstone.shard.ops.record import OpRecord, Role, keeps_args

PREFIX = "custom:"


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
