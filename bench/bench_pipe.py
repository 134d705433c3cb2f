"""Pipeline parallel at 2 ranks: soapstone 1F1B vs torch.distributed.pipelining Schedule1F1B.

    mpiexec -n 2 .venv/bin/python bench/bench_pipe.py [--iters 30] [--microbatches 8]
            [--trace pipe.json] [--png pipe.png] [--json out.json] [--device cpu|cuda]

Both run examples/gpt.par scaled up (hidden 512, 8 heads, ffn 2048, vocab 2048, seq 128,
batch 16, 4 layers: layers 0-1 with the embedding on rank 0, layers 2-3 with the head and loss
on rank 1) with the same weights and batch, in one job, alternating. soapstone: a 2-stage
pipeline layout compiled by lower_pipeline, the Executor over MPI p2p. PyTorch: the
plain-torch GPT of shard/train/reference_gpt.py cut at the same place, PipelineStage + Schedule1F1B
on gloo. Timed: one training step's forward and backward of every microbatch (no optimizer),
median and interquartile range over the steps after warm-up, slowest rank, the two
interleaved step by step (comm/bench/harness.py). The first-step losses are checked equal.
The measured bubble of soapstone's last traced step is printed beside (p-1)/(m+p-1).
--device cuda: both on NCCL with the stages and batch on each rank's GPU (bench_dp.start;
soapstone's p2p grouped, as on any GPU), each step timed between torch.cuda.synchronize()
calls. No bubble, trace or PNG there: the timeline's host clock times kernel launches, not the
GPU's work. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DIMS = {"batch": 16, "seq": 128, "hidden": 512, "heads": 8, "ffn": 2048, "vocab": 2048}


def soapstone_pipe(world, microbatches: int, device=None):
    import torch

    from soapstone import dsl
    from soapstone.comm import Mesh
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.dsl.model import ir
    from soapstone.shard.runtime.executor import Executor

    model = dsl.load(ROOT / "examples/gpt.par", dims=DIMS).model()
    b = model.blocks
    par = ir.Parallel("pp2", model.name, (("pipe", 2),),
                      operator=(ir.StageAssignment(b[:2], "pipe", 0),
                                ir.StageAssignment(b[2:], "pipe", 1)),
                      schedule=ir.Schedule("1f1b", microbatches))
    graph = lower_pipeline(model, par)
    device = torch.device("cpu" if device is None else device)
    # the trace's per-step barrier is part of the CPU figures; on a GPU it would add a stream
    # synchronise that torch's step lacks
    return model, graph, Executor(graph, Mesh(world, pipe=2), seed=0,
                                  trace=device.type == "cpu", device=device)


def torch_stage(model_spec, graph, rank: int, microbatches: int, device=None):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from soapstone.shard.runtime.sharded_model import init_full
    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    d = DIMS
    full = GPT(d["vocab"], d["hidden"], d["heads"], d["ffn"], len(model_spec.blocks))
    params = {p.name: init_full(p, 0) for s in graph.stages for p in s.program.params}
    load_from_soapstone(full, params)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks = full.emb, nn.ModuleList(full.blocks[:2])

        def forward(self, tokens):
            x = self.emb(tokens)
            for blk in self.blocks:
                x = blk(x)
            return x

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.norm, self.head = nn.ModuleList(full.blocks[2:]), full.norm, \
                full.head

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    device = torch.device("cpu" if device is None else device)
    module = (First() if rank == 0 else Last()).to(device)
    stage = PipelineStage(module, rank, 2, device)
    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30,
                    help="timed steps after the warm-up (default and least 30)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--trace", help="write soapstone's last step as a Chrome trace here")
    ap.add_argument("--png", help="draw soapstone's last step here (needs matplotlib)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (MPI vs gloo) or cuda (a GPU per rank, NCCL on both sides)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and (args.trace or args.png):
        ap.error("--trace and --png need --device cpu: on a GPU the timeline's host clock "
                 "times kernel launches, not the work")

    import torch
    from bench_dp import start
    from mpi4py import MPI

    from soapstone.shard.runtime import trace as tr

    torch.set_num_threads(1)
    bench = start(args.device)
    world, dist, device = bench.world, bench.dist, bench.device
    cpu = device.type == "cpu"
    if world.size != 2:
        raise SystemExit("run with mpiexec -n 2")
    mpi = MPI.COMM_WORLD
    rank = world.rank
    model, graph, pm = soapstone_pipe(world, args.microbatches, device)
    sched = torch_stage(model, graph, rank, args.microbatches, device)
    g = torch.Generator().manual_seed(0)
    shape = (DIMS["batch"], DIMS["seq"])
    batch = {"tokens": torch.randint(0, DIMS["vocab"], shape, generator=g).to(device),
             "targets": torch.randint(0, DIMS["vocab"], shape, generator=g).to(device)}

    def run_soapstone():
        loss = pm.train_step(batch)
        for p in pm.parameters():
            p.grad = None
        return loss

    def run_torch():
        losses = []
        if rank == 0:
            sched.step(batch["tokens"])
        else:
            sched.step(target=batch["targets"], losses=losses)
        sched._stage.submod.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None

    from soapstone.comm.bench.harness import interleave

    bubbles = []

    def after(name, step, _):
        if name == "soapstone" and step >= args.warmup and cpu:
            bubbles.append(pm.bubble()[0])  # collective: every rank, the same steps

    session = interleave({"soapstone": run_soapstone, "torch": run_torch}, args.iters,
                         args.warmup, comm=mpi, sync=bench.sync, after=after)
    first = {name: v[0] for name, v in session.values.items()}
    torch_loss = mpi.bcast(first["torch"], root=1)
    say = print if rank == 0 else (lambda *a, **k: None)
    ok = abs(first["soapstone"] - torch_loss) <= 1e-4 * abs(torch_loss)
    ratio = session.compare("soapstone", "torch")
    soap, peer = ratio.ours.median, ratio.peer.median
    theory = pm.schedule.theory_bubble()
    bubble = statistics.median(bubbles) if cpu else None
    on = "" if cpu else f", NCCL on {bench.label}"
    say(f"# bench_pipe: gpt {DIMS}, 2 stages, 1F1B, {args.microbatches} microbatches, "
        f"{args.iters} steps each, interleaved (fwd+bwd, slowest rank){on}")
    say(f"first-step loss: soapstone {first['soapstone']:.6f}  torch {torch_loss:.6f}  "
        f"{'equal' if ok else 'DIFFERENT'}")
    say("step time (torch = torch.distributed.pipelining):\n" + session.table())
    say(f"  {ratio.text()}")
    measured = f"measured {bubble:.1%}" if cpu else "not measured on a GPU"
    say(f"soapstone bubble: {measured}  theory (p-1)/(m+p-1) = {theory:.1%}")
    events = pm.events() if cpu else []
    if args.trace and rank == 0:
        tr.write_chrome_trace(args.trace, events, "bench_pipe soapstone 1f1b")
        say(f"wrote {args.trace}")
    if args.png and rank == 0:
        if tr.write_png(args.png, events):
            say(f"wrote {args.png}")
        else:
            say("no PNG: matplotlib is not installed (pip install matplotlib)")
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps({
            "dims": DIMS, "device": bench.label, "microbatches": args.microbatches,
            "soapstone_s": soap, "torch_s": peer, "bubble_measured": bubble,
            "ratio": ratio.to_json(), **session.to_json(),
            "bubble_theory": theory,
            "loss_soapstone": first["soapstone"], "loss_torch": torch_loss}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
