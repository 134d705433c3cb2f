"""The zero-bubble schedule zb1p against 1F1B, measured, beside torch.distributed.pipelining.

    mpiexec -n 2 .venv/bin/python bench/bench_zb.py [--iters 30] [--microbatches 8] [--json F]
    mpiexec -n 4 .venv/bin/python bench/bench_zb.py ...     (4 stages)

One job runs, alternating, one training step's forward and backward (no optimizer) of
examples/gpt.par (hidden 256, 8 heads, ffn 1024, vocab 256, seq 128, batch 32, its 4 layers
cut evenly over the ranks, the embedding on the first and the head and loss on the last) by:
- soapstone 1f1b and soapstone zb1p: the same stage graph but for the schedule, the Executor
  over MPI p2p; the bubble is read from each step's trace (shard/runtime/trace.py): per rank, the
  time it computed nothing (F, B and W are work; waiting for a message and the executor's
  bookkeeping are not) over the step's span;
- torch Schedule1F1B and ScheduleInterleavedZeroBubble with one stage per rank (torch's ZB1P
  generator, the same ZB-H1 order as zb1p), PipelineStage on gloo, the plain-torch GPT of
  shard/train/reference_gpt.py with the same weights and batch; its bubble is measured the same
  way, by timing the stage's forward, input-backward and weight-backward calls.
Step time: median and interquartile range over the steps after warm-up, slowest rank, the
four interleaved step by step (comm/bench/harness.py). The first step's losses of all
four are checked equal. Last, what the split costs: per rank, zb1p's B + W time over 1F1B's
whole backward time (the traces' medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DIMS = {"batch": 32, "seq": 128, "hidden": 256, "heads": 8, "ffn": 1024, "vocab": 256}


def soapstone_pipes(world, pipe: int, microbatches: int):
    """The model, and an Executor per schedule on the same stage cut."""
    from soapstone import dsl
    from soapstone.comm import Mesh
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.dsl.model import ir
    from soapstone.shard.runtime.executor import Executor

    model = dsl.load(ROOT / "examples/gpt.par", dims=DIMS).model()
    b, per = model.blocks, len(model.blocks) // pipe
    cut = tuple(ir.StageAssignment(b[i * per:(i + 1) * per], "pipe", i) for i in range(pipe))
    out = {}
    for kind in ("1f1b", "zb1p"):
        par = ir.Parallel(f"pp{pipe}", model.name, (("pipe", pipe),), operator=cut,
                          schedule=ir.Schedule(kind, microbatches))
        graph = lower_pipeline(model, par)
        out[kind] = Executor(graph, Mesh(world, pipe=pipe), seed=0, trace=True)
    return model, out


def torch_schedules(model_spec, graph, rank: int, pipe: int, microbatches: int):
    """torch's Schedule1F1B and ScheduleInterleavedZeroBubble over this rank's stage, and the
    busy-time log each fills (one (start, end) per stage call)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from soapstone.shard.runtime.sharded_model import init_full
    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    d = DIMS
    layers = len(model_spec.blocks)
    per = layers // pipe
    full = GPT(d["vocab"], d["hidden"], d["heads"], d["ffn"], layers)
    params = {p.name: init_full(p, 0) for s in graph.stages for p in s.program.params}
    load_from_soapstone(full, params)

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = rank == 0, rank == pipe - 1
            self.emb = full.emb if self.first else None
            self.blocks = nn.ModuleList(full.blocks[rank * per:(rank + 1) * per])
            self.norm = full.norm if self.last else None
            self.head = full.head if self.last else None

        def forward(self, x):
            if self.first:
                x = self.emb(x)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x)) if self.last else x

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    module = Part()
    busy: list[tuple[float, float]] = []
    out = {}
    for name, cls in (("torch 1F1B", Schedule1F1B),
                      ("torch ZB1P", ScheduleInterleavedZeroBubble)):
        stage = PipelineStage(module, rank, pipe, torch.device("cpu"))
        for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            timed(stage, meth, busy)
        out[name] = cls([stage] if cls is ScheduleInterleavedZeroBubble else stage,
                        n_microbatches=microbatches, loss_fn=loss_fn)
    return out, busy, module


def timed(obj, name: str, log: list) -> None:
    """Wrap obj.name so each call appends its (start, end) to log (a stopwatch, no more)."""
    inner = getattr(obj, name)

    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            log.append((t0, time.perf_counter()))
    setattr(obj, name, call)


