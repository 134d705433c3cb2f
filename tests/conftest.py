"""Shared fixtures: one MPI launch per world size for every case file the session's tests run,
cached per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the shared helpers (mpirun, measure, golden_show, hf_models) import by their own names
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from mpirun import case_sizes, keep_planned, planned, run_cases  # noqa: E402

COMM_CASES = "tests/comm/comm_cases.py"


def pytest_collection_finish(session):
    """Plan the merged launches for the case parameters left after deselection only."""
    keep_planned({(item.module.__name__, item.callspec.params["case"], item.callspec.params["n"])
                  for item in session.items if hasattr(item, "callspec")
                  and {"case", "n"} <= set(item.callspec.params)})


@pytest.fixture(scope="session")
def comm_runs():
    """`comm_runs(n, cases_file)`: the CaseResults of that file's cases on n ranks (default the
    comm cases). The first call for n launches every case file the collected tests plan at n
    (mpirun.planned) together, so the session pays one launch per world size, not one per
    file and size (~100 s of process starts and imports on 2 cores); a call with `env` (a
    backend to select) launches its file alone, as does a file the merged launch did not
    finish (a crash or hang elsewhere in it: each file then reports on its own)."""
    merged: dict[int, object] = {}
    alone: dict[tuple, object] = {}

    def get(n: int, cases_file: str = COMM_CASES, env: dict | None = None):
        if not env:
            if n not in merged:
                files = planned(n)
                merged[n] = run_cases(n, files or [cases_file])
            res = merged[n].of(cases_file)
            if res is not None and (merged[n].launch.ok or _complete(res, n, cases_file)):
                return res
        key = (n, cases_file, tuple(sorted((env or {}).items())))
        if key not in alone:
            alone[key] = run_cases(n, cases_file, env=env)
        return alone[key]

    return get


def _complete(res, n: int, cases_file: str) -> bool:
    """Every case `cases_file` declares at size n reported on every rank."""
    return all(len(res.cases.get(c, {})) == n
               for c, sizes in case_sizes(cases_file).items() if n in sizes)
