"""Attention dropout (`attention(..., dropout = P)`) and the dropout masks in a real step: the
layer Korthikanti et al. count (tests/specs/korthikanti_gpt.par at toy sizes) trains the same
whole and split over heads or sequence (the masks are drawn for the global tensor), and
autograd keeps what explain counts for it: the [heads, seq, seq] probabilities unfused, and
each dropout's mask as bools, one byte an element (tests/shard/plan/test_korthikanti.py
checks explain against the paper's formulas)."""

from __future__ import annotations

import json
import subprocess
import sys

from mpirun import run_mpi

SPEC = "tests/specs/korthikanti_gpt.par"
DIMS = ["--dim", "batch=2", "--dim", "seq=64", "--dim", "hidden=64", "--dim", "heads=8",
        "--dim", "ffn=256", "--dim", "vocab=128"]
GOLDEN = ["-m", "soapstone.dsl.cli", "golden"]


def test_attention_dropout_trains_alike_under_tensor_and_sequence_parallel(tmp_path):
    record = tmp_path / "kgpt.npz"
    run_mpi(1, [*GOLDEN, "record", SPEC, "--model", "kgpt", "-o", str(record), "--steps", "3",
                *DIMS], check=True, timeout=300)
    for layout in ("tp2", "sp2"):
        r = run_mpi(2, [*GOLDEN, "check", SPEC, str(record), "--parallel", layout],
                    timeout=300)
        assert r.ok, r.report()


def test_a_step_keeps_what_explain_counts_with_one_byte_masks(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--spec", SPEC, "--parallel",
                        "none", *DIMS, "--precision", "bf16", "--json", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())[0]
    # a float copy of each mask would be +2 bytes an element of 3 [batch, seq, hidden] and
    # [batch, heads, seq, seq] tensors a layer: well beyond 2%
    assert abs(row["saved_error"]) < 0.02, r.stdout
