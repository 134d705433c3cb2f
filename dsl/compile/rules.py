"""How the compiler reads each primitive op's sharding rule: from its record (shard/ops/).

The record says the role every dim of the op's iteration space plays (FREE, SUM, STAT: what
splitting it over a mesh axis means, shard/ops/record.py), how an arg's dims name that space,
the partial sums it passes through, an arg it may read whole, and rows it may move to their
owners. Lowering (lower.py) asks these per op; it keeps no table of its own.
"""

from __future__ import annotations

from soapstone.dsl.model import ir
from soapstone.shard.ops.record import Partial, Role
from soapstone.shard.ops.registry import record_of

FREE, SUM, STAT = Role.FREE, Role.SUM, Role.STAT


def arg_dims(op: ir.Op, arg: int, dims: tuple[str, ...]) -> tuple[str, ...]:
    """An arg's dims named in the op's iteration space (rename and repeat_dim map src to dst:
    splitting dst splits the arg along src)."""
    return record_of(op.kind).arg_dims(op, arg, dims)


def roles(op: ir.Op, arg_dim_lists: list[tuple[str, ...]]) -> dict[str, Role]:
    """The role of every dim the op iterates over (dims absent from the map may not split)."""
    return record_of(op.kind).roles(op, arg_dim_lists)


def exchange(op: ir.Op, arg_dim_lists: list[tuple[str, ...]]) -> tuple[tuple[str, str], ...]:
    """The (rows dim, owners dim) pairs an op may split over one axis together, moving each
    row to the rank owning its target and back by all-to-all (moe's tokens to their experts)."""
    return record_of(op.kind).exchange(op, arg_dim_lists)


def partial_pass(op: ir.Op) -> Partial | None:
    """The partial sums the op passes through: ONE arg partial, ALL of them, or none."""
    return record_of(op.kind).partial_pass


def whole_arg(op: ir.Op) -> bool:
    """Whether the op reads an arg by global index, so it may take it whole where splitting it
    with the output does not divide."""
    return record_of(op.kind).whole_arg
