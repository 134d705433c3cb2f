"""A pipe rank's memory as microbatches grow: 1F1B flat, GPipe linear, explain beside both.

    mpiexec -n 2 .venv/bin/python bench/bench_pipe_memory.py [--microbatches 4 16 64]
        [--schedules 1f1b gpipe] [--dim hidden=64 ...] [--json F]

examples/gpt.par cut in two (layers 0-1 and the embedding on pipe rank 0, layers 2-3, the
head and the loss on pipe rank 1; interleaved: layers 0 and 2 on rank 0; a V (zbv,
dualpipev): layers 0 and 3 on rank 0, the embedding and the head both there), the same global
batch for every microbatch count. For each
schedule and count, in one job: a training step (AdamW: gradients and optimizer state
exist), then a second step's forward and backward under shard/runtime/memory.py's LiveBytes, whose
peak is the bytes of tensors the step allocated and held at once: the activations of the
microbatches in flight, the boundary tensors stored for backward, the receive and send
buffers, the working set of the op running. explain's figure for the rank
(shard/plan/analysis/explain.py) is its activations + transient, the same quantity; their ratio is
the error column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIMS = {"seq": 32, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 128}
MICROBATCH = 2  # rows per microbatch: the global batch is m of them (gpt.par needs 8+)


def layout(model, kind: str, microbatches: int, pipe: int = 2, chunks: int = 1):
    """The model's blocks cut evenly over `pipe` ranks (`chunks` per rank, or as many as the
    schedule places: a V's two), each virtual stage on the rank `kind` places it."""
    from soapstone.dsl.model import ir
    from soapstone.shard.plan import schedules

    spec = schedules.get(kind)
    b = model.blocks
    n = pipe * spec.per_rank(chunks)
    per = len(b) // n
    cut = tuple(ir.StageAssignment(b[i * per:(i + 1) * per], "pipe", spec.rank_of(i, pipe))
                for i in range(n))
    return ir.Parallel(f"pp{pipe}", model.name, (("pipe", pipe),), operator=cut,
                       schedule=ir.Schedule(kind, microbatches, chunks))


def measure(world, kind: str, microbatches: int, dims: dict | None = None,
            p2p: str | None = None, chunks: int = 1) -> dict:
    """This rank's peak live tensor bytes over one step's forward and backward (after a
    first step) of gpt.par at `dims` with batch = microbatches x MICROBATCH, and explain's figure
    for its pipe rank."""

    from soapstone import dsl
    from soapstone.comm import Mesh
    from soapstone.dsl.compile.lower import lower
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.shard.data.tasks import random_inputs
    from soapstone.shard.plan.analysis.explain import estimate_pipeline
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.runtime.memory import LiveBytes

    dims = DIMS | (dims or {}) | {"batch": microbatches * MICROBATCH}
    model = dsl.load(ROOT / "examples/gpt.par", dims=dims).model()
    par = layout(model, kind, microbatches, world.size, chunks)
    graph = lower_pipeline(model, par)
    ex = Executor(graph, Mesh(world, pipe=world.size), seed=0, p2p=p2p)
    ex.use_optimizer(name="adamw", lr=1e-3)
    single = lower(model, None)
    ex.train_step(random_inputs(single, 0), step=0)  # gradients and optimizer state exist
    batch = random_inputs(single, 1)
    world.barrier()
    live = LiveBytes()
    with live:
        ex.forward_backward(batch, step=1)
    ex.step()
    est = estimate_pipeline(graph, rank=ex.pipe_rank)
    return {"schedule": kind, "microbatches": microbatches, "chunks": chunks, "p2p": ex.p2p,
            "rank": world.rank, "peak_bytes": live.peak,
            "explain_bytes": est.activation_bytes + est.transient_bytes,
            "explain_activation_bytes": est.activation_bytes,
            "explain_transient_bytes": est.transient_bytes}


def table(rows: list[dict]) -> str:
    """The rows as text: per schedule and microbatch count, each rank's peak and explain's."""
    out = [f"{'schedule':<12} {'m':>3} {'rank':>4} {'peak KiB':>9} {'explain':>8} {'err':>6}"]
    for r in rows:
        out.append(f"{r['schedule']:<12} {r['microbatches']:>3} {r['rank']:>4} "
                   f"{r['peak_bytes'] / 1024:>9.1f} {r['explain_bytes'] / 1024:>8.1f} "
                   f"{r['explain_bytes'] / r['peak_bytes'] - 1:>+6.1%}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--json", metavar="F", help="also write the rows as JSON (rank 0)")
    args = ap.parse_args()
    import torch
    from mpi4py import MPI

    from soapstone.comm import init
    from soapstone.dsl.app.build import parse_dims

    torch.set_num_threads(1)
    world = init("mpi")
    dims = parse_dims(args.dim)
    rows = [measure(world, kind, m, dims, chunks=2 if kind == "interleaved" else 1)
            for kind in args.schedules for m in args.microbatches]
    every = MPI.COMM_WORLD.allgather(rows)
    if world.rank == 0:
        flat = sorted((r for part in every for r in part),
                      key=lambda r: (args.schedules.index(r["schedule"]), r["microbatches"],
                                     r["rank"]))
        sys.stdout.write(table(flat))
        if args.json:
            Path(args.json).write_text(json.dumps(flat, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
