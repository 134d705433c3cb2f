"""`soapstone run` end to end: training under mpiexec and without it, the synthetic task,
--data and --metrics, and every bad input giving one clear line and exit 2 (no traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.data.source import make_task
from soapstone.shard.data.tasks import SyntheticTask

ROOT = Path(__file__).resolve().parents[3]
CLI = ["-m", "soapstone.dsl.cli"]


def soapstone(n: int, *args: str, timeout: float = 120):
    return run_mpi(n, [*CLI, *args], timeout=timeout)


def losses(text: str) -> tuple[float, float]:
    m = re.search(r"done: \d+ steps, loss ([\d.]+) -> ([\d.]+)", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_loss_falls_under_mpiexec(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = soapstone(2, "run", "examples/gpt.par", "--parallel", "tp2", "--steps", "40",
                  "--metrics", str(metrics))
    assert r.ok, r.report()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(40))
    assert set(rows[0]) == {"step", "loss", "lr", "step_time_s", "tokens_per_s", "max_rss_bytes",
                            "tflops_per_device", "mfu"}
    assert all(row["tflops_per_device"] > 0 and row["mfu"] is None for row in rows)  # no peak
    assert all(row["tokens_per_s"] > 0 and row["max_rss_bytes"] > 0 for row in rows)
    first, last = rows[0]["loss"], np.mean([row["loss"] for row in rows[-5:]])
    assert last < 0.6 * first, (first, last)
    assert r.stdout.count("done:") == 1  # rank 0 only
    assert "Traceback" not in r.stdout + r.stderr


def test_pipeline_layout_trains_and_traces(tmp_path):
    """A pipeline layout (2 stages, 1F1B, 8 microbatches) runs through `soapstone run`:
    metrics per step, loss falling, --trace writes the Chrome trace and prints the bubble."""
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    r = soapstone(2, "run", "tests/specs/pipe_layouts.par", "--parallel", "pp2f1b",
                  "--steps", "12", "--metrics", str(metrics), "--trace", str(trace))
    assert r.ok, r.report()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(12))
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], rows
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {f"F{i}" for i in range(8)} <= names and {f"B{i}" for i in range(8)} <= names
    m = re.search(r"bubble: measured ([\d.]+)% of the last step, theory ([\d.]+)% \(1f1b",
                  r.stdout)
    assert m and float(m.group(2)) == pytest.approx(100 / 9, abs=0.05), r.stdout
    assert "trace: " in r.stdout and r.stdout.count("bubble:") == 1
    assert "Traceback" not in r.stdout + r.stderr


def test_run_without_mpiexec_learns_the_classifier():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, *CLI, "run", "examples/mlp.par", "--steps", "60",
                        "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    first, last = losses(p.stdout)
    assert last < 0.7 * first


def test_data_file_npy(tmp_path):
    ids = np.arange(2000, dtype=np.int32) % 64
    np.save(tmp_path / "tok.npy", ids)
    r = soapstone(1, "run", "examples/gpt.par", "--steps", "3", "--data", str(tmp_path / "tok.npy"))
    assert r.ok, r.report()


def one_line_error(r, *needles: str) -> None:
    assert r.returncode == 2, r.report()
    assert not r.timed_out
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


@pytest.mark.parametrize("args,needles", [
    (["--data", "no/such/file.bin"], ["--data no/such/file.bin: no such file"]),
    (["--data", "README.md"], ["does not fit the vocab of 64", "--dim vocab="]),
    (["--parallel", "nope"], ["no parallel block named 'nope'", "parallel blocks: single"]),
    (["--steps", "0"], ["--steps 0"]),
    (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    (["--parallel", "gpt8"], ["layout 'gpt8'", "needs 8 ranks", "mpiexec -n 8"]),
    (["--parallel", "single", "--trace", "t.json"], ["--trace t.json: only pipeline layouts"]),
    (["--dim", "vocab=x"], ["--dim 'vocab=x'"]),
    (["--weight-decay", "nan"], ["--weight-decay nan: give a number >= 0"]),
    (["--weight-decay", "inf"], ["--weight-decay inf: give a number >= 0"]),
    (["--weight-decay", "-0.1"], ["--weight-decay -0.1: give a number >= 0"]),
    (["--lr", "nan"], ["--lr nan: the learning rate must be a positive number"]),
    (["--grad-clip", "inf"], ["--grad-clip inf: must be a positive number"]),
    (["--metrics", "tests"], ["--metrics tests: is a directory", "tests/metrics.jsonl"]),
])
def test_bad_input_exit_2(args, needles):
    r = soapstone(1, "run", "examples/gpt.par", "--steps", "2", *args, timeout=60)
    one_line_error(r, *needles)
    if args[0] in ("--data", "--steps"):
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_two_dimensional_npy_is_bad_data(tmp_path):
    """README: a .npy of token ids is one-dimensional; a 2-D one is refused, not flattened."""
    np.save(tmp_path / "rows.npy", np.zeros((16, 100), dtype=np.int32))
    r = soapstone(1, "run", "examples/gpt.par", "--steps", "1", "--data",
                  str(tmp_path / "rows.npy"), timeout=60)
    one_line_error(r, "token ids are one-dimensional", "shape (16, 100)", "reshape(-1)")


def test_wrong_world_size_exits_2_on_every_rank():
    r = soapstone(2, "run", "examples/gpt.par", "--parallel", "dp2tp2", "--steps", "2",
                  timeout=60)
    one_line_error(r, "needs 4 ranks, but this run has 2", "mpiexec -n 4")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # rank 0 alone prints it


def test_synthetic_task_is_layout_independent_and_seeded():
    s = dsl.load(ROOT / "examples/gpt.par")
    single = SyntheticTask(lower(s.model(), None), seed=3)
    tp = SyntheticTask(lower(s.model(), s.parallel("dp2tp2")), seed=3)
    a, b = single.batch(5), tp.batch(5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["targets"][:, :-1], a["tokens"][:, 1:])  # next-token targets
    assert not torch.equal(a["tokens"], SyntheticTask(lower(s.model(), None), 4)
                           .batch(5)["tokens"])
    assert not torch.equal(a["tokens"], single.batch(6)["tokens"])


def test_token_file_windows(tmp_path):
    s = dsl.load(ROOT / "examples/gpt.par")
    (tmp_path / "t.txt").write_bytes(bytes(range(60)) * 50)
    task = make_task(lower(s.model(), None), 0, str(tmp_path / "t.txt"))
    b = task.batch(0)
    assert b["tokens"].shape == (8, 16) and int(b["tokens"].max()) < 60
    assert torch.equal(b["targets"][:, :-1], b["tokens"][:, 1:])
