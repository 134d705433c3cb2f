"""The cost model against published runs: each row of bench/data/megatron_sc21_table1.json
(Megatron-LM PTD-P, SC'21 Table 1: GPT 1.7B..1T on A100 80GB, sequence 2048, vocab 51200,
full recompute) scored by `plan`'s cost model at the row's own layout, beside what was
published.

The layout: the row's tensor and pipeline degrees, data parallel for the rest, 1F1B with
microbatches of one sample (Megatron's setting for these runs), ZeRO 0, `recompute layer`
(full recompute), bf16 (the A100's 16-bit peak: the paper ran fp16 at the same rate). The
predicted figures are the cost model's step time on the a100-80gb profile and explain's
memory for the fullest device.

Published TFLOP/s count the paper's F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration
(forward, backward and the recompute forward's GEMMs), so the comparison is made in that
convention: predicted TFLOP/s = F / (predicted step x GPUs); the published step is
F / (published TFLOP/s x GPUs). Beside them: the model TFLOP/s per device and MFU as `run`
and `explain --profile` count them (no recompute: 3/4 of F's layer terms).

    .venv/bin/python bench/bench_plan_published.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench/data/megatron_sc21_table1.json"


def spec_text(row: dict, table: dict) -> str:
    """The row's GPT as .par text (tests/specs/gpt_1t.par's model with its sizes)."""
    h = row["hidden"]
    return f"""model gpt {{
  dim batch = {row['batch']}, seq = {table['seq']}, hidden = {h}, heads = {row['heads']}, \
ffn = {4 * h}, vocab = {table['vocab']}

  input tokens  : i64[batch, seq]
  input targets : i64[batch, seq]

  x = embedding(tokens, vocab -> hidden)
  repeat {row['layers']} as layer {{
    x = x + attention(layernorm(x), heads = heads, causal = true)
    x = x + mlp(layernorm(x), ffn, activation = gelu)
  }}
  logits = linear(layernorm(x), hidden -> vocab)
  output loss = cross_entropy(logits, targets)
}}
"""


def megatron_flops(row: dict, table: dict) -> float:
    """The paper's Eq. 3: one iteration's GEMM FLOPs with full recompute."""
    b, s, v = row["batch"], table["seq"], table["vocab"]
    l, h = row["layers"], row["hidden"]
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def score_row(row: dict, table: dict) -> dict:
    """The cost model's figures for one published row at its layout."""
    from soapstone.dsl import load
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import Candidate
    from soapstone.shard.plan.analysis.hardware import load_profile

    model = load(spec_text(row, table)).model()
    profile = load_profile(table["device"])
    planner = Planner(model, profile, precision="bf16", recompute=("layer",))
    t, p = row["tensor"], row["pipeline"]
    d = row["gpus"] // (t * p)
    c = Candidate(d, t, p, schedule="1f1b", microbatches=row["batch"] // d, zero=0,
                  recompute="layer")
    r = planner.cost(c)
    f = megatron_flops(row, table)
    predicted = f / (r.time.total * row["gpus"]) / 1e12
    return {"params_b": row["params_b"], "layout": c.label, "gpus": row["gpus"],
            "published_tflops": row["tflops_per_gpu"], "predicted_tflops": predicted,
            "error": predicted / row["tflops_per_gpu"] - 1,
            "published_step_s": f / (row["tflops_per_gpu"] * 1e12 * row["gpus"]),
            "predicted_step_s": r.time.total, "model_tflops": r.score.tflops_per_device,
            "mfu": r.score.mfu, "memory_bytes": r.memory, "fits": r.fits,
            "bubble": r.estimate.bubble, "source": row["source"]}


def table_text(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    out = ["| params | layout | GPUs | published TFLOP/s | predicted | error | step s pub / "
           "pred | model TFLOP/s, MFU | memory/GPU |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['params_b']}B | {r['layout']} | {r['gpus']} | "
                   f"{r['published_tflops']} | {r['predicted_tflops']:.0f} | "
                   f"{r['error']:+.0%} | {r['published_step_s']:.1f} / "
                   f"{r['predicted_step_s']:.1f} | {r['model_tflops']:.0f}, {r['mfu']:.0%} | "
                   f"{r['memory_bytes'] / 2**30:.1f} GiB{'' if r['fits'] else ' (no fit)'} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="F", help="also write the rows as JSON")
    args = ap.parse_args()
    table = json.loads(DATA.read_text())
    rows = [score_row(row, table) for row in table["rows"]]
    sys.stdout.write(f"{table['source']}; {table['device']}, seq {table['seq']}, vocab "
                     f"{table['vocab']}, full recompute\n\n" + table_text(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
