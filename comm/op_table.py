"""The comm ops, one table: each op's name, the integer arguments the debug cross-check
compares, and the bytes one rank sends for it (its bus factor).

The byte counter (accounting.py, the communicators' `stats`), the debug cross-check
(observe/debug.py), the watchdog's stack sampling (communicator.py `blocking_calls`) and
`soapstone bench comm` (bench/collectives.py) all read it. No torch, no MPI here.
"""

from __future__ import annotations

import enum

import attrs


class Bus(enum.Enum):
    """How many times its payload one rank of n sends under the ring algorithms (nccl-tests
    bus bytes; accounting.bus_bytes says what the payload is)."""

    TWICE_RING = "2(n-1)/n"  # allreduce: a reduce-scatter, then an allgather
    RING = "(n-1)/n"  # every rank's piece passes every other rank once
    ONCE = "1"  # the payload leaves this rank once (alltoallv: the caller counts off-rank bytes)
    NONE = "0"  # nothing (a receive: counted on the sender)

    def factor(self, size: int) -> tuple[int, int]:
        """(num, den): a rank of a size-`size` communicator sends num * payload // den."""
        if self is Bus.TWICE_RING:
            return 2 * (size - 1), size
        if self is Bus.RING:
            return size - 1, size
        return (1, 1) if self is Bus.ONCE else (0, 1)


@attrs.frozen
class CommOp:
    """One op of a Communicator."""

    name: str
    args: tuple[str, ...]  # its integer arguments, as the debug cross-check compares them
    bus: Bus | None  # None: no row in the byte counter (a barrier moves nothing)
    p2p: bool = False  # between two ranks (the rest: every rank of the communicator calls it)
    benched: bool = False  # `soapstone bench comm` times it


# In the order `soapstone bench comm` times them by default.
OPS: dict[str, CommOp] = {o.name: o for o in (
    CommOp("allreduce", ("op",), Bus.TWICE_RING, benched=True),
    CommOp("allgather", ("dim",), Bus.RING, benched=True),
    CommOp("reduce_scatter", ("dim",), Bus.RING, benched=True),
    CommOp("broadcast", ("src",), Bus.ONCE, benched=True),
    CommOp("alltoall", ("split_dim", "concat_dim"), Bus.RING, benched=True),
    CommOp("alltoallv", ("dim",), Bus.ONCE),
    CommOp("send", (), Bus.ONCE, p2p=True),
    CommOp("recv", (), Bus.NONE, p2p=True),
    CommOp("barrier", (), None),
)}

#: allreduce's `op` argument (the debug cross-check sends its index)
REDUCE_OPS = ("sum", "avg", "max", "min")
#: every op the byte counter has a row for (isend and irecv count under send and recv)
COUNTED_OPS = tuple(n for n, o in OPS.items() if o.bus is not None)
#: the collectives (every rank of a communicator calls them)
COLLECTIVES = tuple(n for n, o in OPS.items() if not o.p2p)
#: what `soapstone bench comm` can time
BENCHED_OPS = tuple(n for n, o in OPS.items() if o.benched)
