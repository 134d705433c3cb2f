"""build_optimizer across pipeline stages (tests/shard/pipeline/pipe_optim_cases.py, one launch per
world size): global-norm clipping over every stage, tied weights summed over the pipe axis, ZeRO
0/1, AdamW and SGD, against the single-rank run."""

from __future__ import annotations

import pytest
from mpirun import case_params

CASES = "tests/shard/pipeline/pipe_optim_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_pipeline_optimizer_matches_single_rank(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
