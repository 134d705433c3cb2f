"""SOAPSTONE_DEBUG_COLLECTIVES=1: cross-check every collective's arguments across ranks.

Before the real call, each rank contributes a fixed-size descriptor (op, dtype, shape, the op's
integer arguments) to a small allgather over the same ranks; if they differ, every rank raises
the same CommError naming who passed what. Mismatched collectives otherwise hang or return
garbage. p2p: the sender also sends a descriptor (non-blocking, on a tag of its own derived
from the message's tag) and the receiver compares it with its own buffer: recv before receiving,
irecv in wait() (its descriptor is received non-blockingly, so receives posted ahead of the
matching sends, as pipelines post them, do not deadlock). A mismatched message is consumed and
discarded, so later messages still pair up; on NCCL an irecv into a wrong-sized buffer is
already enqueued when the mismatch is seen, so debug p2p shapes with recv or the MPI backend.
The check costs one small allgather per collective, so it is off by default; turn it on per
communicator with `comm.debug = True`.
"""

from __future__ import annotations

import numpy as np
import torch

from soapstone.comm.dtypes import SUPPORTED, dtype_name
from soapstone.comm.errors import CommError
from soapstone.comm.op_table import OPS, REDUCE_OPS

_CODES = (*OPS, "p2p")  # a descriptor's op: a table op, or "p2p" for a message's
_MAX_DIMS = 8
_LEN = 4 + _MAX_DIMS + 4


def _descriptor(op: str, t: torch.Tensor, args) -> np.ndarray:
    d = np.full(_LEN, -1, dtype=np.int64)
    d[0] = _CODES.index(op)
    d[1] = SUPPORTED.index(t.dtype)
    d[2] = t.dim()
    d[3] = t.numel()
    shape = list(t.shape)[:_MAX_DIMS]
    d[4 : 4 + len(shape)] = shape
    d[4 + _MAX_DIMS : 4 + _MAX_DIMS + len(args)] = args
    return d


def _describe(d: np.ndarray, skip_dim: int | None = None) -> str:
    op = _CODES[int(d[0])]
    nd = int(d[2])
    shape = [int(x) for x in d[4 : 4 + min(nd, _MAX_DIMS)]]
    if skip_dim is not None and nd:
        shape[skip_dim] = "*"  # alltoallv: sizes along dim may differ by design
    text = f"{op}(shape={tuple(shape)}, dtype={dtype_name(SUPPORTED[int(d[1])])}"
    args = d[4 + _MAX_DIMS :]
    for name, v in zip(OPS[op].args if op in OPS else (), args, strict=False):
        if name == "op":  # allreduce's, sent as its index in REDUCE_OPS
            text += f", op={REDUCE_OPS[int(v)]!r}" if 0 <= v < len(REDUCE_OPS) else ""
        else:
            text += f", {name}={int(v)}"
    return text + ")"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def check_agree(comm, op: str, t: torch.Tensor, args) -> None:
    """Raise CommError on every rank unless all ranks of `comm` called `op` alike."""
    mine = _descriptor(op, t, args)
    if op == "alltoallv":  # the size along `dim` legitimately differs: compare the rest
        dim = int(args[0])
        if dim < _MAX_DIMS:
            mine[4 + dim] = -2
        mine[3] = -2
    everyone = np.empty((comm.size, _LEN), dtype=np.int64)
    comm.mpi.Allgather(mine, everyone)
    if (everyone == everyone[0]).all():
        return
    groups: dict[str, list[int]] = {}
    skip = int(args[0]) if op == "alltoallv" else None
    for r in range(comm.size):
        groups.setdefault(_describe(everyone[r], skip), []).append(r)
    lines = "; ".join(f"{_ranks(rs)} passed {what}" for what, rs in groups.items())
    raise CommError(
        f"debug collectives: ranks of a size-{comm.size} communicator disagree on {op} "
        f"(this is rank {comm.rank}): {lines}"
    )


