"""Ranks sharing a GPU (`--device cuda --comm mpi`): MPI staged through host memory
(comm/backends/staged.py), tested on the CPU as far as it goes without CUDA.

- every comm case (tests/comm/comm_cases.py) at 2 ranks through the staging path, host
  tensors standing in for the GPU's (each message really is copied out and back);
- training layouts on a mesh of staged communicators reproduce the plain MPI run's losses
  exactly (tests/comm/backends/staged_cases.py);
- the choice: which --device / --comm / ranks-per-GPU combinations are allowed, and the
  messages (exit 2) of those that are not. The CUDA run itself is in make gpu-check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMM_CASES
from mpirun import case_params, run_mpi

from soapstone.comm.launch.device import backend, comm_error, gpus_per_node_error

CLI = ["-m", "soapstone.dsl.cli"]


@pytest.mark.parametrize("case,n", case_params(COMM_CASES, sizes=[2]))
def test_comm_case_staged(comm_runs, case, n):
    comm_runs(n, env={"SOAPSTONE_TEST_BACKEND": "staged"}).check(case)


@pytest.mark.parametrize("case,n", case_params("tests/comm/backends/staged_cases.py"))
def test_staged_case(comm_runs, case, n):
    comm_runs(n, "tests/comm/backends/staged_cases.py").check(case)


def test_which_backend_serves_which_choice():
    assert backend("cpu") == backend("cpu", "mpi") == "mpi"
    assert backend("cuda") == backend("cuda", "nccl") == "nccl"
    assert backend("cuda", "mpi") == "mpi-staged"


def test_comm_choices_allowed_and_refused():
    # a GPU per rank: always NCCL; --comm mpi is refused, naming the numbers and the fix
    assert comm_error("cuda", "auto", 2, 2, "h") is None
    assert comm_error("cuda", "nccl", 1, 8, "h") is None
    msg = comm_error("cuda", "mpi", 2, 2, "node3")
    assert "the 2 ranks on node node3 each have a GPU of their own (2 GPUs)" in msg
    assert "drop --comm mpi" in msg
    # ranks sharing GPUs: only with --comm mpi, and the refusal offers it
    assert comm_error("cuda", "mpi", 4, 1, "h") is None
    assert comm_error("cuda", "mpi", 3, 2, "h") is None
    for comm in ("auto", "nccl"):
        msg = comm_error("cuda", comm, 4, 1, "node3")
        assert "4 ranks on node node3 but 1 GPU" in msg and "--comm mpi" in msg, msg
    assert "add --comm mpi" in gpus_per_node_error(8, 4, host="n")
    assert "no GPU" in comm_error("cuda", "mpi", 2, 0, "h")
    # the CPU: MPI only
    assert comm_error("cpu", "mpi", 2, 0, "h") is None
    assert comm_error("cpu", "auto", 2, 0, "h") is None
    assert "--comm nccl: NCCL moves CUDA tensors; add --device cuda" in \
        comm_error("cpu", "nccl", 1, 0, "h")
    assert "unknown" in comm_error("cuda", "gloo", 1, 1, "h")


def test_comm_nccl_on_the_cpu_is_exit_2_on_every_rank():
    r = run_mpi(2, [*CLI, "run", "examples/mlp.par", "--parallel", "dp2", "--steps", "1",
                    "--comm", "nccl"], timeout=90)
    assert r.returncode == 2, r.report()
    assert r.stderr.count("error: --comm nccl: NCCL moves CUDA tensors") == 1, r.report()
    assert "Traceback" not in r.stdout + r.stderr, r.report()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_comm_mpi_without_cuda_is_exit_2():
    """Staging needs no NCCL, but it does need a GPU: the message says so, on every rank."""
    r = run_mpi(2, [*CLI, "golden", "check", "examples/gpt2.par", "tests/golden/runs/gpt2.npz",
                    "--parallel", "tp2", "--device", "cuda", "--comm", "mpi"], timeout=90)
    assert r.returncode == 2, r.report()
    assert r.stderr.count("error: --device cuda: torch") == 1, r.report()
    assert "Traceback" not in r.stdout + r.stderr, r.report()
