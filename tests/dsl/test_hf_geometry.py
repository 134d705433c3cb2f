"""Real geometry from the examples (issue 28), one representative case of each kind; the
whole table, every layout at full depth and every layout loaded, is bench/bench_geometry.py.

- LLaMA-3-8B (vocab 128256, hidden 4096, 32 heads, 8 kv heads, ffn 14336, rope_theta 500000
  with llama3 scaling, rms_norm_eps 1e-5) at its full 32 blocks: examples/llama.par written
  with those values takes every layout it declares (`check`), and `explain` of each counts
  LLaMA-3-8B's 8,030,261,248 parameters.
- Qwen3-0.6B (vocab 151936, hidden 1024, 16 heads of head_dim 128, 8 kv heads, ffn 3072, q/k
  norms, tied head) at 28 blocks takes every layout: 596,049,920 parameters (0.44e9 without
  the embedding, as Qwen publishes).
- GPT-2 124M's widths (vocab 50257 padded to 50304, hidden 768, 12 heads, ffn 3072, 1024
  positions) at the example's 2 blocks: transformers' weights load into tp2, which splits the
  padded vocab, and its first loss is transformers' (rel 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import pytest
import torch
import torch.nn.functional as F
from cli_calls import cli
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.data.source import make_task

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = {"vocab": 128256, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
GPT2_124M = {"vocab": 50304, "classes": 50257, "hidden": 768, "heads": 12, "ffn": 3072,
             "max_seq": 1024}
LLAMA3_PARAMS = 8_030_261_248


def _flags(dims: dict[str, int]) -> list[str]:
    return [x for d, n in dims.items() for x in ("--dim", f"{d}={n}")]


def _llama3_32(tmp_path: Path) -> Path:
    """llama.par as a LLaMA-3-8B: its rope and eps, 32 blocks, the pipelines 16 + 16."""
    text = (ROOT / "examples/llama.par").read_text().replace(
        "rope = 10000.0", "rope = 500000.0, rope_factor = 8.0, rope_low_freq = 1.0, "
        "rope_high_freq = 4.0, rope_original_max = 8192").replace(
        "rmsnorm(x)", "rmsnorm(x, eps = 1e-05)").replace(
        "repeat 2 as layer", "repeat 32 as layer").replace(
        "layer[0] -> pipe 0, layer[1] -> pipe 1", "layer[0..15] -> pipe 0, layer[16..31] -> pipe 1")
    path = tmp_path / "llama3_8b.par"
    path.write_text(text)
    return path


def test_llama3_8b_takes_every_layout_at_32_blocks(tmp_path):
    path = _llama3_32(tmp_path)
    names = list(dsl.load(ROOT / "examples/llama.par").parallels)
    runs = cli(["check", str(path), *_flags(LLAMA3_8B)],
               *[["explain", str(path), "--parallel", n, *_flags(LLAMA3_8B), "--json"]
                 for n in names])
    assert runs[0]["rc"] == 0 and "note:" not in runs[0]["text"], runs[0]["text"]
    assert f"parallels: {', '.join(names)}" in runs[0]["text"]
    per_rank = {}
    for name, r in zip(names, runs[1:], strict=True):
        assert r["rc"] == 0, (name, r["text"])
        data, _ = json.JSONDecoder().raw_decode(r["text"][r["text"].index("{"):])
        per_rank[name] = data["param_bytes"]
    assert per_rank["single"] == 4 * LLAMA3_PARAMS
    norms = (2 * 32 + 1) * 4096  # whole on every rank; every matrix split in two
    assert per_rank["tp2"] == 4 * ((LLAMA3_PARAMS - norms) // 2 + norms)
    assert per_rank["ptd8"] < per_rank["tp4"] < per_rank["tp2"]


def test_qwen3_06b_head_dim_128_beside_hidden_1024_takes_every_layout(tmp_path):
    text = (ROOT / "examples/llama.par").read_text().replace(
        "rope = 10000.0,", "rope = 1000000.0, qk_norm = 1e-06, head_dim = 128,").replace(
        "repeat 2 as layer", "repeat 28 as layer").replace(
        "layer[0] -> pipe 0, layer[1] -> pipe 1", "layer[0..13] -> pipe 0, layer[14..27] -> pipe 1"
    ).replace("  output loss", "  tie linear0.weight = embedding0.table\n  output loss")
    path = tmp_path / "qwen3_06b.par"
    path.write_text(text)
    dims = _flags({"vocab": 151936, "hidden": 1024, "heads": 16, "kv_heads": 8, "ffn": 3072})
    check, explain = cli(["check", str(path), *dims],
                         ["explain", str(path), "--parallel", "single", *dims, "--json"])
    assert check["rc"] == 0 and "note:" not in check["text"], check["text"]
    data, _ = json.JSONDecoder().raw_decode(explain["text"][explain["text"].index("{"):])
    assert data["param_bytes"] == 4 * 596_049_920


def test_gpt2_124m_widths_load_into_tp2_with_transformers_loss(tmp_path):
    d = hf_models.save("gpt2", tmp_path / "gpt2", vocab_size=50257, n_positions=1024,
                       n_embd=768, n_head=12)
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", "examples/gpt2.par", "--parallel", "tp2",
                    *_flags(GPT2_124M), "--init", f"hf:{d}", "--steps", "1", "--optimizer",
                    "sgd", "--quiet", "--metrics", str(metrics)], timeout=300)
    assert r.ok, r.report()
    model = dsl.load(ROOT / "examples/gpt2.par", dims=GPT2_124M).model("gpt2")
    batch = make_task(lower(model, None), 0).batch(0)
    with torch.no_grad():
        logits = hf_models.load(d)(input_ids=batch["tokens"]).logits
    want = F.cross_entropy(logits.reshape(-1, 50257), batch["targets"].reshape(-1))
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(float(want), rel=1e-5)
