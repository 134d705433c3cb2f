"""Traffic accounting: the bytes one rank sends for a collective (no torch, no MPI here, so
`soapstone explain` can predict what the communicators' `stats` counters will record)."""

from __future__ import annotations


def bus_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends for `op` under the ring algorithms (nccl-tests bus bytes).

    `nbytes` is the op's payload: the full tensor for allreduce, broadcast, reduce_scatter
    (its input), allgather (its output), alltoall (its input); the message for send.
    allreduce 2(n-1)/n; reduce_scatter, allgather, alltoall (n-1)/n; broadcast 1; send 1.
    A size-1 communicator moves nothing.
    """
    if size <= 1 and op not in ("send", "recv"):
        return 0
    if op == "allreduce":
        return 2 * (size - 1) * nbytes // size
    if op in ("reduce_scatter", "allgather", "alltoall"):
        return (size - 1) * nbytes // size
    if op == "recv":
        return 0  # counted on the sender
    return nbytes  # broadcast, send, alltoallv (caller passes the off-rank bytes)
