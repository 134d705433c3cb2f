"""The public communicator API misused as a script or a custom layer might: each call gets a
CommError naming the argument (or, where the input is fine, the right result), never a deep
mpi4py/torch error, a silently wrong result or a hang. Run on every rank by
tests/support/mpirun.py (see tests/comm/test_comm.py); SOAPSTONE_TEST_BACKEND picks the
backend as for comm_cases.py."""

from __future__ import annotations

import os

import numpy as np
import torch
from mpirun import Skip, ranks

from soapstone.comm import CommError, Mesh, init

BACKEND = os.environ.get("SOAPSTONE_TEST_BACKEND", "mpi")
if BACKEND == "staged":
    from mpi4py import MPI

    from soapstone.comm.backends.staged import StagedMPICommunicator

    init("mpi")
    W = StagedMPICommunicator(MPI.COMM_WORLD, device_type="cpu")
else:
    W = init(BACKEND)
R, N = W.rank, W.size
DEV = W.device


def _raises(fn, *words):
    try:
        fn()
    except CommError as e:
        assert all(w in str(e) for w in words), f"message {str(e)!r} lacks {words}"
        return
    raise AssertionError(f"expected CommError mentioning {words}")


@ranks(1, 2)
def case_avg_of_a_parameter_or_inference_tensor():
    # the division after the sum went through autograd, which refuses an in-place op on a
    # leaf that requires grad and on an inference tensor: the tensor was left holding the sum
    p = torch.nn.Parameter(torch.full((3,), float(R + 1), device=DEV))
    want = torch.full((3,), (N + 1) / 2, device=DEV)
    assert W.allreduce(p, op="avg") is p and torch.equal(p.detach(), want)
    assert p.requires_grad and p.grad is None
    q = torch.nn.Parameter(torch.full((3,), float(R + 1), device=DEV))
    assert torch.equal(W.allreduce(q, op="avg", async_op=True).wait().detach(), want)
    with torch.inference_mode():
        t = torch.full((3,), float(R + 1), device=DEV)
    assert torch.equal(W.allreduce(t, op="avg"), want)


@ranks(2, 4)
def case_recv_into_a_buffer_of_another_size():
    # a longer buffer was filled in part with its tail left stale, a shorter one raised MPI's
    # "Message truncated"; both now name the sizes, and the stream of messages stays in step
    if BACKEND == "nccl":
        raise Skip("NCCL reports no received size")
    if R == 0:
        for n in (3, 5, 3, 5, 3):
            W.send(torch.full((n,), float(n), device=DEV), 1)
        W.send(torch.ones(2, device=DEV), 1, tag=4)
    elif R == 1:
        _raises(lambda: W.recv(torch.zeros(5, device=DEV), 0), "recv", "rank 0", "holds 12",
                "20 bytes")
        _raises(lambda: W.recv(torch.zeros(3, device=DEV), 0), "recv", "more than 12")
        _raises(lambda: W.irecv(torch.zeros(5, device=DEV), 0).wait(), "irecv", "holds 12")
        w = W.irecv(torch.zeros(3, device=DEV), 0)
        while True:  # completed by test(): the check still runs, and wait() repeats it
            try:
                if w.test():
                    raise AssertionError("irecv of a longer message passed test()")
            except CommError as e:
                assert "more than 12" in str(e), e
                break
        _raises(w.wait, "more than 12")
        got = W.recv(torch.zeros(3, device=DEV), 0)
        assert torch.equal(got, torch.full((3,), 3.0, device=DEV)), got
        assert torch.equal(W.irecv(torch.zeros(2, device=DEV), 0, tag=4).wait(),
                           torch.ones(2, device=DEV))


