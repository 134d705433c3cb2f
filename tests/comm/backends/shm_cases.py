"""Node-shared buffers (comm/backends/shm.py), run on every rank by tests/support/mpirun.py (see
tests/comm/backends/test_shm.py): a shared buffer's sum allreduce gives every rank the same bits as
MPI's at 2 ranks, the same bits on every rank at 4, and queued launches run in launch order."""

from __future__ import annotations

import gc
import os

import torch
from mpi4py import MPI
from mpirun import ranks

from soapstone.comm import Mesh, init

W = init("mpi")
R, N = W.rank, W.size


def rnd(rank: int, numel: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + salt)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def mpi_sum(t: torch.Tensor) -> torch.Tensor:
    """MPI's allreduce of a private copy of `t` (not a shared buffer: the MPI path)."""
    return W.allreduce(t.clone())


def same_everywhere(t: torch.Tensor, what: str) -> None:
    bits = W.mpi.allgather(t.view(torch.int8 if t.dtype.itemsize == 1 else t.dtype).tolist())
    assert all(b == bits[0] for b in bits), f"{what}: the ranks' results differ"


@ranks(2, 4)
def case_shared_sum_is_mpi_sum():
    """Every size (a chunk each, uneven chunks, fewer elements than ranks) and float dtype:
    at 2 ranks the bits of MPI's allreduce; at 4, the same bits on every rank, equal to the
    sum up to rounding (the summation order differs from MPI's)."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for numel in (1, 3, 7, 4096, 100_003):
            t = W.shared_zeros(numel, dtype)
            assert t is not None and t.dtype == dtype and t.numel() == numel
            assert not t.any(), "a new shared buffer is zeroed"
            t.copy_(rnd(R, numel, dtype, salt=numel))
            want = mpi_sum(t)
            got = W.allreduce(t)
            assert got is t
            if N == 2:
                assert torch.equal(t, want), f"{dtype} {numel}: not MPI's bits"
            else:
                same_everywhere(t, f"{dtype} {numel}")
                tol = 1e-1 if dtype == torch.bfloat16 else 1e-5  # bf16: 8 bits, rounded 3 times
                assert torch.allclose(t.double(), want.double(), rtol=tol, atol=tol)


@ranks(2, 4)
def case_shared_sum_again_and_again():
    """A buffer is reduced in place step after step (the gradient buckets' use): small
    integers, so every order sums exactly."""
    t = W.shared_zeros(1000, torch.float32)
    for step in range(3):
        t.copy_(torch.full((1000,), float(R + step)))
        W.allreduce(t)
        assert torch.equal(t, torch.full((1000,), float(sum(range(N)) + N * step)))


@ranks(2)
def case_queued_launches_run_in_order():
    """Async launches wait for nothing until one is waited on; waiting on the last runs every
    one before it; a later wait on an earlier one is a no-op that returns its buffer."""
    bufs = [W.shared_zeros(64 * (i + 1), torch.float32) for i in range(3)]
    for i, b in enumerate(bufs):
        b.fill_(R + i)
    works = [W.allreduce(b, async_op=True) for b in bufs]
    assert works[2].wait() is bufs[2]
    for i, (b, w) in enumerate(zip(bufs, works, strict=True)):
        assert w.wait() is b
        assert torch.equal(b, torch.full_like(b, 1 + 2 * i))


@ranks(2)
def case_other_ops_and_views_go_through_mpi():
    """Only the sum of a whole shared buffer runs in shared memory: max, and a slice of one,
    are MPI's allreduce (same answers)."""
    t = W.shared_zeros(100, torch.float32)
    t.copy_(rnd(R, 100))
    want = t.clone()
    W.mpi.Allreduce(MPI.IN_PLACE, want.numpy(), op=MPI.MAX)
    W.allreduce(t, op="max")
    assert torch.equal(t, want)
    t.fill_(R + 1)
    W.allreduce(t[10:20])
    assert torch.equal(t[10:20], torch.full((10,), 3.0)) and torch.equal(t[:10], torch.full(
        (10,), float(R + 1)))


@ranks(2, 4)
def case_shared_on_a_mesh_axis():
    """A sub-communicator (a mesh axis) has its own shared buffers."""
    mesh = Mesh(W, data=2, model=N // 2)
    c = mesh.comm("data")
    t = c.shared_zeros(10, torch.float32)
    assert t is not None
    t.fill_(R)
    c.allreduce(t)
    peers = [r for r in range(N) if (r % (N // 2)) == (R % (N // 2))]  # same model coordinate
    assert torch.equal(t, torch.full((10,), float(sum(peers)))), (t, peers)


@ranks(1, 2)
def case_no_shared_buffer_where_none_helps():
    """One rank, no elements, or SOAPSTONE_SHM_ALLREDUCE=0: None (the caller allocates a
    plain tensor)."""
    if N == 1:
        assert W.shared_zeros(10, torch.float32) is None
        return
    assert W.shared_zeros(0, torch.float32) is None
    comm = W.split(0)  # a new communicator: it asks the setting afresh
    os.environ["SOAPSTONE_SHM_ALLREDUCE"] = "0"
    try:
        assert comm.shared_zeros(10, torch.float32) is None
    finally:
        os.environ.pop("SOAPSTONE_SHM_ALLREDUCE")
    assert comm.shared_zeros(10, torch.float32) is not None


def shared_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "/soapstone-" in line]


@ranks(2)
def case_the_files_are_gone_once_mapped_and_the_memory_with_the_tensor():
    """Nothing is left under /dev/shm: each file is unlinked once every rank has mapped it; and
    its mapping goes when the tensor does (no buffer outlives its user)."""
    gc.collect()
    before = len(shared_mappings())
    t = W.shared_zeros(1 << 16, torch.float32)
    W.allreduce(t)
    ours = shared_mappings()
    assert len(ours) == before + 1, ours
    assert all(line.rstrip().endswith("(deleted)") for line in ours), ours
    del t
    gc.collect()
    assert len(shared_mappings()) == before