def check_alltoallv_sizes(comm, send_sizes: list[int], recv_sizes: list[int]) -> None:
    """Raise CommError unless rank i's send_sizes[j] equals rank j's recv_sizes[i] for all i, j."""
    n = comm.size
    both = np.empty((n, 2 * n), dtype=np.int64)
    comm.mpi.Allgather(np.asarray(send_sizes + recv_sizes, dtype=np.int64), both)
    sends, recvs = both[:, :n], both[:, n:]
    bad = [(i, j) for i in range(n) for j in range(n) if sends[i, j] != recvs[j, i]]
    if bad:
        i, j = bad[0]
        raise CommError(
            f"debug collectives: alltoallv sizes disagree: rank {i} sends {sends[i, j]} to "
            f"rank {j}, which expects {recvs[j, i]} from it ({len(bad)} mismatched pairs); "
            "make send_sizes[j] on rank i equal recv_sizes[i] on rank j"
        )


def _descriptor_tag(comm, op: str, tag: int) -> int:
    """The tag a p2p message's descriptor travels on: the data tag shifted into the upper half
    of the tag range, so descriptors pair up exactly as their messages do (the pipeline posts
    receives for many tags ahead, in another order than the sends) and never match data."""
    global _tag_offset
    if _tag_offset is None:
        from mpi4py import MPI

        _tag_offset = (int(comm.mpi.Get_attr(MPI.TAG_UB)) + 1) // 2
    if not 0 <= tag < _tag_offset:
        raise CommError(
            f"{op}: `tag`={tag} is outside [0, {_tag_offset - 1}], the tags usable with "
            "SOAPSTONE_DEBUG_COLLECTIVES=1 (the upper half carries the descriptors)"
        )
    return _tag_offset + tag


_tag_offset: int | None = None


class _Sent:
    """A descriptor on its way (Isend); wait() before dropping it."""

    def __init__(self, comm, t: torch.Tensor, peer: int, tag: int):
        self._buf = _descriptor("p2p", t, ())
        self._req = comm.mpi.Isend(self._buf, peer, _descriptor_tag(comm, "send", tag))

    def wait(self) -> None:
        self._req.Wait()

    def test(self) -> bool:
        """Whether the descriptor has gone, without blocking."""
        return self._req.Test()


def send_descriptor(comm, t: torch.Tensor, peer: int, tag: int) -> _Sent:
    """Start sending this message's descriptor to `peer` (non-blocking; wait() the result)."""
    return _Sent(comm, t, peer, tag)


class _Expected:
    """A descriptor being received (Irecv); check() compares it with this rank's buffer."""

    def __init__(self, comm, op: str, t: torch.Tensor, peer: int, tag: int):
        self.comm, self.op, self.peer, self.tag = comm, op, peer, tag
        self.mine = _descriptor("p2p", t, ())
        self.theirs = np.empty_like(self.mine)
        self._req = comm.mpi.Irecv(self.theirs, peer, _descriptor_tag(comm, op, tag))

    def check(self, data):
        """Wait for the descriptor; unless it matches, consume the message (so later ones still
        pair up) and raise CommError. `data`: the posted receive's Work (irecv), whose result is
        returned, or None (recv: the message is not received yet)."""
        self._req.Wait()
        if (self.theirs == self.mine).all():
            return None if data is None else data.wait()
        comm, peer = self.comm, self.peer
        if data is not None:
            try:
                data.wait()  # already posted into the wrong buffer: let it end (or truncate)
            except Exception:  # MPI truncation: the CommError below says why
                pass
        else:
            dtype = SUPPORTED[int(self.theirs[1])]
            scratch = torch.empty(int(self.theirs[3]), dtype=dtype, device=comm.device)
            comm._recv(scratch, peer, self.tag, False)
        raise CommError(
            f"debug collectives: rank {comm.rank} posted {self.op} from rank {peer} into "
            f"{_describe(self.mine)}, but rank {peer} sent {_describe(self.theirs)}; "
            "make the receive buffer match what is sent (the message was discarded)"
        )


def recv_descriptor(comm, op: str, t: torch.Tensor, peer: int, tag: int) -> _Expected:
    """Start receiving the descriptor of the message from `peer` that `t` is to receive."""
    return _Expected(comm, op, t, peer, tag)
