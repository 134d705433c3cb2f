"""Every example layout reproduces the single-rank run (tests/shard/runtime/numerics_cases.py),
launched under real mpiexec: one launch per world size, each case at the size its layout needs."""

from __future__ import annotations

import pytest
from mpirun import case_params

CASES = "tests/shard/runtime/numerics_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_numerics_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
