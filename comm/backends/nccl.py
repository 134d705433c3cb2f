"""NCCLCommunicator: the Communicator over cupy.cuda.nccl on torch CUDA tensors.

A blocking call is enqueued on torch's current CUDA stream (raw pointers from `data_ptr()`), so
it is ordered with the surrounding torch kernels and needs no host synchronisation. An
`async_op=True` call (gradient buckets, ZeRO-3 prefetch, pipeline isend/irecv) goes on this
communicator's side stream instead, after waiting for what the current stream has queued (the
tensor's producer), so it overlaps the compute that follows; its Work's wait() makes the
current stream wait for an event recorded after it (no host block), and keeps its buffers
alive until then, so the allocator reuses them only after the communication. Built and not yet
run on a GPU.
Set-up goes over MPI: rank 0's `nccl.get_unique_id()` is broadcast unchanged (bytes in cupy 14,
a tuple in cupy 13). cupy is imported lazily: soapstone imports and runs without it.

Testing: tests/comm/backends/test_comm_nccl.py runs the comm cases at world size 1 by default, which
moves no bytes between GPUs (near-trivial); only SOAPSTONE_NCCL_RANKS=2 (or 4) on a machine with
that many GPUs exercises real NCCL traffic.
"""

from __future__ import annotations

import contextlib
import math

import torch

from soapstone.comm.communicator import (
    Communicator,
    Work,
    chunks_first,
    concat_from_first,
    concat_into,
    flat_view,
    gather_layout,
)
from soapstone.comm.errors import CommError
from soapstone.comm.p2p import GroupedP2P

# ncclDataType_t and ncclRedOp_t values, used when a cupy build lacks the named constant.
_NCCL_TYPES = {
    torch.int8: ("NCCL_INT8", 0),
    torch.uint8: ("NCCL_UINT8", 1),
    torch.int32: ("NCCL_INT32", 2),
    torch.int64: ("NCCL_INT64", 4),
    torch.float16: ("NCCL_FLOAT16", 6),
    torch.float32: ("NCCL_FLOAT32", 7),
    torch.float64: ("NCCL_FLOAT64", 8),
    torch.bfloat16: ("NCCL_BFLOAT16", 9),
}
_NCCL_OPS = {"sum": ("NCCL_SUM", 0), "max": ("NCCL_MAX", 2), "min": ("NCCL_MIN", 3),
             "avg": ("NCCL_AVG", 4)}


def nccl_module():
    """cupy.cuda.nccl, or CommError saying how to get it."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or cupy present without a usable CUDA
        raise CommError(
            f"nccl backend: cannot import cupy.cuda.nccl ({e}); install soapstone[gpu] "
            "(cupy-cuda12x), or soapstone[gpu13] (cupy-cuda13x) for a CUDA 13 torch, or use "
            "backend='mpi'"
        ) from e
    if not getattr(nccl, "available", True):
        raise CommError("nccl backend: cupy was built without NCCL; use backend='mpi'")
    return nccl


def nccl_available() -> bool:
    """True when CUDA is usable and cupy.cuda.nccl imports."""
    if not torch.cuda.is_available():
        return False
    try:
        nccl_module()
    except CommError:
        return False
    return True


def select_local_device() -> int:
    """Set torch's (and cupy's) CUDA device from this rank's node-local rank; return it."""
    from mpi4py import MPI

    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        dev = local.Get_rank() % torch.cuda.device_count()
    finally:
        local.Free()
    torch.cuda.set_device(dev)
    import cupy

    cupy.cuda.Device(dev).use()
    return dev


