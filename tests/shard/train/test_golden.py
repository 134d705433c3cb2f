"""Golden runs: every example layout (pipelines too: gpt8 on 8 ranks) reproduces its single-rank
record (tests/golden/runs/, made with `soapstone golden record`), and `golden check` names the first
diverging step and tensor. Cases: tests/shard/train/run_cases.py, one launch per world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_calls import cli
from mpirun import case_names, case_params, run_mpi

ROOT = Path(__file__).resolve().parents[3]
CASES = "tests/shard/train/run_cases.py"
CLI = ["-m", "soapstone.dsl.cli", "golden"]


# every run case but explain's (test_explain.py): one launch per size for both
GOLDEN = [c for c in case_names(CASES) if not c.startswith("case_explain_")]


@pytest.mark.parametrize("case,n", case_params(CASES, GOLDEN))
def test_example_layouts_match_their_records(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_record_format_is_pickle_free(tmp_path):
    out = tmp_path / "mlp.npz"
    r = run_mpi(1, [*CLI, "record", "examples/mlp.par", "-o", str(out), "--steps", "3"])
    assert r.ok, r.report()
    with np.load(out, allow_pickle=False) as z:
        header = json.loads(bytes(z["header"]).decode())
        assert header["format"] == "soapstone-golden/1"
        assert header["steps"] == 3 and header["optimizer"] == "sgd"
        assert z["loss"].shape == (3,)
        for name in header["params"]:
            assert z[f"digest/{name}"].shape[0] == 3
            assert f"final/{name}" in z


def test_check_names_first_diverging_step_and_tensor(tmp_path):
    with np.load(ROOT / "tests/golden/runs/mlp.npz", allow_pickle=False) as z:
        arrays = dict(z)
    header = json.loads(bytes(arrays["header"]).decode())
    name = header["params"][1]
    arrays[f"digest/{name}"][2, 4] += 1e-3  # a sampled value after step 2
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    r = run_mpi(2, [*CLI, "check", "examples/mlp.par", str(bad), "--parallel", "tp2"])
    assert r.returncode == 1, r.report()
    assert f"FAIL tp2: step 2: parameter {name}" in r.stdout, r.stdout
    assert "step 1: loss" in r.stdout and "Traceback" not in r.stdout + r.stderr


BAD_INPUT = [
    (["examples/mlp.par", "no/such.npz"], "no/such.npz: no such golden record"),
    (["examples/mlp.par", "README.md"], "not a soapstone golden record"),
    (["examples/gpt.par", "tests/golden/runs/mlp.npz"], "recorded model 'mlp'"),
]


def _broken(tmp_path, edit) -> Path:
    """The mlp record with `edit(header, arrays)` applied, saved pickle-free."""
    with np.load(ROOT / "tests/golden/runs/mlp.npz", allow_pickle=False) as z:
        arrays = dict(z)
    header = json.loads(bytes(arrays["header"]).decode())
    edit(header, arrays)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    bad = tmp_path / "broken.npz"
    np.savez(bad, **arrays)
    with np.load(bad, allow_pickle=False) as z:  # still a pickle-free file
        assert set(z.files) == set(arrays)
    return bad


BROKEN = [
    (lambda h, a: h.pop("seed"), "header lacks 'seed'"),
    (lambda h, a: a.update(loss=a["loss"][:-1]), "but the loss array has shape"),
    (lambda h, a: h.update(steps=h["steps"] + 1), "but the loss array has shape"),
    (lambda h, a: h.update(optimizer="adam"), "header optimizer 'adam' is none of adamw, sgd"),
    (lambda h, a: h.update(precision="fp16"), "header precision 'fp16' is none of"),
]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> list[dict]:
    """`golden check` of each bad input, then of each broken record, all in one process
    (cli_calls.py: one torch import for all)."""
    argvs = [["golden", "check", *args] for args, _ in BAD_INPUT]
    for i, (edit, _) in enumerate(BROKEN):
        bad = _broken(tmp_path_factory.mktemp(f"broken{i}"), edit)
        argvs.append(["golden", "check", "examples/mlp.par", str(bad)])
    return cli(*argvs)


@pytest.mark.parametrize("i", range(len(BAD_INPUT)), ids=[n for _, n in BAD_INPUT])
def test_check_bad_input_exit_2(checks, i):
    r, needle = checks[i], BAD_INPUT[i][1]
    assert r["rc"] == 2, r
    assert needle in r["stderr"] and "Traceback" not in r["text"], r
    assert len(r["stderr"].strip().splitlines()) == 1, r


@pytest.mark.parametrize("i", range(len(BROKEN)), ids=[n for _, n in BROKEN])
def test_check_broken_record_exit_2(checks, i):
    """A record whose header lacks a key, names a setting soapstone does not train with, or
    whose arrays disagree with its steps: one line on stderr, exit 2, no traceback."""
    r, needle = checks[len(BAD_INPUT) + i], BROKEN[i][1]
    assert r["rc"] == 2, r
    assert needle in r["stderr"] and "Traceback" not in r["text"], r
    assert len(r["stderr"].strip().splitlines()) == 1, r
