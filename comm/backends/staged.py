"""StagedMPICommunicator: MPI over device tensors, every message staged through host memory.

For ranks that share a GPU (`--device cuda --comm mpi`, comm/launch/device.py): NCCL refuses two
ranks of one communicator on one GPU, so these ranks exchange over MPI. Each op copies its device
input into a host tensor, runs the MPI backend's op on host tensors (mpi.py, unchanged), and
copies the result back onto the input's device: into `t` for the in-place ops (allreduce,
broadcast, recv), into `out=` when given, else as a new tensor on that device. The copies to
the host wait for the current stream (a blocking `.to("cpu")`), so the message holds what the
kernels before it wrote. An async op stays async: its Work finishes with the copy back, and a
send keeps its host copy alive until its wait. Slow by design (two copies a message, no
overlap with the GPU): it is for debugging a layout on one GPU, never for speed.

`device_type` says which tensors it takes: "cuda" in use; the tests build one with "cpu",
where host tensors stand in for the device's and every staging copy is a real copy.
"""

from __future__ import annotations

import torch

from soapstone.comm.backends.mpi import MPICommunicator
from soapstone.comm.communicator import Work


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (a fresh tensor even when `t` is on the CPU already)."""
    return t.detach().to("cpu", copy=True)


def _into(t: torch.Tensor):
    """Writes a host result into `t`'s memory and returns `t`: as the MPI backend writes a
    CPU tensor's, under autograd's notice (a leaf that requires grad included)."""
    def write(h: torch.Tensor) -> torch.Tensor:
        t.detach().copy_(h)
        return t
    return write


def _then(result, async_op: bool, back):
    """`back(result)` now, or, for an async op, a Work that applies it once the op is done."""
    if not async_op:
        return back(result)
    return Work(None, None, lambda: back(result.wait()), keep=result, test=result.test)


def _sharing(mpi_comm) -> int:
    """The most ranks of `mpi_comm` on one GPU of this node (collective): rank r of a node
    computes on GPU r mod GPUs."""
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local = node.Get_size()
    finally:
        node.Free()
    gpus = max(torch.cuda.device_count(), 1)
    return -(-local // gpus)


class StagedMPICommunicator(MPICommunicator):
    """MPI collectives and p2p on device tensors, staged through host memory (module doc)."""

    def __init__(self, mpi_comm=None, device_type: str = "cuda"):
        self.device_type = device_type
        super().__init__(mpi_comm)
        # the ranks of this node on one GPU (the fit check divides its memory by them)
        self.ranks_per_gpu = _sharing(self.mpi) if device_type == "cuda" else 1

    def split(self, color, key: int = 0):
        """Sub-communicator (collective), staged on the same device type."""
        from mpi4py import MPI

        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else type(self)(sub, self.device_type)

    @staticmethod
    def _to(device: torch.device, out: torch.Tensor | None):
        """How a host result comes back: into `out`, else as a new tensor on `device`."""
        if out is not None:
            return _into(out)
        return lambda h: h.to(device, copy=True)

    def _allreduce(self, t, op, async_op):
        h = _host(t)
        return _then(super()._allreduce(h, op, async_op), async_op, _into(t))

    def _broadcast(self, t, src, async_op):
        h = _host(t)
        return _then(super()._broadcast(h, src, async_op), async_op, _into(t))

    def _reduce_scatter(self, t, dim, async_op, out=None):
        r = super()._reduce_scatter(_host(t), dim, async_op)
        return _then(r, async_op, self._to(t.device, out))

    def _allgather(self, t, dim, async_op, out=None):
        r = super()._allgather(_host(t), dim, async_op)
        return _then(r, async_op, self._to(t.device, out))

    def _alltoall(self, t, split_dim, concat_dim, async_op, out=None):
        r = super()._alltoall(_host(t), split_dim, concat_dim, async_op)
        return _then(r, async_op, self._to(t.device, out))

    def _alltoallv(self, t, send_sizes, recv_sizes, dim, async_op):
        r = super()._alltoallv(_host(t), send_sizes, recv_sizes, dim, async_op)
        return _then(r, async_op, self._to(t.device, None))

    def _send(self, t, dst, tag, async_op):
        return super()._send(_host(t), dst, tag, async_op)  # an async send's Work keeps it

    def _recv(self, t, src, tag, async_op):
        h = torch.empty(t.shape, dtype=t.dtype)
        return _then(super()._recv(h, src, tag, async_op), async_op, _into(t))

    def _barrier(self):
        if self.device_type == "cuda":  # the GPU's queued work is part of what came before
            torch.cuda.current_stream().synchronize()
        super()._barrier()
