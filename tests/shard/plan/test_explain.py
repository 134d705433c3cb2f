"""`soapstone explain`: the estimates agree with a real step (cases in
tests/shard/train/run_cases.py: communication bytes equal the comm layer's counters per axis and
collective; param/grad/optimizer memory within 10% of the measured tensors), and the CLI."""

from __future__ import annotations

import json

import pytest
from mpirun import case_names, case_params, run_mpi

from soapstone.shard.plan.schedules import build

CASES = "tests/shard/train/run_cases.py"
CLI = ["-m", "soapstone.dsl.cli", "explain"]


# the explain cases of the run cases (test_golden.py takes the rest): one launch per size for both
EXPLAIN = [c for c in case_names(CASES) if c.startswith("case_explain_")]


@pytest.mark.parametrize("case,n", case_params(CASES, EXPLAIN))
def test_explain_matches_a_real_step(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_bubble_formula():
    assert build("1f1b", 1, 8).theory_bubble() == 0.0
    assert build("gpipe", 2, 4).theory_bubble() == pytest.approx(1 / 5)
    assert build("1f1b", 4, 8).theory_bubble() == pytest.approx(3 / 11)


def test_explain_table_and_json():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "dp2tp2"], check=True)
    for needle in ("params", "optimizer", "activations", "grad sync  allreduce       [data]",
                   "total", "bubble 0.000"):
        assert needle in r.stdout, r.stdout
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "tp2", "--json"], check=True)
    data = json.loads(r.stdout)
    assert data["optimizer_bytes"] == 2 * data["grad_bytes"]  # AdamW: 2 x fp32 per param
    assert data["bubble"] == 0.0 and data["imbalance"] == 1.0
    assert data["comm_bytes_per_axis"]["model"] > 0


def test_explain_pipeline_layout_per_stage():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "gpt8", "--json"], check=True)
    data = json.loads(r.stdout)
    assert data["stages"] == 2 and data["bubble"] == pytest.approx(1 / 5)
    ranks = data["pipe_ranks"]
    assert [r["pipe_rank"] for r in ranks] == [0, 1]
    # 1F1B: pipe rank s holds p - s microbatches' activations
    assert ranks[0]["microbatches_in_flight"] == {"0": 2}
    assert ranks[1]["microbatches_in_flight"] == {"1": 1}
    assert ranks[0]["activation_bytes"] == 2 * ranks[0]["activation_bytes_per_microbatch"]["0"]
    # one edge, [1, 8, 32] f32 = 1 KiB per microbatch, 4 microbatches, both directions
    assert data["edges"] == [{"src": 0, "dst": 1, "src_rank": 0, "dst_rank": 1,
                              "activation_bytes": 4096, "gradient_bytes": 4096}]
    assert data["comm_bytes_per_axis"]["pipe"] == 4096 + 8 + 8  # p2p + norm + loss
    r = run_mpi(1, [*CLI, "tests/specs/pipe_layouts.par", "--parallel", "pp2inter"],
                check=True)
    assert "bubble 0.111 = (p-1)/(v*m+p-1)" in r.stdout, r.stdout
    assert "edge 2 -> 3  p2p per step" in r.stdout and "in flight" in r.stdout


def test_explain_unknown_layout_exit_2():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "tp3"])
    assert r.returncode == 2 and "no parallel block named 'tp3'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
