"""MPICommunicator: the Communicator over mpi4py on torch CPU tensors.

Zero-copy: every MPI call gets `[MPI.buffer.fromaddress(t.data_ptr(), nbytes), count, type]`,
a view of the tensor's own memory (no numpy conversion, no pickling). The only copies are the
ones the layout math needs: gathering or scattering along a dim that is not outermost
(the ranks' chunks are then not contiguous in memory, so they are rearranged once). With
`out=`, allgather / reduce_scatter / alltoall in the flat layout receive straight into `out`.
Nonblocking variants use MPI's I-collectives so that communication overlaps compute.
"""

from __future__ import annotations

import contextlib
import math

import torch
from mpi4py import MPI

from soapstone.comm.arg_checks import check_shared
from soapstone.comm.backends import shm
from soapstone.comm.communicator import (
    Communicator,
    Work,
    chunks_first,
    concat_from_first,
    concat_into,
    flat_view,
    gather_layout,
)
from soapstone.comm.dtypes import SUPPORTED, mpi_op, mpi_type
from soapstone.comm.errors import CommError
from soapstone.comm.p2p import GroupedP2P

_fromaddress = MPI.buffer.fromaddress
_TYPES = {d: mpi_type(d) for d in SUPPORTED}  # datatypes looked up once, not per call


def _spec(t: torch.Tensor) -> list:
    """The MPI buffer spec of a contiguous CPU tensor's own memory. No count: mpi4py derives
    it from the byte length (and divides by the size for the per-rank sides of allgather,
    alltoall and reduce_scatter_block)."""
    return [_fromaddress(t.data_ptr(), t.nbytes), _TYPES[t.dtype]]  # nbytes: one torch call


def _waiter(reqs):
    if isinstance(reqs, MPI.Request):
        return reqs.Wait
    return lambda: MPI.Request.Waitall(reqs)


def _tester(reqs):
    if isinstance(reqs, MPI.Request):
        return reqs.Test
    return lambda: MPI.Request.Testall(reqs)


class MPICommunicator(GroupedP2P, Communicator):
    """Collectives over an mpi4py communicator (default: MPI.COMM_WORLD) on CPU tensors."""

    device_type = "cpu"
    _synchronous = False  # isend as Issend (inside batch_p2p(..., synchronous=True))

    def __init__(self, mpi_comm: MPI.Comm | None = None):
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size())
        self._shared: shm.SharedReducer | None | bool = None  # None: not asked yet

    def shared_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed flat tensor in memory every rank maps, whose sum allreduce then runs
        through shared memory (backends/shm.py), when all ranks share a node; else None.
        Collective."""
        check_shared(numel, dtype)
        if self.size == 1 or numel == 0 or not shm.enabled():
            return None
        if self._shared is None:
            on_node = shm.SharedReducer.on_one_node(self.mpi)
            self._shared = shm.SharedReducer(self.mpi) if on_node else False
        return self._shared.zeros(numel, dtype) if self._shared else None

    def _run(self, blocking, nonblocking, args, result, async_op, finish=None, keep=None):
        # One place that chooses the blocking or the I-variant, so each op is written once.
        if async_op:
            reqs = nonblocking(*args)
            return Work(_waiter(reqs), result, finish, keep=(args, keep), test=_tester(reqs))
        blocking(*args)
        return finish() if finish is not None else result

    def _free_backend(self) -> None:
        if self._shared:
            self._shared.comm.Free()

    def _allreduce(self, t, op, async_op):
        if op == "sum" and self._shared and self._shared.owns(t):
            return self._shared.allreduce(t, async_op)
        c = self.mpi
        finish = _averager(t, self.size) if op == "avg" else None
        args = (MPI.IN_PLACE, _spec(t), mpi_op(t.dtype, op))
        return self._run(c.Allreduce, c.Iallreduce, args, t, async_op, finish, keep=t)

    def _reduce_scatter(self, t, dim, async_op, out=None):
        c = self.mpi
        src = chunks_first(t, dim, self.size)  # t itself when the chunks are contiguous
        if out is None:  # this rank's chunk is always contiguous: `out` is written directly
            out_shape = list(t.shape)
            out_shape[dim] //= self.size
            out = torch.empty(out_shape, dtype=t.dtype)
        args = (_spec(src), _spec(out), mpi_op(t.dtype, "sum"))
        return self._run(
            c.Reduce_scatter_block, c.Ireduce_scatter_block, args, out, async_op, keep=src
        )

    def _allgather(self, t, dim, async_op, out=None):
        c = self.mpi
        out_shape, flat = gather_layout(t, dim, self.size)
        if flat:  # zero-copy: MPI gathers straight into `out`
            if out is None:
                out = torch.empty(out_shape, dtype=t.dtype)
            return self._run(c.Allgather, c.Iallgather, (_spec(t), _spec(out)), out, async_op,
                             keep=t)
        buf = torch.empty((self.size, *t.shape), dtype=t.dtype)
        finish = ((lambda: concat_from_first(buf, dim)) if out is None
                  else (lambda: concat_into(buf, dim, out)))
        return self._run(c.Allgather, c.Iallgather, (_spec(t), _spec(buf)), None, async_op,
                         finish=finish, keep=(t, buf, out))

    def _broadcast(self, t, src, async_op):
        c = self.mpi
        return self._run(c.Bcast, c.Ibcast, (_spec(t), src), t, async_op, keep=t)

    def _alltoall(self, t, split_dim, concat_dim, async_op, out=None):
        c = self.mpi
        send = chunks_first(t, split_dim, self.size)
        direct = None if out is None else flat_view(out, concat_dim, self.size)
        if direct is not None:  # zero-copy: MPI receives straight into `out`
            return self._run(c.Alltoall, c.Ialltoall, (_spec(send), _spec(direct)), out,
                             async_op, keep=(send, out))
        recv = torch.empty_like(send)
        finish = ((lambda: concat_from_first(recv, concat_dim)) if out is None
                  else (lambda: concat_into(recv, concat_dim, out)))
        return self._run(c.Alltoall, c.Ialltoall, (_spec(send), _spec(recv)), None, async_op,
                         finish=finish, keep=(send, recv, out))

    def _alltoallv(self, t, send_sizes, recv_sizes, dim, async_op):
        c = self.mpi
        # MPI splits flat memory: put `dim` outermost so each rank's rows are contiguous.
        send = t.movedim(dim, 0).contiguous() if dim else t
        row_shape = list(send.shape[1:])
        row = math.prod(row_shape)
        recv = torch.empty([sum(recv_sizes), *row_shape], dtype=t.dtype)
        typ = _TYPES[t.dtype]
        sc = [s * row for s in send_sizes]
        rc = [s * row for s in recv_sizes]
        sbuf = _fromaddress(send.data_ptr(), send.nbytes)
        rbuf = _fromaddress(recv.data_ptr(), recv.nbytes)
        args = ([sbuf, (sc, _displs(sc)), typ], [rbuf, (rc, _displs(rc)), typ])
        finish = (lambda: recv.movedim(0, dim).contiguous()) if dim else None
        return self._run(c.Alltoallv, c.Ialltoallv, args, recv, async_op, finish,
                         keep=(send, recv))

    @contextlib.contextmanager
    def _p2p_group(self, synchronous: bool):
        """batch_p2p's bracket: MPI needs no group; synchronous sends for its duration."""
        self._synchronous = synchronous
        try:
            yield
        finally:
            self._synchronous = False

    def _send(self, t, dst, tag, async_op):
        if async_op:
            post = self.mpi.Issend if self._synchronous else self.mpi.Isend
            req = post(_spec(t), dst, tag)
            return Work(req.Wait, None, keep=t, test=req.Test)
        self.mpi.Send(_spec(t), dst, tag)
        return None

    def _recv(self, t, src, tag, async_op):
        if async_op:
            receipt = _Receipt(self.mpi.Irecv(_spec(t), src, tag), t, src, tag)
            return Work(receipt.wait, t, keep=t, test=receipt.test)
        status = MPI.Status()
        try:
            self.mpi.Recv(_spec(t), src, tag, status)
        except MPI.Exception as e:
            raise _recv_error(t, src, tag, e) from None
        if status.Get_count(MPI.BYTE) != t.nbytes:
            raise _recv_error(t, src, tag, status)
        return t

    def _barrier(self):
        self.mpi.Barrier()


