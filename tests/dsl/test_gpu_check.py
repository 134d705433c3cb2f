"""`soapstone gpu-check` and `make gpu-check` on a machine without CUDA: exit 2 with one line
that says why and where to run it, before anything is installed or run. What they do on a GPU
(dsl/app/gpu_check.py) needs one: it ran on an H100 (BENCHMARKS.md, "On a GPU"), not here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_gpu_check_without_cuda_is_exit_2_and_one_line(tmp_path):
    report = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "gpu-check", "--report",
                        str(report)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("soapstone gpu-check: no CUDA GPU here (torch "), r.stderr
    assert "make gpu-check" in r.stderr and not report.exists()


def test_gpu_check_bad_flags_are_exit_2():
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "gpu-check", "--steps", "5"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--steps 5: give at least 30" in r.stderr, r.stderr


def test_make_gpu_check_without_cuda_is_exit_2_before_installing(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={sys.executable}",
                        f"GPU_VENV={venv}", f"WHEELS={tmp_path / 'none'}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "make gpu-check: no CUDA GPU here" in r.stderr, r.stderr
    assert not venv.exists()


def test_the_one_rank_communicator_checks_run_over_mpi():
    """gpu-check's communicator checks hold nothing NCCL-specific but the events: over the MPI
    world (one rank, CPU) every one passes, so on a GPU a failure is NCCL's."""
    from soapstone.comm import init
    from soapstone.dsl.app.gpu_probe import nccl_one_rank

    outcomes = nccl_one_rank(init("mpi"))
    assert [o.name for o in outcomes] == ["nccl: collectives", "nccl: p2p to self",
                                          "nccl: groups", "nccl: events"]
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]


def test_step_time_comparison_runs_on_the_cpu_at_small_dims(tmp_path):
    """The side-by-side step of gpu-check at toy dims on the CPU: both sides train the same
    weights (first losses agree to bf16's precision), the figures and the verdict come out."""
    from soapstone.dsl.app.gpu_probe import step_time
    from soapstone.dsl.app.throughput import Peak

    dims = {"batch": 2, "seq": 32, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64}
    fig = step_time(ROOT, tmp_path, 30, Peak(1e12, "test"), torch.device("cpu"), dims)
    rows = fig["rows"]
    assert set(rows) == {"soapstone", "plain torch (nanoGPT-style)"}
    first = [r["first_loss"] for r in rows.values()]
    assert abs(first[0] - first[1]) < 0.05 * abs(first[1]), first
    for r in rows.values():
        assert r["steps"] == 30 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert fig["ratio"]["verdict"] in ("faster", "slower", "tie")
    assert "examples/gpt.par x6 blocks" in fig["model"], fig["model"]


def test_the_shared_gpu_layouts_name_real_layouts_and_records():
    """gpu-check's two-ranks-on-one-GPU layouts and its training runs' layouts exist in their
    examples, the former with a golden record."""
    from soapstone.dsl.app.gpu_check import SHARED_LAYOUTS, TRAINING

    kinds = set()
    for example, layout in SHARED_LAYOUTS:
        spec = (ROOT / f"examples/{example}.par").read_text()
        assert f"parallel {layout} for " in spec
        assert (ROOT / f"tests/golden/runs/{example}.npz").exists()
        kinds.add(layout[:2])
    assert kinds == {"tp", "pp", "dp", "ep", "cp", "sp"}
    gpt = (ROOT / "examples/gpt.par").read_text()
    assert all(f"parallel {layout} for gpt" in gpt for _, layout, _ in TRAINING)
    assert {p for p, _, _ in TRAINING} == {"bf16", "float8"}
