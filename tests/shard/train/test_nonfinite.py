"""The NaN policy end to end: a non-finite loss or gradient norm never becomes an update;
`run` stops with one message naming the step and the first non-finite gradient, exit 3
(EXIT_NONFINITE, not 2: the input was well-formed), or under --on-nonfinite skip drops the
step's update, counts it in the metrics line and stops after --max-skips in a row. Real
mpiexec, real NaNs: a learning rate that overflows the weights, and a layer (a --plugin) that
produces NaN on one rank only, which the other rank learns of only through the collectives;
tests/shard/train/nonfinite_cases.py poisons the data rows of one rank and refuses a save."""

from __future__ import annotations

import json

import pytest
from mpirun import case_params, run_mpi

from soapstone.shard.train.nonfinite import EXIT_NONFINITE

CASES = "tests/shard/train/nonfinite_cases.py"
CLI = ["-m", "soapstone.dsl.cli"]
PLUGIN = ["--plugin", "tests/shard/train/nan_plugin.py"]
LR_POISON = ["run", "examples/gpt.par", "--parallel", "dp2", "--optimizer", "sgd", "--lr", "1e30",
             "--quiet"]


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def clean_exit(r, code: int) -> str:
    assert r.returncode == code and not r.timed_out, r.report()
    assert "Traceback" not in r.stdout + r.stderr, r.report()
    return r.stdout + r.stderr


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_exit_code_is_its_own():
    assert EXIT_NONFINITE == 3


def test_an_exploding_lr_stops_the_run_with_exit_3(tmp_path):
    r = run_mpi(2, [*CLI, *LR_POISON, "--steps", "6", "--save", str(tmp_path / "ck"),
                    "--save-every", "1"], timeout=240)
    out = clean_exit(r, EXIT_NONFINITE)
    assert "error: step 2: the loss is nan and the gradient norm is nan (first non-finite " \
           "gradient: embedding0.table, on rank 0): the update was not applied and the run " \
           "stops (--on-nonfinite stop)" in out, out
    assert out.count("error: step 2") == 1  # rank 0 alone says it
    # step 1 (finite) was saved; nothing after it
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001"]


def test_skip_counts_each_skipped_step_then_stops_after_max_skips(tmp_path):
    m = tmp_path / "m.jsonl"
    r = run_mpi(2, [*CLI, *LR_POISON, "--steps", "8", "--on-nonfinite", "skip", "--max-skips",
                    "2", "--metrics", str(m)], timeout=240)
    out = clean_exit(r, EXIT_NONFINITE)
    assert "step 2: loss nan, gradient norm nan: update skipped (1 in a row, 1 in all" in out
    assert "3 non-finite steps in a row, more than --max-skips 2" in out, out
    got = rows(m)
    assert [(x["step"], x["skipped"], x["skipped_steps"]) for x in got] == \
        [(0, False, 0), (1, True, 1), (2, True, 2)], got
    assert got[0]["loss"] > 0 and got[1]["loss"] is None  # JSON has no NaN: null


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_on_one_rank_is_decided_alike_everywhere(tmp_path, mode):
    """world rank 1's layer returns NaN at its 5th training call (step 3 of 6); rank 0's data
    is clean. stop: every rank exits 3 (no hang); skip: the run goes on and ends well."""
    m = tmp_path / "m.jsonl"
    r = run_mpi(2, [*CLI, "run", "examples/swiglu.par", "--parallel", "dp2", *PLUGIN,
                    "--steps", "6", "--quiet", "--on-nonfinite", mode, "--metrics", str(m)],
                timeout=240, env={"SOAPSTONE_TEST_NAN": "1:5"})
    if mode == "stop":
        out = clean_exit(r, EXIT_NONFINITE)
        assert "error: step 3: the loss is nan and the gradient norm is nan" in out, out
        assert [x["step"] for x in rows(m)] == [0, 1]
        return
    out = clean_exit(r, 0)
    assert "step 3: loss nan, gradient norm nan: update skipped (1 in a row, 1 in all" in out
    assert "done: 6 steps" in out and "1 non-finite steps skipped" in out, out
    got = rows(m)
    assert [x["skipped"] for x in got] == [False, False, True, False, False, False], got
    assert got[-1]["skipped_steps"] == 1 and got[-1]["loss"] < got[0]["loss"], got


@pytest.mark.parametrize("flags,needle", [
    (["--max-skips", "3"], "--max-skips 3: only with --on-nonfinite skip"),
    (["--on-nonfinite", "skip", "--max-skips", "-1"], "--max-skips -1: give 0 or more"),
])
def test_bad_nonfinite_flags_exit_2(flags, needle):
    r = run_mpi(1, [*CLI, "run", "examples/mlp.par", "--steps", "1", *flags], timeout=120)
    out = clean_exit(r, 2)
    assert needle in out, out
