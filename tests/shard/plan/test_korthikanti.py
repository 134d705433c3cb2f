"""explain's activation bytes per transformer layer against Korthikanti et al.'s formulas
(arXiv:2205.05198, Table 2; bench/data/korthikanti_activations.json), evaluated here by hand at
the paper's 22B geometry (its Table 3: s 2048, b 4, h 6144, a 64, t 8) under --precision bf16, on
tests/specs/korthikanti_gpt.par (pre-norm layer, gelu MLP, dropout on each residual branch
and, where the paper keeps the attention core, on the attention probabilities). Torch-free.

What soapstone keeps beyond the formulas, by hand:
- the causal mask's bool [seq, seq] (s^2 bytes) where attention runs unfused, and each
  layernorm's per-row mean and 1/std (2 x 2sb bytes each).
Under sequence parallelism the QKV and MLP first linears keep their inputs' 2sbh/t shards and
gather them again in backward, as Megatron does (shard/parallel/regather_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.activations import activation_figures
from soapstone.shard.plan.analysis.precision import program_as_run

SPEC = "tests/specs/korthikanti_gpt.par"
S, B, H, A, T = 2048, 4, 6144, 64, 8
SBH = S * B * H
NORMS = 2 * 2 * (2 * S * B)  # two layernorms' mean and 1/std, bf16, per row
MASK = S * S  # the unfused causal mask, one byte per (query, key)


def per_layer(layout: str) -> int:
    """explain's bytes for one layer: 2 layers' activations less 1 layer's."""
    got = []
    for layers in (1, 2):
        spec = dsl.load(SPEC, dims={"layers": layers, "batch": B})
        par = spec.parallel(layout)
        program = lower_graph(spec.model(par.model), par).stages[0].program
        got.append(activation_figures(program_as_run(program, "bf16"))[0])
    return got[1] - got[0]


def close(got: int, want: float, within: float = 0.10) -> bool:
    return abs(got / want - 1) <= within


def test_no_parallelism_keeps_34sbh_and_5as2b():
    want = SBH * 34 + 5 * A * S * S * B  # sbh(34 + 5as/h)
    got = per_layer("none")
    assert got == want + MASK + NORMS
    assert close(got, want, 0.01)


def test_tensor_parallel_splits_24sbh_and_the_attention_core():
    want = SBH * 10 + SBH * 24 // T + 5 * A * S * S * B // T  # sbh(10 + 24/t + 5as/(ht))
    got = per_layer("tp")
    assert got == want + MASK + NORMS
    assert close(got, want, 0.02)


def test_sequence_parallel_keeps_the_linear_inputs_as_shards():
    want = (SBH * 34 + 5 * A * S * S * B) // T  # sbh/t (34 + 5as/h)
    got = per_layer("tp_sp")
    assert got == want + MASK + NORMS // T
    assert close(got, want, 0.02)


def test_selective_is_the_fused_attention_kernel():
    want = SBH * 10 + SBH * 24 // T  # sbh(10 + 24/t): no [heads, seq, seq] tensor kept
    lse = 4 * A // T * S * B  # the fused kernel's fp32 log-sum-exp per head and row
    assert per_layer("tp_selective") == want + NORMS + lse
    want = SBH * 34 // T  # sbh(34/t)
    assert per_layer("tp_sp_selective") == want + NORMS // T + lse
    assert close(want + NORMS // T + lse, want, 0.01)


def test_full_recompute_keeps_the_layer_input():
    assert per_layer("tp_full") == 2 * SBH  # 2sbh
    assert per_layer("tp_sp_full") == 2 * SBH // T  # its input split by the sequence


def test_the_data_file_rows_are_the_formulas():
    data = json.loads(Path("bench/data/korthikanti_activations.json").read_text())
    assert "2205.05198" in data["source"]
    table3 = {g["name"]: (g["a"], g["h"], g["L"], g["s"], g["b"], g["t"], g["p"])
              for g in data["geometries"]}  # heads, hidden, layers, seq, microbatch, t, p
    assert table3 == {"22B": (64, 6144, 48, 2048, 4, 8, 1),
                      "175B": (96, 12288, 96, 2048, 1, 8, 8),
                      "530B": (128, 20480, 105, 2048, 1, 8, 35),
                      "1T": (160, 25600, 128, 2048, 1, 8, 64)}
    rows = {(r["geometry"], r["technique"]): r["bytes_per_layer"] for r in data["rows"]}
    assert rows[("22B", "none")] == SBH * 34 + 5 * A * S * S * B
    assert rows[("22B", "tp_sp_selective")] == SBH * 34 // T
    # 1T: s 2048, b 1, h 25600, a 160, t 8: sbh(10 + 24/t + 5as/(ht))
    s, h, a, t = 2048, 25600, 160, 8
    assert rows[("1T", "tp")] == s * h * 10 + s * h * 24 // t + 5 * a * s * s // t
