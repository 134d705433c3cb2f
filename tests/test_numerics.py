"""Every example layout reproduces the single-rank run (tests/cases/numerics_cases.py),
launched under real mpiexec: one launch per world size, each case at the size its layout needs."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpirun import case_names

from soapstone import dsl

CASES = "tests/cases/numerics_cases.py"
ROOT = Path(__file__).resolve().parents[1]


def world_size(case: str) -> int:
    """case_<spec>_<layout> -> the layout's world size, read from tests/specs/<spec>_layouts.par."""
    spec, layout = case.removeprefix("case_").split("_", 1)
    # at use time: other tests unregister the custom layer when they finish with it
    dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))
    return dsl.load(ROOT / f"tests/specs/{spec}_layouts.par", check=False).parallels[layout] \
        .world_size


LAYOUT_CASES = [c for c in case_names(CASES)
                if not c.startswith(("case_full_state", "case_branch_ops"))]


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_layout_matches_single_rank(comm_runs, case):
    comm_runs(world_size(case), CASES).check(case)


def test_branch_ops_run_only_on_their_owner(comm_runs):
    comm_runs(2, CASES).check("case_branch_ops_run_only_on_their_owner")


@pytest.mark.parametrize("n", [2, 4])
def test_full_state_dict_round_trip(comm_runs, n):
    comm_runs(n, CASES).check("case_full_state_dict_round_trip")
