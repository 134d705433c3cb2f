"""The comm cases on the NCCL backend (CUDA tensors); skipped without CUDA/cupy.

By default the cases declared for world size 1 run, where they are near-trivial: every
collective is a copy (or nothing) on one GPU (p2p cases need 2 ranks), and no byte crosses
between GPUs. They check the wiring (dtypes, devices, layouts, error messages), not NCCL
traffic. Real traffic needs several GPUs and SOAPSTONE_NCCL_RANKS=2 (or 4), which also runs
every case declared for that many ranks, one GPU each.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import COMM_CASES
from mpirun import case_params

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="NCCL backend needs CUDA and cupy",
)
RANKS = [1] + ([int(os.environ["SOAPSTONE_NCCL_RANKS"])]
               if os.environ.get("SOAPSTONE_NCCL_RANKS") else [])


@pytest.mark.parametrize("case,n", case_params(COMM_CASES, sizes=RANKS))
def test_comm_case_nccl(comm_runs, case, n):
    comm_runs(n, env={"SOAPSTONE_TEST_BACKEND": "nccl"}).check(case)


def test_init_auto_picks_nccl(tmp_path):
    from mpirun import run_mpi

    code = ("import soapstone.comm as c, torch; w = c.init('auto'); "
            "assert type(w).__name__ == 'NCCLCommunicator', w; "
            "t = torch.ones(4, device='cuda'); w.allreduce(t); torch.cuda.synchronize(); "
            "print('OK', w)")
    res = run_mpi(1, ["-c", code], timeout=120, check=True)
    assert "OK NCCLCommunicator" in res.stdout
