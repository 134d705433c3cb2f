"""batch_p2p: several sends and receives issued as one group, NCCL's batch_isend_irecv.

On NCCL a rank's sends and receives run in issue order on one stream and a send is a
rendezvous with its receive, so two neighbours that each must send and receive deadlock
unless both directions go out together: inside one ncclGroupStart/End (nccl.py's
`_p2p_group`). On MPI the ops are simply all posted nonblocking; `synchronous=True` posts the
sends as Issend, which completes only once matched: NCCL's rendezvous, so that a CPU run has
NCCL's blocking structure (the executor's grouped p2p mode proves its schedules that way).

Each op goes through the communicator's public isend / irecv, so it has their input checks,
byte counter and flight-recorder entry; the backend hook only brackets them. Every op is
checked before the first is posted: a bad one is a CommError with nothing left in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from soapstone.comm.communicator import Work
from soapstone.comm.errors import CommError

OPS = ("isend", "irecv")


class P2POp(NamedTuple):
    """One op of a batch: `op` isend | irecv, its tensor, the peer rank, an MPI tag (NCCL has
    none: between two ranks messages pair in issue order)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class GroupedP2P:
    """Mixin for a Communicator backend: `batch_p2p` over the backend's `_p2p_group` hook."""

    def batch_p2p(self, ops: Sequence[P2POp | tuple], synchronous: bool = False) -> list[Work]:
        """Issue `ops` (P2POp or (op, tensor, peer[, tag]) tuples) as one group; their Works,
        in order. synchronous: MPI sends complete only when matched (Issend); NCCL's always
        do."""
        ops = [o if isinstance(o, P2POp) else P2POp(*o) for o in ops]
        for o in ops:  # all checked before any is posted
            if o.op not in OPS:
                raise CommError(f"batch_p2p: op {o.op!r} is unknown; pass one of {OPS}")
            self._check_p2p(o.op, o.tensor, o.peer, "dst" if o.op == "isend" else "src", o.tag)
        if not ops:
            return []
        with self._p2p_group(synchronous):
            return [self.isend(o.tensor, o.peer, o.tag) if o.op == "isend"
                    else self.irecv(o.tensor, o.peer, o.tag) for o in ops]

    def _p2p_group(self, synchronous: bool):
        """The backend's bracket around a batch (default: nothing)."""
        return contextlib.nullcontext()
