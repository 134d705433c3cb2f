"""SOAPSTONE_DEBUG_COLLECTIVES=1: cross-check every collective's arguments across ranks.

Before the real call, each rank contributes a fixed-size descriptor (op, dtype, shape, the op's
integer arguments) to a small allgather over the same ranks; if they differ, every rank raises
the same CommError naming who passed what. Mismatched collectives otherwise hang or return
garbage. p2p: the sender first sends its descriptor and the receiver compares it with its own
buffer. The check costs one small allgather per collective, so it is off by default; turn it on
per communicator with `comm.debug = True`.
"""

from __future__ import annotations

import numpy as np
import torch

from .communicator import REDUCE_OPS, CommError
from .dtypes import SUPPORTED, dtype_name

_OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "alltoallv", "p2p")
_ARG_NAMES = {
    "allreduce": ("op_index",),
    "reduce_scatter": ("dim",),
    "allgather": ("dim",),
    "broadcast": ("src",),
    "alltoall": ("split_dim", "concat_dim"),
    "alltoallv": ("dim",),
}
_MAX_DIMS = 8
_LEN = 4 + _MAX_DIMS + 4
_P2P_TAG = 32000  # descriptors travel on their own tag so they never match a data message


def _descriptor(op: str, t: torch.Tensor, args) -> np.ndarray:
    d = np.full(_LEN, -1, dtype=np.int64)
    d[0] = _OPS.index(op)
    d[1] = SUPPORTED.index(t.dtype)
    d[2] = t.dim()
    d[3] = t.numel()
    shape = list(t.shape)[:_MAX_DIMS]
    d[4 : 4 + len(shape)] = shape
    d[4 + _MAX_DIMS : 4 + _MAX_DIMS + len(args)] = args
    return d


def _describe(d: np.ndarray, skip_dim: int | None = None) -> str:
    op = _OPS[int(d[0])]
    nd = int(d[2])
    shape = [int(x) for x in d[4 : 4 + min(nd, _MAX_DIMS)]]
    if skip_dim is not None and nd:
        shape[skip_dim] = "*"  # alltoallv: sizes along dim may differ by design
    text = f"{op}(shape={tuple(shape)}, dtype={dtype_name(SUPPORTED[int(d[1])])}"
    args = d[4 + _MAX_DIMS :]
    for name, v in zip(_ARG_NAMES.get(op, ()), args, strict=False):
        if name == "op_index":
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


def check_p2p(comm, op: str, t: torch.Tensor, peer: int) -> None:
    """send side: ship this message's descriptor to `peer`; recv side: compare it with `t`."""
    mine = _descriptor("p2p", t, ())
    if op in ("send", "isend"):
        comm.mpi.Send(mine, peer, _P2P_TAG)
        return
    theirs = np.empty_like(mine)
    comm.mpi.Recv(theirs, peer, _P2P_TAG)
    if not (theirs == mine).all():
        raise CommError(
            f"debug collectives: rank {comm.rank} posted {op} from rank {peer} into "
            f"{_describe(mine)}, but rank {peer} sent {_describe(theirs)}; "
            "make the receive buffer match what is sent"
        )
