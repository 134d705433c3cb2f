"""The language, the compiler and the plan need no torch: `check`, `show` and `explain` run in a
process where importing torch fails (a machine that cannot load it, or a login node)."""

from __future__ import annotations

import pytest
from no_torch import run_without_torch

_run = run_without_torch


@pytest.mark.parametrize("args", [
    ("check", "examples/gpt.par"),
    ("check", "examples/gpt.par", "--verify"),
    ("show", "examples/gpt.par", "--parallel", "dp2tp2"),
    ("show", "examples/gpt.par", "--parallel", "gpt8", "--json"),
    ("explain", "examples/gpt.par", "--parallel", "dp2tp2"),
    ("explain", "examples/gpt.par", "--parallel", "gpt8", "--json"),
])
def test_command_runs_without_torch(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "torch" not in r.stderr


def test_a_bad_spec_is_still_exit_2_without_torch():
    r = _run("show", "examples/gpt.par", "--parallel", "nosuchlayout")
    assert r.returncode == 2
    assert "nosuchlayout" in r.stderr and "Traceback" not in r.stderr
