"""MFU in `run` (dsl/app/throughput.py): model FLOPs from the cost model's count, the peak from
--profile or a GPU's name, the figures in the progress line, the done line and the metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from soapstone import dsl
from soapstone.dsl.app.throughput import find_peak, preset_for_gpu, step_flops
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.lang.errors import BadInput
from soapstone.shard.plan.analysis.cost import program_work

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name,preset", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA GeForce RTX 4090", None)])
def test_a_gpus_name_picks_its_preset(name, preset):
    assert preset_for_gpu(name) == preset


def test_peak_from_the_profile_else_the_gpu_else_none():
    assert find_peak("cpu-2core", "fp32", None).flops == pytest.approx(0.082e12)
    peak = find_peak(None, "bf16", "NVIDIA H100 80GB HBM3")
    assert peak.flops == pytest.approx(989e12) and "h100-80gb" in peak.source
    assert find_peak(None, "bf16", None) is None
    with pytest.raises(BadInput, match="no peak_tflops for --precision fp64"):
        find_peak("h200", "fp64", None)
    # float8: MFU over the bf16 peak, on a profile that has an fp8 one (the A100 has none)
    assert find_peak("h100-80gb", "float8", None).flops == pytest.approx(989e12)
    with pytest.raises(BadInput, match="--precision float8 .it needs fp8"):
        find_peak("a100-80gb", "float8", None)


def test_step_flops_is_three_forwards_of_the_whole_model():
    model = dsl.load(ROOT / "examples/gpt.par").model()
    whole = lower(model, None)
    assert step_flops(whole) == 3 * program_work(whole).matmul_flops
    assert step_flops(whole, accumulate=4) == 4 * step_flops(whole)


def test_run_prints_tflops_and_mfu_with_a_profile(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "run", "examples/gpt.par",
                        "--steps", "5", "--profile", "cpu-2core", "--metrics", str(metrics)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "peak 0.082 TFLOP/s fp32 per device (--profile cpu-2core)" in r.stderr, r.stderr
    assert "TFLOP/s/dev, MFU " in r.stderr and "TFLOP/s per device, MFU " in r.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(0 < row["mfu"] and row["tflops_per_device"] > 0 for row in rows)
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "run", "examples/gpt.par",
                        "--steps", "1", "--profile", "nope"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "unknown profile 'nope'" in r.stderr, r.stderr
