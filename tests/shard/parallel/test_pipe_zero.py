"""ZeRO 2 and 3 inside pipeline stages: golden-equal to one rank (with and without recompute)
and explain's counters equal to the comm layer's (tests/shard/parallel/pipe_zero_cases.py)."""

from __future__ import annotations

import pytest
from mpirun import case_names, case_params

CASES = "tests/shard/parallel/pipe_zero_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_pipe_zero_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