class NCCLCommunicator(GroupedP2P, Communicator):
    """Collectives over NCCL on CUDA tensors; `mpi_comm` (same ranks) carries the set-up."""

    device_type = "cuda"

    def __init__(self, mpi_comm=None):
        from mpi4py import MPI

        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size())
        nccl = self._nccl = nccl_module()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.bcast(uid, root=0)  # passed through unchanged: bytes or tuple
        self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._side: torch.cuda.Stream | None = None  # async ops' stream (made on first use)
        # inside batch_p2p: events to record on the side stream once the group is enqueued
        self._grouped: list | None = None
        self._types = {d: getattr(nccl, n, v) for d, (n, v) in _NCCL_TYPES.items()}
        self._ops = {o: getattr(nccl, n, v) for o, (n, v) in _NCCL_OPS.items()}

    def _check(self, op, t, name="t"):
        dtype = super()._check(op, t, name)
        if t.device.index != torch.cuda.current_device():
            raise CommError(
                f"{op}: `{name}` is on {t.device}, but this rank's NCCL communicator is on "
                f"cuda:{torch.cuda.current_device()}; move it there"
            )
        return dtype

    # NCCL calls return once enqueued: the flight-recorder entry stays ENQUEUED until a CUDA
    # event recorded after it fires, which the watchdog thread polls (the same deadline). The
    # Work of an async op has nothing to wait for on the host, so it is not tracked.
    def _call(self, op, t, dtype, times, async_op, check, fn, *args):
        return self._enqueued(super()._call(op, t, dtype, times, async_op, check, fn, *args))

    def _p2p(self, op, t, peer, tag, async_op):
        return self._enqueued(super()._p2p(op, t, peer, tag, async_op))

    def _enqueued(self, out):
        rec = self.flight
        if not rec.recording:
            return out
        event = torch.cuda.Event()  # on the stream the call went to: fires when it is done
        h = rec.current  # the entry the call just made
        if self._grouped is not None:  # enqueued only at groupEnd: recorded after it
            self._grouped.append((event, lambda: rec.enqueue(h, event)))
        else:
            event.record(self._side if isinstance(out, Work) and self._side is not None
                         else torch.cuda.current_stream())
            rec.enqueue(h, event)
        if isinstance(out, Work):
            out._rec = out._entry = None
        return out

    def _stream(self, async_op: bool = False) -> int:
        """The stream a call is enqueued on: the current one, or for an async call the side
        stream, after what the current stream has queued."""
        current = torch.cuda.current_stream()
        if not async_op:
            return current.cuda_stream
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(current)
        return self._side.cuda_stream

    def _done(self, result, async_op, finish=None, keep=None):
        # stream-ordered: nothing to wait for on the host. An async call ran on the side
        # stream: wait() orders the current stream after it (an event), then finishes.
        if async_op:
            event = torch.cuda.Event()
            if self._grouped is not None:  # recorded after groupEnd (_p2p_group)
                self._grouped.append((event, None))
            else:
                event.record(self._side)
            # test(): the event has fired (a grouped op's is recorded at groupEnd, before
            # batch_p2p returns its Works, so none is asked earlier)
            return Work(lambda: torch.cuda.current_stream().wait_event(event), result, finish,
                        keep=keep, test=event.query)
        return finish() if finish is not None else result

    def _allreduce(self, t, op, async_op):
        n = t.numel()
        ptr = t.data_ptr()
        self._comm.allReduce(ptr, ptr, n, self._types[t.dtype], self._ops[op],
                             self._stream(async_op))
        return self._done(t, async_op)

    def _reduce_scatter(self, t, dim, async_op, out=None):
        src = chunks_first(t, dim, self.size)
        if out is None:  # this rank's chunk is always contiguous: `out` is written directly
            shape = list(t.shape)
            shape[dim] //= self.size
            out = torch.empty(shape, dtype=t.dtype, device=t.device)
        self._comm.reduceScatter(src.data_ptr(), out.data_ptr(), out.numel(),
                                 self._types[t.dtype], self._ops["sum"], self._stream(async_op))
        return self._done(out, async_op, keep=(t, src))

    def _allgather(self, t, dim, async_op, out=None):
        out_shape, flat = gather_layout(t, dim, self.size)
        if flat and out is not None:
            buf = out  # zero-copy: NCCL gathers straight into `out`
        else:
            buf = torch.empty(out_shape if flat else (self.size, *t.shape), dtype=t.dtype,
                              device=t.device)
        self._comm.allGather(t.data_ptr(), buf.data_ptr(), t.numel(), self._types[t.dtype],
                             self._stream(async_op))
        if flat:
            return self._done(buf, async_op, keep=t)
        if out is not None:
            return self._done(None, async_op, lambda: concat_into(buf, dim, out), keep=t)
        return self._done(None, async_op, lambda: concat_from_first(buf, dim), keep=t)

    def _broadcast(self, t, src, async_op):
        self._comm.bcast(t.data_ptr(), t.numel(), self._types[t.dtype], src,
                         self._stream(async_op))
        return self._done(t, async_op)

    def _exchange(self, send, send_counts, recv, recv_counts, elem, async_op=False):
        # NCCL has no alltoall: grouped send/recv pairs with every peer (NCCL >= 2.7).
        nccl, typ, stream = self._nccl, self._types[send.dtype], self._stream(async_op)
        sp, rp, size = send.data_ptr(), recv.data_ptr(), send.element_size()
        so = ro = 0
        nccl.groupStart()
        try:
            for j in range(self.size):
                if send_counts[j]:
                    self._comm.send(sp + so * size, send_counts[j] * elem, typ, j, stream)
                if recv_counts[j]:
                    self._comm.recv(rp + ro * size, recv_counts[j] * elem, typ, j, stream)
                so += send_counts[j] * elem
                ro += recv_counts[j] * elem
        finally:
            nccl.groupEnd()

    def _alltoall(self, t, split_dim, concat_dim, async_op, out=None):
        send = chunks_first(t, split_dim, self.size)
        direct = None if out is None else flat_view(out, concat_dim, self.size)
        recv = torch.empty_like(send) if direct is None else direct
        chunk = send[0].numel() if self.size else 0
        ones = [1] * self.size
        self._exchange(send, ones, recv, ones, chunk, async_op)
        if direct is not None:  # zero-copy: NCCL received straight into `out`
            return self._done(out, async_op, keep=send)
        if out is not None:
            return self._done(None, async_op, lambda: concat_into(recv, concat_dim, out),
                              keep=send)
        return self._done(None, async_op, lambda: concat_from_first(recv, concat_dim), keep=send)

    def _alltoallv(self, t, send_sizes, recv_sizes, dim, async_op):
        send = t.movedim(dim, 0).contiguous() if dim else t
        rows = list(send.shape[1:])
        recv = torch.empty([sum(recv_sizes), *rows], dtype=t.dtype, device=t.device)
        elem = math.prod(rows)
        self._exchange(send, send_sizes, recv, recv_sizes, elem, async_op)
        finish = (lambda: recv.movedim(0, dim).contiguous()) if dim else None
        return self._done(recv, async_op, finish, keep=send)

    def _send(self, t, dst, tag, async_op):
        # NCCL has no tags: messages between a pair arrive in the order they were sent.
        self._comm.send(t.data_ptr(), t.numel(), self._types[t.dtype], dst,
                        self._stream(async_op))
        return self._done(None, True, keep=t) if async_op else None

    def _recv(self, t, src, tag, async_op):
        self._comm.recv(t.data_ptr(), t.numel(), self._types[t.dtype], src,
                        self._stream(async_op))
        return self._done(t, async_op)

    @contextlib.contextmanager
    def _p2p_group(self, synchronous: bool):
        """batch_p2p's bracket (NOT YET RUN ON A GPU): the sends and receives between
        nccl.groupStart() and groupEnd() are enqueued together at groupEnd, on the side stream
        (each after its own wait_stream, as any async op). The events of their Works and of
        the flight recorder are recorded only after groupEnd: recorded inside the group they
        would fire before the communication is even enqueued. NCCL sends are rendezvous
        already: `synchronous` changes nothing. An exception inside the group (or from
        groupEnd) leaves this rank's p2p out of step with its peers' for good: it must end the
        job, as soapstone's failure handler does (a partial group is still ended, so NCCL is
        not left inside groupStart)."""
        self._grouped = pending = []
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._grouped = None
            self._nccl.groupEnd()
            for event, then in pending:
                event.record(self._side)
                if then is not None:
                    then()

    def _barrier(self):
        torch.cuda.current_stream().synchronize()
        self.mpi.Barrier()

    def _free_backend(self):
        # pending work on the streams must finish before the communicator goes
        torch.cuda.current_stream().synchronize()
        if self._side is not None:
            self._side.synchronize()
        self._comm.destroy()
