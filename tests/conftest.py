"""Shared fixtures: one MPI launch per world size for the comm cases, cached per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the shared helpers (mpirun, measure, golden_show, hf_models) import by their own names
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from mpirun import run_cases  # noqa: E402

COMM_CASES = "tests/comm/comm_cases.py"


@pytest.fixture(scope="session")
def comm_runs():
    """`comm_runs(n)`: the CaseResults of running every comm case on n ranks (launched once)."""
    cache = {}

    def get(n: int, cases_file: str = COMM_CASES, env: dict | None = None):
        key = (n, cases_file, tuple(sorted((env or {}).items())))
        if key not in cache:
            cache[key] = run_cases(n, cases_file, env=env)
        return cache[key]

    return get
