"""Argument checks the Communicator's public methods share beyond tensors (communicator.py):
integers given as something else, p2p tags, shared_zeros' count and dtype. Each raises a
CommError naming the op and the argument; none communicates."""

from __future__ import annotations

import operator
from typing import Any

from soapstone.comm.dtypes import SUPPORTED, SUPPORTED_SET, dtype_name
from soapstone.comm.errors import CommError

_TAG_UB: int | None = None


def as_int(op: str, name: str, value: Any, what: str) -> int:
    """`value` as an int (a numpy integer included), else a CommError naming the argument."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise CommError(f"{op}: `{name}`={value!r} must be an int ({what}), "
                    f"got {type(value).__name__}")


def counts(op: str, name: str, sizes) -> list[int]:
    """`sizes` as a list of ints (int() would cut 1.5 to 1 and fail deep on a str)."""
    return [s if type(s) is int else as_int(op, name, s, "a count") for s in sizes]


def tag_ub() -> int:
    """The largest p2p tag MPI takes (MPI_TAG_UB; MPICH's is 2**29 - 1), read once."""
    global _TAG_UB
    if _TAG_UB is None:
        from mpi4py import MPI

        _TAG_UB = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
    return _TAG_UB


def check_tag(op: str, tag: Any) -> None:
    """A p2p tag must be an int in [0, MPI_TAG_UB]: MPI reads -1 as MPI_ANY_TAG (a receive
    would take any message), and a larger or non-int tag fails deep in mpi4py."""
    if type(tag) is not int:
        tag = as_int(op, "tag", tag, "a message tag")
    if not 0 <= tag <= tag_ub():
        raise CommError(f"{op}: `tag`={tag!r} is not a usable tag; pass an int in "
                        f"[0, {tag_ub()}]")


def check_shared(numel: Any, dtype: Any) -> None:
    """shared_zeros' arguments, checked before its collective steps (a rank that failed half
    way would leave the others waiting)."""
    if type(numel) is not int:
        as_int("shared_zeros", "numel", numel, "an element count")
    if numel < 0:
        raise CommError(f"shared_zeros: `numel`={numel} is negative; pass a count >= 0")
    if dtype not in SUPPORTED_SET:
        raise CommError(
            f"shared_zeros: `dtype`={dtype!r} is not a dtype soapstone.comm carries; pass one "
            f"of {', '.join(f'torch.{dtype_name(d)}' for d in SUPPORTED)}"
        )