@ranks(2)
def case_p2p_tags_outside_mpis_range():
    # MPI reads tag -1 as MPI_ANY_TAG: the receive took the tag-7 message meant for later
    x = torch.ones(2, device=DEV)
    if R == 0:
        W.send(torch.full((2,), 7.0, device=DEV), 1, tag=7)
        for tag in (-1, 2**40):
            _raises(lambda tag=tag: W.send(x, 1, tag=tag), "send", "`tag`")
        _raises(lambda: W.isend(x, 1, tag="a"), "isend", "`tag`", "int")
        _raises(lambda: W.batch_p2p([("isend", x, 1, 0), ("isend", x, 1, -2)]), "`tag`")
        W.send(torch.full((2,), 3.0, device=DEV), 1, tag=np.int64(3))  # numpy ints are tags
    else:
        _raises(lambda: W.recv(torch.zeros(2, device=DEV), 0, tag=-1), "recv", "`tag`=-1")
        got = W.recv(torch.zeros(2, device=DEV), 0, tag=3)
        assert torch.equal(got, torch.full((2,), 3.0, device=DEV)), got
        assert torch.equal(W.recv(torch.zeros(2, device=DEV), 0, tag=7),
                           torch.full((2,), 7.0, device=DEV))


@ranks(1, 2)
def case_dims_and_counts_that_are_not_ints():
    x = torch.ones(2 * N, 3, device=DEV)
    _raises(lambda: W.allgather(x, "0"), "allgather", "`dim`='0'", "int")
    _raises(lambda: W.reduce_scatter(x, None), "reduce_scatter", "`dim`=None")
    _raises(lambda: W.allgather(x, 1.0), "allgather", "`dim`=1.0")
    _raises(lambda: W.alltoall(x, 0, "1"), "alltoall", "`concat_dim`")
    # int() cut 1.5 to 1 and sent what the caller did not ask for
    _raises(lambda: W.alltoallv(x, [2] * (N - 1) + [1.5], [2] * N), "alltoallv",
            "`send_sizes`=1.5")
    _raises(lambda: W.alltoallv(x, [2] * N, ["2"] * N), "alltoallv", "`recv_sizes`")
    got = W.allgather(torch.full((2,), float(R), device=DEV), np.int64(0))  # numpy ints: dims
    assert got.tolist() == [float(r) for r in range(N) for _ in range(2)], got
    got = W.alltoallv(torch.full((N,), float(R), device=DEV), [np.int64(1)] * N, [1] * N)
    assert got.tolist() == [float(r) for r in range(N)], got


@ranks(1, 2)
def case_mesh_lookups_name_a_wrong_axis_or_rank():
    with Mesh(W, data=N, model=1) as m:
        # a misspelt axis was ignored: rank_of(dta=1) was this rank's own rank
        _raises(lambda: m.rank_of(dta=1), "no axis 'dta'", "data, model")
        _raises(lambda: m.rank_of(data=0.0), "rank_of", "data=0.0", "int")
        _raises(lambda: m.coords_of(N), "coords_of", f"[0, {N - 1}]")  # it wrapped around
        _raises(lambda: m.coords_of(-1), "coords_of")
        _raises(lambda: m.comm(["data"]), "no axis ['data']")  # was: unhashable type
        assert m.rank_of(data=N - 1) == N - 1 and m.coords_of(N - 1) == (N - 1, 0)


@ranks(1, 2)
def case_shared_zeros_checks_its_arguments_on_every_rank():
    # checked before the collective steps: a float count failed on rank 0 only (the others
    # waited), a str dtype failed deep, and a bool buffer was one no allreduce takes
    _raises(lambda: W.shared_zeros(4.0, torch.float32), "shared_zeros", "`numel`=4.0")
    _raises(lambda: W.shared_zeros(-4, torch.float32), "shared_zeros", "negative")
    _raises(lambda: W.shared_zeros(4, "float32"), "shared_zeros", "`dtype`='float32'")
    _raises(lambda: W.shared_zeros(4, torch.bool), "shared_zeros", "torch.float32")
    t = W.shared_zeros(np.int64(4), torch.float32)
    assert t is None or (t.numel() == 4 and not t.any())
