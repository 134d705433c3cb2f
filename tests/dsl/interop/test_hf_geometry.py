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

ROOT = Path(__file__).resolve().parents[3]
LLAMA3_8B = {"vocab": 128256, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
GPT2_124M = {"vocab": 50304, "classes": 50257, "hidden": 768, "heads": 12, "ffn": 3072,
             "max_seq": 1024}
LLAMA3_PARAMS = 8_030_261_248


def _flags(dims: dict[str, int]) -> list[str]:
    return [x for d, n in dims.items() for x in ("--dim", f"{d}={n}")]


QWEN3_06B = {"vocab": 151936, "hidden": 1024, "heads": 16, "kv_heads": 8, "ffn": 3072}
QWEN3_PARAMS = 596_049_920
# llama.par as each model: (its attention's arguments, its rmsnorm, blocks, tied head)
AS = {"llama3_8b": ("rope = 500000.0, rope_factor = 8.0, rope_low_freq = 1.0, rope_high_freq"
                    " = 4.0, rope_original_max = 8192,", "rmsnorm(x, eps = 1e-05)", 32, False),
      "qwen3_06b": ("rope = 1000000.0, qk_norm = 1e-06, head_dim = 128,", "rmsnorm(x)", 28,
                    True)}


def _as(name: str, tmp_path: Path) -> Path:
    """examples/llama.par written as `name` (AS): the pipelines' stages half the blocks each."""
    attention, norm, blocks, tied = AS[name]
    half = blocks // 2
    text = (ROOT / "examples/llama.par").read_text().replace("rope = 10000.0,", attention) \
        .replace("rmsnorm(x)", norm).replace("repeat 2 as layer", f"repeat {blocks} as layer") \
        .replace("layer[0] -> pipe 0, layer[1] -> pipe 1",
                 f"layer[0..{half - 1}] -> pipe 0, layer[{half}..{blocks - 1}] -> pipe 1")
    if tied:
        text = text.replace("  output loss", "  tie linear0.weight = embedding0.table\n"
                            "  output loss")
    path = tmp_path / f"{name}.par"
    path.write_text(text)
    return path


def test_llama3_8b_and_qwen3_06b_take_every_layout_at_full_depth(tmp_path):
    llama, qwen = _as("llama3_8b", tmp_path), _as("qwen3_06b", tmp_path)
    names = list(dsl.load(ROOT / "examples/llama.par").parallels)
    runs = cli(["check", str(llama), *_flags(LLAMA3_8B)],
               ["check", str(qwen), *_flags(QWEN3_06B)],
               ["explain", str(qwen), "--parallel", "single", *_flags(QWEN3_06B), "--json"],
               *[["explain", str(llama), "--parallel", n, *_flags(LLAMA3_8B), "--json"]
                 for n in names])
    for r in runs[:2]:
        assert r["rc"] == 0 and "note:" not in r["text"], r["text"]
        assert f"parallels: {', '.join(names)}" in r["text"]
    per_rank = {}
    for name, r in zip(["qwen3", *names], runs[2:], strict=True):
        assert r["rc"] == 0, (name, r["text"])
        data, _ = json.JSONDecoder().raw_decode(r["text"][r["text"].index("{"):])
        per_rank[name] = data["param_bytes"]
    assert per_rank["qwen3"] == 4 * QWEN3_PARAMS  # 16 heads x 128 beside hidden 1024
    assert per_rank["single"] == 4 * LLAMA3_PARAMS
    norms = (2 * 32 + 1) * 4096  # whole on every rank; every matrix split in two
    assert per_rank["tp2"] == 4 * ((LLAMA3_PARAMS - norms) // 2 + norms)
    assert per_rank["ptd8"] < per_rank["tp4"] < per_rank["tp2"]


def test_gpt2_124m_widths_load_into_tp2_with_transformers_loss(tmp_path):
    from transformers.initialization import no_init_weights

    with no_init_weights():  # build draws every weight itself: transformers' draw is wasted
        ref = hf_models.build("gpt2", vocab_size=50257, n_positions=1024, n_embd=768,
                              n_head=12)
    d = tmp_path / "gpt2"
    ref.tie_weights()  # the head is the table again (the skipped init made it its own)
    ref.save_pretrained(d)
    del ref
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", "examples/gpt2.par", "--parallel", "tp2",
                    *_flags(GPT2_124M), "--init", f"hf:{d}", "--steps", "1", "--optimizer",
                    "sgd", "--quiet", "--metrics", str(metrics)], timeout=300)
    assert r.ok, r.report()
    model = dsl.load(ROOT / "examples/gpt2.par", dims=GPT2_124M).model("gpt2")
    batch = make_task(lower(model, None), 0).batch(0)
    with torch.no_grad():
        logits = hf_models.load(d)(input_ids=batch["tokens"]).logits  # buffers made whole
    want = F.cross_entropy(logits.reshape(-1, 50257), batch["targets"].reshape(-1))
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(float(want), rel=1e-5)
