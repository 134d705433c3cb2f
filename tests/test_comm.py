"""Every comm case (tests/cases/comm_cases.py) on 1, 2 and 4 real MPI ranks."""

from __future__ import annotations

import pytest
from conftest import COMM_CASES
from mpirun import case_names, run_cases


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("case", case_names(COMM_CASES))
def test_comm_case(comm_runs, n, case):
    comm_runs(n).check(case)


def test_mesh_on_eight_ranks():
    """A 2x2x2 mesh whose ranks ask for different multi-axis communicators in different
    orders: every communicator exists up front, so nothing hangs."""
    names = ["case_mesh_2x2x2_multi_axis_comms_in_any_order"]
    res = run_cases(8, COMM_CASES, timeout=120, only=names)
    assert not res.launch.timed_out, res.launch.report()
    for name in names:
        res.check(name)
