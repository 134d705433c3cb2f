"""Traffic accounting: the bytes one rank sends for a collective (no torch, no MPI here, so
`soapstone explain` can predict what the communicators' `stats` counters will record)."""

from __future__ import annotations

from soapstone.comm.op_table import OPS


def bus_factor(op: str, size: int) -> tuple[int, int]:
    """(num, den): `op` on `size` ranks sends num * nbytes // den bytes from each rank under
    the ring algorithms (nccl-tests bus bytes); see `bus_bytes` for what nbytes is.

    allreduce 2(n-1)/n; reduce_scatter, allgather, alltoall (n-1)/n; broadcast 1; send 1
    (op_table.OPS). A size-1 communicator moves nothing.
    """
    row = OPS[op]
    if size <= 1 and not row.p2p:
        return 0, 1
    return row.bus.factor(size)


def bus_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends for `op` (see `bus_factor`). `nbytes` is the op's payload: the full
    tensor for allreduce, broadcast, reduce_scatter (its input), allgather (its output),
    alltoall (its input); the message for send."""
    num, den = bus_factor(op, size)
    return num * nbytes // den
