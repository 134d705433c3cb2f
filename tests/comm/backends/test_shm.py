"""Node-shared buffers and their in-place sum allreduce (comm/backends/shm.py): every case of
tests/comm/backends/shm_cases.py on the real MPI world sizes it declares (1, 2 and 4)."""

from __future__ import annotations

import pytest
from mpirun import case_params

CASES = "tests/comm/backends/shm_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_shm_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
