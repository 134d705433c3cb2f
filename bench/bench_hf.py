"""Hugging Face's own models vs the same models written in .par: a training step of GPT-2
(GPT2LMHeadModel) and LLaMA with grouped-query attention (LlamaForCausalLM) on one rank.

- transformers: the model and torch.optim.AdamW (fused), loss = cross entropy of its logits;
- soapstone: examples/gpt2.par / examples/llama.par at the same dims, its weights imported
  from the transformers model (`--init hf:DIR`'s path), Executor.train_step with AdamW.

Same weights, same batches; steps interleaved in one process, the median per side, reported
as soapstone / transformers. Before timing, the two first losses are checked to agree.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_hf.py

It builds both random models itself; transformers comes with the dev extra (`make install`),
as for the tests, and soapstone never imports it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# big enough that a step is compute, small enough for two cores; the examples' 2 blocks
DIMS = {"batch": 8, "seq": 128, "hidden": 256, "heads": 8, "ffn": 1024, "vocab": 2048}
HF = {"gpt2": {"n_embd": 256, "n_head": 8, "n_inner": 1024, "vocab_size": 2048, "n_layer": 2,
               "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
      "llama": {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                "intermediate_size": 1024, "vocab_size": 2048, "num_hidden_layers": 2}}


def side_by_side(kind: str, iters: int, warmup: int) -> dict:
    """Median step seconds of both sides, interleaved."""
    import torch
    import torch.nn.functional as F
    import transformers

    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.dsl.interop import hf
    from soapstone.shard.data.source import make_task
    from soapstone.shard.runtime.executor import Executor

    torch.manual_seed(0)
    conf = (transformers.GPT2Config if kind == "gpt2" else transformers.LlamaConfig)(**HF[kind])
    ref = (transformers.GPT2LMHeadModel if kind == "gpt2"
           else transformers.LlamaForCausalLM)(conf).train()
    dims = dict(DIMS, max_seq=128) if kind == "gpt2" else dict(DIMS, kv_heads=2)
    model = dsl.load(ROOT / f"examples/{kind}.par", dims=dims).model(kind)
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        graph = lower_graph(model, None)
        ex = Executor(graph, None, seed=0)
        ex.use_optimizer(name="adamw", lr=1e-4)
        hf.load_init(ex, d)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    task = make_task(graph.program, 0)

    def theirs(b):
        logits = ref(input_ids=b["tokens"]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1))
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        ref_opt.step()
        return float(loss.detach())

    def ours(b):
        return ex.train_step(b, step=0)

    b0 = task.batch(0)
    first = ours(b0), theirs(b0)
    if abs(first[0] - first[1]) > 1e-4 * abs(first[1]):
        raise SystemExit(f"{kind}: first losses differ: soapstone {first[0]}, "
                         f"transformers {first[1]}")
    from soapstone.comm.bench.harness import interleave

    current = {}

    def stepper(name, fn):  # both sides take batch i at their step i
        def run():
            i = current[name] = current.get(name, 0) + 1
            return fn(task.batch(i))
        return run

    session = interleave({"soapstone": stepper("soapstone", ours),
                          "transformers": stepper("transformers", theirs)}, iters, warmup)
    print(session.table())
    med = {k: t.median for k, t in session.timings.items()}
    return {"model": kind, **{f"{k}_s": v for k, v in med.items()},
            "ratio": med["soapstone"] / med["transformers"], "first_loss": first[0],
            "verdict": session.compare("transformers", "soapstone").to_json()["verdict"],
            **session.to_json()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30, help="timed steps (at least 30)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; dims {DIMS}")
    print(f"{'model':<8}{'transformers':>14}{'soapstone':>12}{'ratio':>8}")
    rows = []
    for kind in ("gpt2", "llama"):
        r = side_by_side(kind, args.iters, args.warmup)
        rows.append(r)
        print(f"{kind:<8}{r['transformers_s'] * 1e3:>11.1f} ms{r['soapstone_s'] * 1e3:>9.1f} ms"
              f"{r['ratio']:>7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
