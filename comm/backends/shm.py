"""Node-shared buffers: a sum allreduce in place through shared memory, for MPI ranks on one
machine (MPICommunicator.shared_zeros).

MPI's allreduce of a large CPU buffer goes through the library: on a 2-core box with MPICH
(single-copy CMA), 84 MB of gradients over 2 ranks cost 13-20 ms of CPU a rank, and each call
allocates a temporary of half the message that the kernel faults in afresh (about 3000 page
faults a step). When every rank of a communicator shares the machine, a buffer can instead
live in a file under /dev/shm that every rank maps, and the allreduce reads the other ranks'
memory directly:

  barrier        every rank has written its buffer (its local sum)
  reduce         rank r adds chunk r of every other rank's buffer into its own chunk r
  barrier
  gather         rank r copies every other rank's chunk (their sums) into its own buffer
  barrier        no rank writes its buffer again while another still reads it

A rank adds and copies (n-1)/n of the buffer once: 6-8 ms of CPU for those 84 MB at 2 ranks.
Each chunk is summed by one rank (its own value first, then the others' in rank order) and
copied by the rest, so every rank ends with the same bits; at 2 ranks that is a + b, which is
what MPI computes too.

Launches are queued and run in launch order when one is waited on (every op before it
included), so the ranks' barriers match whenever they launch and wait in the same order, as
the collectives' contract asks. The barriers use a duplicate of the communicator, so they never
interleave with its other collectives. A buffer is one file, unlinked as soon as every rank
has mapped it (nothing is left behind if a rank dies); its memory goes with its last tensor.
Where a rank cannot map it (no /dev/shm, no space, ranks on several nodes), every rank gets
None and the caller keeps a plain tensor, reduced by MPI. SOAPSTONE_SHM_ALLREDUCE=0 turns it off.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref

import torch
from mpi4py import MPI

from soapstone.comm.communicator import Work

SHM_DIR = "/dev/shm"
ALIGN = 64  # each rank's buffer starts on its own cache line


def enabled() -> bool:
    """Whether shared buffers are wanted (SOAPSTONE_SHM_ALLREDUCE, default on)."""
    return os.environ.get("SOAPSTONE_SHM_ALLREDUCE", "1") not in ("0", "")


class Segment:
    """One shared buffer: every rank's flat tensor over the same file, and this rank's chunk."""

    def __init__(self, views: list[torch.Tensor], rank: int):
        self.views = views
        self.rank = rank
        n, numel = len(views), views[0].numel()
        size = -(-numel // n)
        self.chunks = [slice(min(p * size, numel), min((p + 1) * size, numel)) for p in range(n)]

    def reduce(self) -> None:
        """Sum chunk `rank` of every rank's buffer into this rank's."""
        c = self.chunks[self.rank]
        mine = self.views[self.rank][c]
        for p, v in enumerate(self.views):
            if p != self.rank:
                mine.add_(v[c])

    def gather(self) -> None:
        """Copy the other ranks' summed chunks into this rank's buffer."""
        mine = self.views[self.rank]
        for p, c in enumerate(self.chunks):
            if p != self.rank:
                mine[c].copy_(self.views[p][c])


class SharedReducer:
    """The shared buffers of one MPI communicator whose ranks all share a node, and their
    queued allreduces."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()  # the barriers' own, apart from the communicator's collectives
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.segments: dict[int, Segment] = {}  # this rank's view's data_ptr -> its segment
        self.pending: list[list] = []  # launched and not yet run, in launch order

    @staticmethod
    def on_one_node(comm: MPI.Comm) -> bool:
        """Whether every rank of `comm` shares this machine's memory (collective)."""
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size() == comm.Get_size()
        finally:
            local.Free()

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed flat tensor in a new shared file, or None on every rank where any rank
        could not map it (collective)."""
        each = -(-numel * dtype.itemsize // ALIGN) * ALIGN
        mm = self._map(each * self.size)
        if mm is None:
            return None
        views = [torch.frombuffer(mm, dtype=dtype, count=numel, offset=p * each)
                 for p in range(self.size)]
        # the caller's tensor is a view of its own (the segment's would keep it alive): when
        # it goes, its segment goes, and with the last view the mapping
        mine = torch.frombuffer(mm, dtype=dtype, count=numel, offset=self.rank * each)
        ptr = mine.data_ptr()
        self.segments[ptr] = Segment(views, self.rank)
        weakref.finalize(mine, self.segments.pop, ptr, None)
        return mine

    def _map(self, nbytes: int) -> mmap.mmap | None:
        name = None
        if self.rank == 0:
            name = _create(nbytes)
        name = self.comm.bcast(name, root=0)
        if name is None:
            return None
        mm = _open(name, nbytes)
        ok = self.comm.allreduce(mm is not None, op=MPI.LAND)  # also: every rank has it open
        if self.rank == 0:
            os.unlink(name)
        return mm if ok else None

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of this communicator's shared buffers, whole."""
        seg = self.segments.get(t.data_ptr())
        return seg is not None and t.numel() == seg.views[0].numel() and t.is_contiguous()

    def allreduce(self, t: torch.Tensor, async_op: bool):
        """Sum `t` (one of the shared buffers) over the ranks in place: now, or queued with a
        Work whose wait runs it and every op queued before it."""
        op = [self.segments[t.data_ptr()], False]  # [segment, done]
        self.pending.append(op)
        if not async_op:
            self._run_until(op)
            return t
        return Work(lambda: self._run_until(op), t, keep=t)

    def _run_until(self, op: list) -> None:
        if op[1]:
            return
        i = next(k for k, o in enumerate(self.pending) if o is op)
        batch, self.pending = self.pending[:i + 1], self.pending[i + 1:]
        self.comm.Barrier()
        with torch.no_grad():
            for seg, _ in batch:
                seg.reduce()
            self.comm.Barrier()
            for seg, _ in batch:
                seg.gather()
        self.comm.Barrier()
        for o in batch:
            o[1] = True


def _create(nbytes: int) -> str | None:
    """A new file of `nbytes` under SHM_DIR, its space reserved (a shortage shows here, not as
    a SIGBUS at first touch); its path, or None."""
    try:
        fd, name = tempfile.mkstemp(prefix="soapstone-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return name
    except OSError:
        os.unlink(name)
        return None
    finally:
        os.close(fd)


def _open(name: str, nbytes: int) -> mmap.mmap | None:
    try:
        fd = os.open(name, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)
