"""What the one executor costs: a training step of examples/gpt.par (bench_tp's dims) on one
rank, three ways.

- torch: the plain-torch GPT (shard/train/reference_gpt.py) with torch.optim.AdamW(fused=True): the
  floor, a loop anyone would write;
- by hand: soapstone's ShardedModel forward/backward and build_optimizer's step, called
  directly (the stage runtime alone);
- executor: Executor.train_step (the schedule, microbatch cutting, loss gather, the optimizer
  step by the pipeline's rules), the path `soapstone run` and `golden` take for every layout.

Same weights, same batch, AdamW on all three; steps interleaved and timed in one process
(comm/bench/harness.py), the median and interquartile range per way, reported as ratios to torch.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_executor.py --iters 30
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench_tp.py's model: big enough that a step is compute, small enough for two cores
DIMS = {"batch": 8, "seq": 128, "hidden": 512, "heads": 8, "ffn": 2048, "vocab": 2048}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30,
                    help="timed steps after the warm-up (default and least 30)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import torch

    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.runtime.sharded_model import ShardedModel
    from soapstone.shard.train.optim import build_optimizer
    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    spec = dsl.load(ROOT / "examples/gpt.par", dims=DIMS)
    model = spec.model()
    dims = dict(model.dims)
    graph = lower_graph(model, None)
    hand = ShardedModel(graph.program, None, seed=0)
    hand_opt = build_optimizer(hand, "adamw", lr=1e-4)
    ex = Executor(graph, None, seed=0)
    ex.use_optimizer(name="adamw", lr=1e-4)
    ref = GPT(dims["vocab"], dims["hidden"], dims["heads"], dims["ffn"], len(model.blocks))
    load_from_soapstone(ref, {n: p.detach().clone() for n, p in hand.params.items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    g = torch.Generator().manual_seed(0)
    shape = (dims["batch"], dims["seq"])
    batch = {"tokens": torch.randint(0, dims["vocab"], shape, generator=g),
             "targets": torch.randint(0, dims["vocab"], shape, generator=g)}

    def step_torch() -> float:
        loss = ref(batch["tokens"], batch["targets"])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    def step_hand() -> float:
        out = hand(batch)
        out["loss"].backward()
        hand_opt.step()
        hand_opt.zero_grad()
        return hand.loss_value(out)

    def step_executor() -> float:
        return ex.train_step(batch)

    ways = {"torch": step_torch, "by hand": step_hand, "executor": step_executor}
    first = {name: fn() for name, fn in ways.items()}  # the same loss from the same weights
    from soapstone.comm.bench.harness import interleave

    session = interleave(ways, args.iters, args.warmup)
    med = {name: t.median for name, t in session.timings.items()}
    print(f"gpt.par on one rank ({dims['batch']}x{dims['seq']} tokens, {len(model.blocks)} "
          f"layers, hidden {dims['hidden']}), AdamW, {args.iters} steps each, interleaved; "
          f"{session.load_text()}")
    for name in ways:
        print(f"  {name:<9} {session.timings[name].text()}  {med[name] / med['torch']:.3f}x "
              f"torch   first loss {first[name]:.5f}")
    for ours, peer in (("executor", "torch"), ("by hand", "executor")):
        print("  " + session.compare(ours, peer).text())
    if args.json:
        Path(args.json).write_text(json.dumps({"first_loss": first} | session.to_json(),
                                              indent=1))


if __name__ == "__main__":
    main()
