"""The V-shaped schedules zbv and dualpipev, measured beside torch.distributed.pipelining's
ScheduleZBVZeroBubble and ScheduleDualPipeV (and soapstone zb1p, one stage per rank).

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python bench/bench_zbv.py [--iters 30]
        [--microbatches 8] [--json F]

One job runs, alternating step by step (comm/bench/harness.py), one training step's forward
and backward (no optimizer) of examples/gpt.par at DIMS (4 layers) by:
- soapstone zbv and dualpipev: the 4 layers as 4 virtual stages in a V over the 2 ranks
  (rank 0: layers 0 and 3, the embedding and the head; rank 1: layers 1 and 2, handed over in
  memory), the Executor over MPI p2p; zb1p: layers 0-1 and 2-3;
- torch ScheduleZBVZeroBubble and ScheduleDualPipeV with the same two PipelineStages per rank
  (stages r and 2P-1-r), on gloo, the plain-torch GPT of shard/train/reference_gpt.py with
  the same weights and batch.
Step time: median and interquartile range over the steps after warm-up, slowest rank. The
bubble is measured alike for all: per rank, the time it computed nothing (soapstone: F, B
and W of the step's trace are work; torch: its stages' forward, input-backward and
weight-backward calls, timed) over the step's span, beside the schedule's formula (equal F,
B and W). Peak memory per rank: one more step of each under shard/runtime/memory.py's
LiveBytes (the tensors the step allocates and holds at once: activations in flight, buffers),
untimed. The first step's losses of all runs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_zb import idle, timed  # this folder's: the stopwatch and the idle fraction

ROOT = Path(__file__).resolve().parents[1]

DIMS = {"batch": 16, "seq": 64, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 256}
OURS = ("zbv", "dualpipev", "zb1p")


def soapstone_pipes(world, pipe: int, microbatches: int):
    """The model, and an Executor per schedule: the V cut for zbv and dualpipev (a stage per
    layer, down the ranks and back), an even cut for zb1p."""
    from soapstone import dsl
    from soapstone.comm import Mesh
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.dsl.model import ir
    from soapstone.shard.plan import schedules
    from soapstone.shard.runtime.executor import Executor

    model = dsl.load(ROOT / "examples/gpt.par", dims=DIMS).model()
    b = model.blocks
    out = {}
    for kind in OURS:
        n = pipe * schedules.get(kind).stages_per_rank
        per = len(b) // n
        ranks = schedules.get(kind).ranks(pipe, n // pipe)
        cut = tuple(ir.StageAssignment(b[i * per:(i + 1) * per], "pipe", ranks[i])
                    for i in range(n))
        par = ir.Parallel(f"pp{pipe}", model.name, (("pipe", pipe),), operator=cut,
                          schedule=ir.Schedule(kind, microbatches, n // pipe))
        out[kind] = Executor(lower_pipeline(model, par), Mesh(world, pipe=pipe), seed=0,
                             trace=True)
    return model, out


def torch_schedules(model_spec, graph, rank: int, pipe: int, microbatches: int):
    """torch's ScheduleZBVZeroBubble and ScheduleDualPipeV over this rank's two stages, and
    the busy-time log both fill (one (start, end) per stage call)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    from soapstone.shard.runtime.sharded_model import init_full
    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    d = DIMS
    layers = len(model_spec.blocks)
    n = 2 * pipe
    per = layers // n
    full = GPT(d["vocab"], d["hidden"], d["heads"], d["ffn"], layers)
    params = {p.name: init_full(p, 0) for s in graph.stages for p in s.program.params}
    load_from_soapstone(full, params)

    class Part(nn.Module):
        def __init__(self, s: int):
            super().__init__()
            self.first, self.last = s == 0, s == n - 1
            self.emb = full.emb if self.first else None
            self.blocks = nn.ModuleList(full.blocks[s * per:(s + 1) * per])
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

    mine = (rank, n - 1 - rank)
    modules = {s: Part(s) for s in mine}
    busy: list[tuple[float, float]] = []
    out = {}
    for name, cls in (("torch ZBV", ScheduleZBVZeroBubble), ("torch DualPipeV",
                                                              ScheduleDualPipeV)):
        stages = [PipelineStage(modules[s], s, n, torch.device("cpu")) for s in mine]
        for st in stages:
            for meth in ("forward_one_chunk", "backward_one_chunk",
                         "backward_weight_one_chunk"):
                timed(st, meth, busy)
        out[name] = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return out, busy, list(modules.values())


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
    from soapstone.comm.bench.harness import interleave
    from soapstone.shard.runtime.memory import LiveBytes

    torch.set_num_threads(1)
    world = init("mpi")
    pipe, rank = world.size, world.rank
    mpi = MPI.COMM_WORLD
    dist = init_gloo(mpi)
    model, pipes = soapstone_pipes(world, pipe, args.microbatches)
    peers, busy, modules = torch_schedules(model, pipes["zbv"].graph, rank, pipe,
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
            return loss, idle(work, min(e.start for e in ev), max(e.end for e in ev))
        return run

    def torch_run(sched):
        def run():
            losses = []
            busy.clear()
            if rank == 0:  # the V's first and last stage: the batch in, the loss out
                sched.step(batch["tokens"], target=batch["targets"], losses=losses)
            else:
                sched.step()
            for m in modules:
                m.zero_grad(set_to_none=True)
            work = sum(e - s for s, e in busy)
            loss = float(torch.stack(losses).detach().mean()) if losses else None
            return loss, idle(work, min(s for s, _ in busy), max(e for _, e in busy))
        return run

    runs = {f"soapstone {k}": soapstone_run(pipes[k]) for k in OURS[:2]}
    runs |= {n: torch_run(s) for n, s in peers.items()}
    runs["soapstone zb1p"] = soapstone_run(pipes["zb1p"])
    bubbles = {n: [] for n in runs}

    def after(name, step, value):
        if step >= args.warmup:  # collective: every rank, the same steps
            bubbles[name].append(mpi.allgather(value[1]))

    session = interleave(runs, args.iters, args.warmup, comm=mpi, after=after)
    peaks = {}
    for name, run in runs.items():  # untimed: LiveBytes watches every tensor op
        mpi.Barrier()
        with LiveBytes() as live:
            run()
        peaks[name] = mpi.allgather(live.peak)
    first = {n: mpi.bcast(v[0][0], root=0) for n, v in session.values.items()}
    say = print if rank == 0 else (lambda *a, **k: None)
    ref = first["soapstone zbv"]
    ok = all(abs(v - ref) <= 1e-4 * abs(ref) for v in first.values())
    say(f"# bench_zbv: gpt {DIMS}, pipe {pipe}, {args.microbatches} microbatches, "
        f"{args.iters} steps each, interleaved (fwd+bwd, slowest rank); {session.load_text()}")
    say("first-step losses: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items())
        + ("  (equal)" if ok else "  DIFFERENT"))
    theory = {k: pipes[k].schedule.theory_bubble() for k in OURS}
    figures = {}
    for name in runs:
        kind = {"torch ZBV": "zbv", "torch DualPipeV": "dualpipev"}.get(name, name.split()[-1])
        step = session.timings[name].median
        per_rank = [statistics.median(b[r] for b in bubbles[name]) for r in range(pipe)]
        mean = sum(per_rank) / pipe
        figures[name] = {"step_s": step, "bubble_per_rank": per_rank, "bubble_mean": mean,
                         "theory": theory[kind], "peak_bytes_per_rank": peaks[name]} \
            | session.timings[name].to_json()
        say(f"{name:17s} step {session.timings[name].text()}  bubble mean {mean:6.1%} "
            f"(formula {theory[kind]:.1%}) per rank "
            + " ".join(f"{b:.1%}" for b in per_rank) + "  peak MiB per rank "
            + " ".join(f"{p / 2**20:.1f}" for p in peaks[name]))
    for ours, peer in (("soapstone zbv", "torch ZBV"), ("soapstone dualpipev", "torch DualPipeV"),
                       ("soapstone zbv", "soapstone zb1p"),
                       ("soapstone dualpipev", "soapstone zbv")):
        say("  " + session.compare(ours, peer).text())
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps({
            "dims": DIMS, "pipe": pipe, "microbatches": args.microbatches, "losses": first,
            "figures": figures, **session.to_json()}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
