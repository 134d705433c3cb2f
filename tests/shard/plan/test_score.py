"""Any layout scored (shard/plan/analysis/score.py): `explain --profile` and `plan` print the
predicted step time, model TFLOP/s per device, MFU and tokens/s. Each figure against a hand
computation from the model's shapes and the predicted step; no timings."""

from __future__ import annotations

import json

import pytest
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.plan.analysis.cost import StepTime
from soapstone.shard.plan.analysis.hardware import load_profile
from soapstone.shard.plan.analysis.score import Score, model_flops, score, tokens_per_step

EXPLAIN = ["-m", "soapstone.dsl.cli", "explain"]


def test_the_rates_follow_from_the_step_by_hand():
    # 8 TFLOP a step over 4 devices in 2 s: 1 TFLOP/s each, a quarter of a 4 TFLOP/s peak;
    # 4096 tokens in 2 s
    s = Score(2.0, 8e12, 4096, 4, 4e12, "p", "bf16")
    assert s.tflops_per_device == pytest.approx(1.0)
    assert s.mfu == pytest.approx(0.25)
    assert s.tokens_per_s == pytest.approx(2048.0)
    assert s.to_data()["mfu"] == pytest.approx(0.25)


def test_model_flops_and_tokens_are_runs():
    mlp = lower(dsl.load("examples/mlp.par").model(), None)
    # two linears, forward 2 x batch x features x ffn + 2 x batch x ffn x classes, x 3
    assert model_flops(mlp) == 3 * (2 * 8 * 32 * 64 + 2 * 8 * 64 * 8)
    assert model_flops(mlp, accumulate=2) == 2 * model_flops(mlp)
    assert tokens_per_step(mlp) == 8  # its labels: one per sample
    gpt = lower(dsl.load("examples/gpt.par").model(), None)
    sizes = dict(gpt.dims)
    assert tokens_per_step(gpt) == sizes["batch"] * sizes["seq"]  # the targets
    t = StepTime(0.5, 0.4, 0, 0, 0, 0, 0.1)
    prof = load_profile("a100-80gb")
    s = score(t, gpt, 2, prof, "bf16")
    assert s.tflops_per_device == pytest.approx(model_flops(gpt) / 2 / 0.5 / 1e12)
    assert s.mfu == pytest.approx(model_flops(gpt) / 2 / 0.5 / 312e12)


def test_explain_profile_prints_and_carries_the_score():
    args = [*EXPLAIN, "examples/gpt.par", "--parallel", "dp2tp2", "--profile", "a100-80gb",
            "--precision", "bf16"]
    data = json.loads(run_mpi(1, [*args, "--json"], check=True).stdout)
    s, t = data["score"], data["time"]
    assert s["step_s"] == t["total"] > 0 and s["devices"] == 4
    gpt = lower(dsl.load("examples/gpt.par").model(), None)
    assert s["model_flops"] == model_flops(gpt)
    assert s["tflops_per_device"] == pytest.approx(s["model_flops"] / 4 / s["step_s"] / 1e12)
    assert s["mfu"] == pytest.approx(s["tflops_per_device"] * 1e12 / 312e12)
    assert s["tokens_per_s"] == pytest.approx(tokens_per_step(gpt) / s["step_s"])
    out = run_mpi(1, args, check=True).stdout
    assert "predicted on 4 x a100-80gb (bf16): step" in out and "MFU" in out, out
    assert "  step time: compute" in out, out


def test_a_profile_without_the_precisions_peak_is_exit_2(tmp_path):
    prof = load_profile("a100-80gb").to_data()
    prof["peak_tflops"] = {"fp32": 19.5}
    path = tmp_path / "fp32only.json"
    path.write_text(json.dumps(prof))
    r = run_mpi(1, [*EXPLAIN, "examples/gpt.par", "--parallel", "tp2", "--profile",
                    str(path), "--precision", "bf16"])
    assert r.returncode == 2 and "no peak_tflops for 'bf16'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_plan_rows_carry_the_same_rates():
    r = run_mpi(1, ["-m", "soapstone.dsl.cli", "plan", "examples/gpt.par", "--world", "4",
                    "--profile", "a100-80gb", "--precision", "bf16", "--top", "3", "--json"],
                check=True)
    data = json.loads(r.stdout)
    gpt = lower(dsl.load("examples/gpt.par").model(), None)
    for row in data["ranked"]:
        step = row["step_time_s"]
        assert row["tflops_per_device"] == pytest.approx(model_flops(gpt) / 4 / step / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] * 1e12 / 312e12)
        assert row["tokens_per_s"] == pytest.approx(tokens_per_step(gpt) / step)
    r = run_mpi(1, ["-m", "soapstone.dsl.cli", "plan", "examples/gpt.par", "--world", "4",
                    "--profile", "a100-80gb", "--top", "3"], check=True)
    assert "TFLOP/s/dev  MFU" in r.stdout and "tokens/s" in r.stdout, r.stdout
