"""The Communicator interface, its Work handle, CommError and the byte counter.

The public methods here check their input (before any backend call, so a wrong argument is a
clear CommError on the rank that passed it, not a hang), optionally cross-check the call across
ranks (SOAPSTONE_DEBUG_COLLECTIVES=1), count bytes, and hand over to the backend's `_op` method.
Backends (mpi.py, nccl.py) implement only the `_op` methods.

Semantics the compiler relies on:
- allreduce, broadcast: in place on `t`, return `t`.
- allgather, reduce_scatter, alltoall, alltoallv: return a new tensor, never touch the input.
  allgather, reduce_scatter and alltoall take an optional `out=`: a contiguous tensor of the
  result's exact shape, dtype and device that the result is written into and that is returned
  (no allocation per call). When the result's layout is the flat one MPI/NCCL produce (gather
  or concat along the outermost non-trivial dim, and always for reduce_scatter) the backend
  writes straight into `out`; otherwise it goes through a temporary and one copy into `out`.
- async_op=True returns a Work whose wait() returns what the blocking call would have returned.

Byte accounting (`stats`): bytes this rank puts on the wire under the ring algorithms, i.e. the
nccl-tests "bus bytes" of the call, so that a predicted figure and busbw use one convention.
See `accounting.bus_bytes` for the formula of each op.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from soapstone.comm.accounting import bus_factor
from soapstone.comm.arg_checks import as_int, check_shared, check_tag, counts
from soapstone.comm.dtypes import FLOATING, SUPPORTED, SUPPORTED_SET, dtype_name
from soapstone.comm.errors import CommError
from soapstone.comm.observe._flight_ring import use_tensor_getters, use_tensor_reader
from soapstone.comm.observe.flight_recorder import new_recorder
from soapstone.comm.op_table import COLLECTIVES, COUNTED_OPS, REDUCE_OPS

_NOTHING = torch.empty(0)  # what a barrier records as its tensor
_NOTHING_DTYPE = _NOTHING.dtype


def _connect_tensor_reading() -> str:
    """Give the flight recorder's rings the fastest way to read a tensor this install has;
    returns how they read (benchmarks print it)."""
    # torch's own getters, called directly (half the cost of attribute lookups): always there
    use_tensor_getters(*(next(c.__dict__[n] for c in type(_NOTHING).__mro__ if n in c.__dict__)
                         for n in ("shape", "ndim", "nbytes")))
    use_tensor_reader(None)
    try:  # the C++ reader (setup.py builds it when torch is there at build time)
        from soapstone.comm.observe import _tensor_reader
    except ImportError:
        return "torch's Python getters (the C++ tensor reader was not built)"
    running = torch.__version__.split("+")[0]
    if _tensor_reader.built_for != running:  # another torch's layouts: never read with it
        return (f"torch's Python getters (the C++ tensor reader was built for torch "
                f"{_tensor_reader.built_for}, this is {running}: reinstall soapstone)")
    use_tensor_reader(_tensor_reader.reader)
    return f"torch's C++ tensor (reader built for torch {running})"


TENSOR_READING = _connect_tensor_reading()


class OpStats(NamedTuple):
    """Per-op counter: number of calls and bus bytes sent by this rank (see `bus_bytes`)."""

    calls: int
    bytes: int


class Work:
    """Handle of an async op: wait() completes it and returns the result tensor; test() asks
    without blocking."""

    __slots__ = ("_wait", "_finish", "_result", "_done", "_keep", "_rec", "_entry", "_test")

    def __init__(
        self,
        wait: Callable[[], None] | None,
        result: torch.Tensor | None,
        finish: Callable[[], torch.Tensor] | None = None,
        keep: Any = None,
        test: Callable[[], bool] | None = None,
    ):
        self._wait = wait
        self._finish = finish
        self._result = result
        self._done = False
        self._keep = keep  # buffers the backend reads or writes until completion stay alive
        self._rec = None  # the flight recorder and entry handle of this op (Communicator._call)
        self._entry = None
        # whether the backend has completed the op, without blocking (None: it cannot tell,
        # so only wait() completes it)
        self._test = test

    def test(self) -> bool:
        """Whether the op is complete, without blocking; if it is, complete it as wait() does
        (its buffers are let go), so a caller can drop finished sends as it goes."""
        if not self._done:
            if self._test is None or not self._test():
                return False
            self.wait()
        return True

    def wait(self) -> torch.Tensor | None:
        """Block until the op is complete; return its result (idempotent)."""
        if not self._done:
            rec = self._rec
            if rec is None:
                self._complete()
            else:  # the entry's wait, timed by the recorder (see Communicator._call)
                h = self._entry
                rec.wait_begin(h)
                try:
                    self._complete()
                except BaseException:
                    rec.fail(h)
                    raise
                rec.wait_end(h)
        return self._result

    def _complete(self) -> None:
        if self._wait is not None:
            self._wait()
        if self._finish is not None:
            self._result = self._finish()
        self._done = True
        self._keep = None


def _debug_from_env() -> bool:
    return os.environ.get("SOAPSTONE_DEBUG_COLLECTIVES", "") not in ("", "0")


class Communicator(abc.ABC):
    """A group of ranks and the collectives over it (see the module doc for the semantics)."""

    #: "cpu" or "cuda": where tensors passed to this communicator must live.
    device_type: str = "cpu"
    #: how many ranks share this rank's device (more than 1 only for ranks sharing a GPU
    #: over backends/staged.py); the fit check divides the device's memory by it
    ranks_per_gpu: int = 1

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.debug = _debug_from_env()
        self._freed = False
        #: numbers and counts every op, records the last ones (SOAPSTONE_FLIGHT_RECORDER) and
        #: names this communicator in reports and dumps
        self.flight = new_recorder(self)
        for op in COUNTED_OPS:
            self.flight.count_as(op, *bus_factor(op, size))

    @property
    def label(self) -> str:
        """What this communicator is, in reports: a mesh axis ('data', 'data+model'), 'world'
        or 'split'."""
        return self.flight.label

    @label.setter
    def label(self, value: str) -> None:
        self.flight.set_label(value)

    # -- the byte counter ------------------------------------------------------------------
    # (kept in the flight recorder's C rings, which count every op as it passes)
    @property
    def stats(self) -> dict[str, OpStats]:
        """op name -> OpStats(calls, bus bytes sent by this rank (accounting.bus_bytes))."""
        return {k: OpStats(*v) for k, v in self.flight.stats().items()}

    def reset_stats(self) -> None:
        """Zero the byte counter."""
        self.flight.reset_stats()

    # -- input checks (before the backend is called) --------------------------------------
    def _check(self, op: str, t: Any, name: str = "t") -> torch.dtype:
        """Raise CommError unless `t` can go to this communicator; return its dtype (read once
        here, also for the flight recorder's entry)."""
        if self._freed:
            raise CommError(f"{op}: this communicator was freed; use one that is still alive")
        if not isinstance(t, torch.Tensor):
            raise CommError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        dtype = t.dtype
        if dtype not in SUPPORTED_SET:
            raise CommError(
                f"{op}: `{name}` has dtype {dtype}, which soapstone.comm does not support; "
                f"cast it to one of {', '.join(dtype_name(d) for d in SUPPORTED)}"
            )
        if self.device_type == "cpu":
            if not t.is_cpu:
                raise CommError(
                    f"{op}: `{name}` is on {t.device}, but this is a CPU (MPI) communicator; "
                    "move it with .cpu() or use the nccl backend"
                )
        elif not t.is_cuda:
            raise CommError(
                f"{op}: `{name}` is on {t.device}, but this is a CUDA (NCCL) communicator; "
                "move it with .cuda() or use the mpi backend"
            )
        if not t.is_contiguous():
            raise CommError(f"{op}: `{name}` is not contiguous; pass `{name}.contiguous()`")
        return dtype

    def _check_dim(self, op: str, t: torch.Tensor, dim: int, name: str = "dim") -> int:
        nd = t.dim()
        if type(dim) is not int:  # a str, None or float would fail deep in the layout math
            dim = as_int(op, name, dim, "a dim")
        if not -nd <= dim < nd or nd == 0:
            raise CommError(
                f"{op}: `{name}`={dim} is out of range for a tensor of shape {tuple(t.shape)}; "
                f"pass a dim in [{-nd}, {nd - 1}]"
            )
        return dim % nd

    def _check_divides(self, op: str, t: torch.Tensor, dim: int, name: str = "dim") -> None:
        if t.shape[dim] % self.size:
            raise CommError(
                f"{op}: size {t.shape[dim]} of `{name}`={dim} (shape {tuple(t.shape)}) is not "
                f"divisible by the communicator size {self.size}; pad or pick another dim"
            )

    def _check_rank(self, op: str, r: Any, name: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise CommError(
                f"{op}: `{name}`={r!r} is not a rank of this communicator; "
                f"pass an int in [0, {self.size - 1}]"
            )

    def _check_out(self, op: str, t: torch.Tensor, out: Any, shape: Sequence[int]) -> None:
        """`out=` must be a contiguous tensor on this communicator's device with `t`'s dtype
        and exactly the result's `shape` (checked before any backend call)."""
        self._check(op, out, "out")
        want = tuple(shape)
        if out.dtype != t.dtype:
            raise CommError(
                f"{op}: `out` has dtype {out.dtype}, expected {t.dtype} (the input's dtype); "
                f"pass an `out` of dtype {t.dtype}"
            )
        if tuple(out.shape) != want:
            raise CommError(
                f"{op}: `out` has shape {tuple(out.shape)}, expected {want} (the result's "
                f"shape); pass torch.empty({want}, dtype={t.dtype}) or leave out=None"
            )

    def _call(self, op: str, t: torch.Tensor, dtype, times: int, async_op: bool, check, fn,
              *args):
        """Run backend call `fn(*args)` for collective `op` on `t` through the flight
        recorder's one C call, `run`: it numbers the op, counts `t`'s bytes times `times` (the
        byte counter; allgather: the size; 0: the caller counts) and, when recording, writes
        an entry before and completes it after (async: in the Work's wait()), which the
        watchdog watches. `dtype`: `t`'s, as `_check` read it. `check`: the op's arguments for
        the debug cross-check (SOAPSTONE_DEBUG_COLLECTIVES), run inside the call too, since it
        communicates. This is every collective's hot path, the same Python whether or not the
        ops are recorded."""
        rec = self.flight
        if self.debug and check is not None:
            fn, args = self._debug_then, (op, t, check, fn, args)
        out = rec.run(op, t, dtype, -1, False, times, async_op, fn, args)
        if async_op:
            self._track(out, rec, op, t, -1)
        return out

    def _track(self, work: Work, rec, op: str, t: torch.Tensor, peer: int) -> None:
        """Let an async op's wait() time its entry; unrecorded, let the watchdog name the
        wait() it finds blocked."""
        if rec.recording:
            work._rec, work._entry = rec, rec.current
        else:
            work._entry = (self, op, t, peer)

    def _debug_then(self, op, t, check, fn, args):
        self._debug(op, t, *check)
        return fn(*args)

    def _debug(self, op: str, t: torch.Tensor, *args) -> None:
        from soapstone.comm.observe.debug import check_agree

        if op == "alltoallv":
            from soapstone.comm.observe.debug import check_alltoallv_sizes

            dim, send_sizes, recv_sizes = args
            check_agree(self, op, t, (dim,))
            check_alltoallv_sizes(self, send_sizes, recv_sizes)
            return
        check_agree(self, op, t, args)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Reduce `t` over all ranks in place (op: sum, avg, max, min); return `t`."""
        dtype = self._check("allreduce", t)
        if op not in REDUCE_OPS:
            raise CommError(f"allreduce: `op`={op!r} is unknown; pass one of {REDUCE_OPS}")
        if op == "avg" and dtype not in FLOATING:
            raise CommError(
                f"allreduce: op='avg' needs a floating dtype, got {dtype}; "
                "use op='sum' and divide, or cast"
            )
        return self._call("allreduce", t, dtype, 1, async_op, (REDUCE_OPS.index(op),),
                          self._allreduce, t, op, async_op)

    def reduce_scatter(
        self, t: torch.Tensor, dim: int = 0, async_op: bool = False, out: torch.Tensor | None = None
    ):
        """Sum `t` over ranks; return this rank's equal chunk along `dim` (a new tensor, or
        written into `out` and `out` returned)."""
        dtype = self._check("reduce_scatter", t)
        dim = self._check_dim("reduce_scatter", t, dim)
        self._check_divides("reduce_scatter", t, dim)
        if out is not None:
            shape = list(t.shape)
            shape[dim] //= self.size
            self._check_out("reduce_scatter", t, out, shape)
        return self._call("reduce_scatter", t, dtype, 1, async_op, (dim,),
                          self._reduce_scatter, t, dim, async_op, out)

    def allgather(
        self, t: torch.Tensor, dim: int = 0, async_op: bool = False, out: torch.Tensor | None = None
    ):
        """Concatenate every rank's `t` along `dim` in rank order (a new tensor, or written
        into `out` and `out` returned)."""
        dtype = self._check("allgather", t)
        dim = self._check_dim("allgather", t, dim)
        if out is not None:
            self._check_out("allgather", t, out, gather_layout(t, dim, self.size)[0])
        return self._call("allgather", t, dtype, self.size, async_op, (dim,), self._allgather,
                          t, dim, async_op, out)

    def broadcast(self, t: torch.Tensor, src: int = 0, async_op: bool = False):
        """Copy rank `src`'s `t` into every rank's `t` in place; return `t`."""
        dtype = self._check("broadcast", t)
        self._check_rank("broadcast", src, "src")
        return self._call("broadcast", t, dtype, 1, async_op, (src,), self._broadcast, t, src,
                          async_op)

    def alltoall(
        self,
        t: torch.Tensor,
        split_dim: int = 0,
        concat_dim: int = 0,
        async_op: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Send chunk j of `t` (split along split_dim) to rank j; concat what arrives along
        concat_dim in rank order (a new tensor, or written into `out` and `out` returned)."""
        dtype = self._check("alltoall", t)
        split_dim = self._check_dim("alltoall", t, split_dim, "split_dim")
        concat_dim = self._check_dim("alltoall", t, concat_dim, "concat_dim")
        self._check_divides("alltoall", t, split_dim, "split_dim")
        if out is not None:
            shape = list(t.shape)
            shape[split_dim] //= self.size
            shape[concat_dim] *= self.size
            self._check_out("alltoall", t, out, shape)
        return self._call("alltoall", t, dtype, 1, async_op, (split_dim, concat_dim),
                          self._alltoall, t, split_dim,
                          concat_dim, async_op, out)

    def alltoallv(
        self,
        t: torch.Tensor,
        send_sizes: Sequence[int],
        recv_sizes: Sequence[int],
        dim: int = 0,
        async_op: bool = False,
    ):
        """Send `send_sizes[j]` slices of `t` along `dim` to rank j; concat the `recv_sizes[j]`
        slices from each rank j along `dim` (a new tensor)."""
        dtype = self._check("alltoallv", t)
        dim = self._check_dim("alltoallv", t, dim)
        send_sizes = counts("alltoallv", "send_sizes", send_sizes)
        recv_sizes = counts("alltoallv", "recv_sizes", recv_sizes)
        for name, sizes in (("send_sizes", send_sizes), ("recv_sizes", recv_sizes)):
            if len(sizes) != self.size or min(sizes, default=0) < 0:
                raise CommError(
                    f"alltoallv: `{name}`={sizes} must be {self.size} non-negative counts, "
                    "one per rank"
                )
        if sum(send_sizes) != t.shape[dim]:
            raise CommError(
                f"alltoallv: `send_sizes`={send_sizes} sum to {sum(send_sizes)}, but `t` has "
                f"{t.shape[dim]} along dim {dim}; make them sum to t.shape[dim]"
            )
        row = t.numel() // max(t.shape[dim], 1) * t.element_size()
        off_rank = sum(s for j, s in enumerate(send_sizes) if j != self.rank)
        self.flight.count("alltoallv", off_rank * row)
        return self._call("alltoallv", t, dtype, 0, async_op,
                          (dim, send_sizes, recv_sizes), self._alltoallv, t, send_sizes,
                          recv_sizes, dim, async_op)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send `t` to rank `dst` (blocking; the receiver knows the shape)."""
        self._p2p("send", t, dst, tag, False)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive from rank `src` into `t` (its shape and dtype must match); return `t`."""
        return self._p2p("recv", t, src, tag, False)

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending `t` to `dst`; wait() on the handle before reusing `t`."""
        return self._p2p("isend", t, dst, tag, True)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving from `src` into `t`; wait() returns `t` once it has arrived."""
        return self._p2p("irecv", t, src, tag, True)

    def _p2p(self, op: str, t: torch.Tensor, peer: int, tag: int, async_op: bool):
        """send, recv, isend, irecv: check, record, count, hand to the backend."""
        sending = op in ("send", "isend")
        dtype = self._check_p2p(op, t, peer, "dst" if sending else "src", tag)
        if sending:
            fn = self._send_debug if self.debug else self._send
        else:
            fn = self._recv_debug if self.debug else self._recv
        rec = self.flight
        out = rec.run(op, t, dtype, peer, sending, 1, async_op, fn, (t, peer, tag, async_op))
        if async_op:
            self._track(out, rec, op, t, peer)
        return out

    def _send_debug(self, t, dst, tag, async_op):
        """_send with SOAPSTONE_DEBUG_COLLECTIVES: the descriptor travels beside the data."""
        from soapstone.comm.observe.debug import send_descriptor

        sent = send_descriptor(self, t, dst, tag)
        work = self._send(t, dst, tag, async_op)
        if async_op:
            return Work(None, None, lambda: (work.wait(), sent.wait())[0], keep=(work, sent),
                        test=lambda: work.test() and sent.test())
        sent.wait()
        return None

    def _recv_debug(self, t, src, tag, async_op):
        """_recv with SOAPSTONE_DEBUG_COLLECTIVES: the sender's descriptor is compared with `t`
        (irecv: non-blockingly, in wait(); a blocking receive here would deadlock neighbours
        that post their receives ahead, as pipelines do)."""
        from soapstone.comm.observe.debug import recv_descriptor

        pending = recv_descriptor(self, "irecv" if async_op else "recv", t, src, tag)
        if not async_op:
            pending.check(None)
            return self._recv(t, src, tag, False)
        work = self._recv(t, src, tag, True)
        return Work(None, None, lambda: pending.check(work), keep=(work, pending))

    def _check_p2p(self, op: str, t: torch.Tensor, peer: int, name: str,
                   tag: int) -> torch.dtype:
        dtype = self._check(op, t)
        self._check_rank(op, peer, name)
        if peer == self.rank:
            raise CommError(f"{op}: `{name}`={peer} is this rank; p2p to oneself deadlocks")
        check_tag(op, tag)
        return dtype

    def barrier(self) -> None:
        """Block until every rank of this communicator has reached the barrier."""
        if self._freed:
            raise CommError("barrier: this communicator was freed; use one that is still alive")
        self._call("barrier", _NOTHING, _NOTHING_DTYPE, 0, False, None, self._barrier)

    def shared_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed flat tensor whose sum allreduce this backend can do faster in place (MPI
        ranks on one node: a buffer in shared memory, backends/shm.py), or None where it has
        none: allocate a plain one then. Collective."""
        check_shared(numel, dtype)
        return None

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Sub-communicator of the ranks passing the same `color`, ordered by `key` (collective).

        color=None: this rank joins none and gets None.
        """
        from mpi4py import MPI

        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return type(self)(sub)  # each backend is built from the MPI comm over its ranks

    def free(self) -> None:
        """Release this sub-communicator: NCCL destroys its communicator, and the MPI
        communicator it wraps is freed. Idempotent; collective in MPI's sense (every rank of
        it frees it); any later call on it is a CommError. A no-op on a communicator over
        COMM_WORLD or COMM_SELF (the world from init() lives as long as the process)."""
        from mpi4py import MPI

        c = self.mpi
        if self._freed or c is None or c == MPI.COMM_WORLD or c == MPI.COMM_SELF:
            return
        self._freed = True
        self._free_backend()
        if c != MPI.COMM_NULL:
            c.Free()

    def _free_backend(self) -> None:
        """Backend resources beyond the MPI communicator (NCCL: its communicator)."""
        return None

    # -- backend hooks ----------------------------------------------------------------------
    @abc.abstractmethod
    def _allreduce(self, t, op, async_op): ...

    @abc.abstractmethod
    def _reduce_scatter(self, t, dim, async_op, out=None): ...

    @abc.abstractmethod
    def _allgather(self, t, dim, async_op, out=None): ...

    @abc.abstractmethod
    def _broadcast(self, t, src, async_op): ...

    @abc.abstractmethod
    def _alltoall(self, t, split_dim, concat_dim, async_op, out=None): ...

    @abc.abstractmethod
    def _alltoallv(self, t, send_sizes, recv_sizes, dim, async_op): ...

    @abc.abstractmethod
    def _send(self, t, dst, tag, async_op): ...

    @abc.abstractmethod
    def _recv(self, t, src, tag, async_op): ...

    @abc.abstractmethod
    def _barrier(self): ...

    #: the MPI communicator over the same ranks (debug checks and splits use it).
    mpi: Any = None

    @property
    def device(self) -> torch.device:
        """Where new tensors for this communicator are made."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


def blocking_calls() -> dict:
    """The code objects of the comm calls a thread can be found blocked in -> the op each
    is (the watchdog samples stacks for them): every collective, the one method every p2p op
    runs in, and Work.wait."""
    codes = {getattr(Communicator, name).__code__: name for name in COLLECTIVES}
    codes[Communicator._p2p.__code__] = "p2p"
    codes[Work.wait.__code__] = "wait"
    return codes


# -- layout helpers shared by the backends (pure torch, no communication) --------------------
def gather_layout(t: torch.Tensor, dim: int, n: int) -> tuple[list[int], bool]:
    """Output shape of an allgather along `dim`, and whether the flat gather already is it."""
    out_shape = list(t.shape)
    out_shape[dim] *= n
    return out_shape, math.prod(t.shape[:dim]) == 1


def chunks_first(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """`t` rearranged to [n, *chunk_shape] with chunk j of `dim` contiguous at [j] (a copy
    only when the chunks are not already contiguous)."""
    shape = list(t.shape)
    if math.prod(shape[:dim]) == 1:  # already in that layout: one view (the common dim=0)
        shape[dim] //= n
        return t.view(n, *shape)
    split = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1 :]
    return t.reshape(split).movedim(dim, 0).contiguous()


def flat_view(out: torch.Tensor, dim: int, n: int) -> torch.Tensor | None:
    """`out` (contiguous, n chunks concatenated along `dim`) viewed as [n, *chunk] when that
    is its own memory layout (nothing before `dim` but size-1 dims), else None."""
    if math.prod(out.shape[:dim]) != 1:
        return None
    shape = list(out.shape)
    shape[dim] //= n
    return out.view(n, *shape)


def concat_into(buf: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor:
    """Write the n chunks of `buf` ([n, *chunk]) concatenated along `dim` into `out` (one
    copy); return `out`."""
    n = buf.shape[0]
    shape = list(buf.shape[1:])
    out.view(*shape[:dim], n, *shape[dim:]).movedim(dim, 0).copy_(buf)
    return out


def concat_from_first(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of gathering into [n, *chunk]: concatenate the n chunks along `dim`."""
    n = buf.shape[0]
    shape = list(buf.shape[1:])
    shape[dim] *= n
    if dim == 0 or math.prod(buf.shape[1 : dim + 1]) == 1:
        return buf.reshape(shape)
    return buf.movedim(0, dim).reshape(shape)