def idle(busy: float, start: float, end: float) -> float:
    """The idle fraction of one rank over [start, end]."""
    return 1 - busy / (end - start) if end > start else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30,
                    help="timed steps after the warm-up (default and least 30)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    from soapstone.comm import init
    from soapstone.comm.bench.collectives import init_gloo

    torch.set_num_threads(1)
    world = init("mpi")
    pipe, rank = world.size, world.rank
    mpi = MPI.COMM_WORLD
    dist = init_gloo(mpi)
    model, pipes = soapstone_pipes(world, pipe, args.microbatches)
    peers, busy, module = torch_schedules(model, pipes["1f1b"].graph, rank, pipe,
                                          args.microbatches)
    g = torch.Generator().manual_seed(0)
    shape = (DIMS["batch"], DIMS["seq"])
    batch = {"tokens": torch.randint(0, DIMS["vocab"], shape, generator=g),
             "targets": torch.randint(0, DIMS["vocab"], shape, generator=g)}

    def soapstone_run(ex):
        def run():
            loss = ex.train_step(batch)
            for p in ex.parameters():
                p.grad = None
            ev = ex.timeline.events
            work = sum(e.end - e.start for e in ev if e.kind in ("F", "B", "W"))
            span = (min(e.start for e in ev), max(e.end for e in ev))
            back = sum(e.end - e.start for e in ev if e.kind in ("B", "W"))
            return loss, idle(work, *span), back
        return run

    def torch_run(sched):
        def run():
            losses = []
            busy.clear()
            if rank == 0:
                sched.step(batch["tokens"])
            elif rank == pipe - 1:
                sched.step(target=batch["targets"], losses=losses)
            else:
                sched.step()
            module.zero_grad(set_to_none=True)
            work = sum(e - s for s, e in busy)
            loss = float(torch.stack(losses).detach().mean()) if losses else None
            return loss, idle(work, busy[0][0], busy[-1][1]), 0.0
        return run

    runs = {"soapstone 1f1b": soapstone_run(pipes["1f1b"]),
            "soapstone zb1p": soapstone_run(pipes["zb1p"]),
            "torch 1F1B": torch_run(peers["torch 1F1B"]),
            "torch ZB1P": torch_run(peers["torch ZB1P"])}
    from soapstone.comm.bench.harness import interleave

    bubbles = {n: [] for n in runs}
    backs = {n: [] for n in runs}  # a rank's backward work (B + W) per step

    def after(name, step, value):
        if step >= args.warmup:  # collective: every rank, the same steps
            bubbles[name].append(mpi.allgather(value[1]))
            backs[name].append(mpi.allgather(value[2]))

    session = interleave(runs, args.iters, args.warmup, comm=mpi, after=after)
    first = {n: mpi.bcast(v[0][0], root=pipe - 1) for n, v in session.values.items()}
    say = print if rank == 0 else (lambda *a, **k: None)
    ref = first["soapstone 1f1b"]
    ok = all(abs(v - ref) <= 1e-4 * abs(ref) for v in first.values())
    say(f"# bench_zb: gpt {DIMS}, {pipe} stages, {args.microbatches} microbatches, "
        f"{args.iters} steps each, interleaved (fwd+bwd, slowest rank), {pipe} ranks; "
        f"{session.load_text()}")
    say("first-step losses: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items())
        + ("  (equal)" if ok else "  DIFFERENT"))
    theory = {"1f1b": pipes["1f1b"].schedule.theory_bubble(),
              "zb1p": pipes["zb1p"].schedule.theory_bubble()}
    figures = {}
    base = session.timings["soapstone 1f1b"].median
    for name in runs:
        step = session.timings[name].median
        per_rank = [statistics.median(b[r] for b in bubbles[name]) for r in range(pipe)]
        mean = sum(per_rank) / pipe
        th = theory["zb1p" if "zb" in name.lower() else "1f1b"]
        figures[name] = {"step_s": step, "bubble_per_rank": per_rank, "bubble_mean": mean,
                         "theory": th} | session.timings[name].to_json()
        say(f"{name:15s} step {session.timings[name].text()} ({step / base:.2f}x soapstone "
            "1f1b)  "
            f"bubble mean {mean:6.1%} (theory {th:.1%})  per rank "
            + " ".join(f"{b:.1%}" for b in per_rank))
    # what the split costs: zb1p's B + W against 1F1B's whole backward, per rank
    cost = [statistics.median(b[r] for b in backs["soapstone zb1p"])
            / statistics.median(b[r] for b in backs["soapstone 1f1b"]) for r in range(pipe)]
    figures["split_backward_cost_per_rank"] = cost
    for ours, peer in (("soapstone 1f1b", "torch 1F1B"), ("soapstone zb1p", "torch ZB1P"),
                       ("soapstone zb1p", "soapstone 1f1b")):
        say("  " + session.compare(ours, peer).text())
    say("soapstone zb1p backward work (B + W) / 1f1b's (B) per rank: "
        + " ".join(f"{c:.2f}x" for c in cost))
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps({
            "dims": DIMS, "pipe": pipe, "microbatches": args.microbatches, "losses": first,
            "figures": figures, **session.to_json()}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
