"""Every comm case (tests/cases/comm_cases.py) on 1, 2 and 4 real MPI ranks."""

from __future__ import annotations

import pytest
from conftest import COMM_CASES
from mpirun import case_names


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("case", case_names(COMM_CASES))
def test_comm_case(comm_runs, n, case):
    comm_runs(n).check(case)
