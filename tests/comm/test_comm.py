"""Every comm case (tests/comm/comm_cases.py, and the API misuses of misuse_cases.py) on the
real MPI world sizes it declares (1, 2 and 4; the 2x2x2 mesh on 8)."""

from __future__ import annotations

import pytest
from conftest import COMM_CASES
from mpirun import case_params


@pytest.mark.parametrize("case,n", case_params(COMM_CASES))
def test_comm_case(comm_runs, case, n):
    comm_runs(n).check(case)


MISUSE_CASES = "tests/comm/misuse_cases.py"


@pytest.mark.parametrize("case,n", case_params(MISUSE_CASES))
def test_misuse_case(comm_runs, case, n):
    comm_runs(n, MISUSE_CASES).check(case)
