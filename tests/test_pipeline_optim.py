"""build_optimizer across pipeline stages (tests/cases/pipe_optim_cases.py, one launch per world
size): global-norm clipping over every stage, tied weights summed over the pipe axis, ZeRO 0/1,
AdamW and SGD, against the single-rank run."""

from __future__ import annotations

import pytest
from mpirun import case_names

CASES = "tests/cases/pipe_optim_cases.py"


@pytest.mark.parametrize("n,case", [(4 if "dp2" in c else 2, c) for c in case_names(CASES)])
def test_pipeline_optimizer_matches_single_rank(comm_runs, n, case):
    comm_runs(n, CASES).check(case)