def _averager(t: torch.Tensor, n: int):
    """avg's finish: divide the sum in `t` by `n`; return `t`."""
    def finish() -> torch.Tensor:
        # through a detached view: MPI wrote the sum past autograd and the division must pass
        # it too (an nn.Parameter or an inference tensor refuses autograd's in-place ops)
        t.detach().div_(n)
        return t
    return finish


class _Receipt:
    """An irecv's request: whichever of test() and wait() completes it checks, once, that
    the message filled `t` exactly (MPI leaves a shorter one's tail stale without a word)."""

    __slots__ = ("req", "t", "src", "tag", "status", "error")

    def __init__(self, req, t: torch.Tensor, src: int, tag: int):
        self.req, self.t, self.src, self.tag = req, t, src, tag
        self.status = MPI.Status()
        self.error: CommError | bool | None = None  # None: not complete yet; False: fine

    def wait(self) -> None:
        self._complete(self.req.Wait)

    def test(self) -> bool:
        return self._complete(self.req.Test)

    def _complete(self, call) -> bool:
        if self.error is None:
            try:
                if not call(self.status):
                    return False
                got = self.status.Get_count(MPI.BYTE)
                self.error = got != self.t.nbytes and _recv_error(
                    self.t, self.src, self.tag, self.status, "irecv")
            except MPI.Exception as e:
                self.error = _recv_error(self.t, self.src, self.tag, e, "irecv")
        if self.error:
            raise self.error
        return True


def _recv_error(t: torch.Tensor, src: int, tag: int, why, op: str = "recv") -> CommError:
    """The CommError of a receive whose message does not fit `t` (`why`: the status of a
    shorter message, or MPI's truncation error); other MPI errors are re-raised as they are."""
    if isinstance(why, MPI.Exception):
        if why.Get_error_class() != MPI.ERR_TRUNCATE:
            raise why
        size = f"more than {t.nbytes}"
    else:
        size = str(why.Get_count(MPI.BYTE))
    return CommError(
        f"{op}: the message from rank {src} (tag {tag}) holds {size} bytes, but `t` is "
        f"{tuple(t.shape)} {t.dtype}, {t.nbytes} bytes; receive into a tensor of the sent "
        "shape and dtype (SOAPSTONE_DEBUG_COLLECTIVES=1 names what each side passed)"
    )


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
