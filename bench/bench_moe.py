"""MoE training step at 2 ranks: experts split (ep2, dpep) against experts replicated (dp2),
and the dispatch's alltoallv against raw mpi4py Alltoallv on the same row counts.

examples/moe.par at larger dims, each layout an Executor on the same 2 MPI ranks, their steps
(forward, backward, AdamW) taken in turn so machine load falls on all alike; rank 0 prints the
median seconds per step and the ratio to dp2 (the same model with every expert on every rank).
Then the row counts dpep's dispatch sent in its last step (shard/ops/moe.py records them) are
exchanged again, in turn: soapstone's communicator alltoallv (what the kernel calls, through
its autograd wrapper) and mpi4py's Alltoallv into a buffer allocated per call, as soapstone's
is; median microseconds per call and the ratio.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_moe.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from soapstone.comm import Mesh, init
from soapstone.dsl import load
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.source import make_task
from soapstone.shard.runtime.executor import Executor

SPEC = str(Path(__file__).resolve().parents[1] / "examples/moe.par")
DIMS = {"batch": 8, "seq": 64, "hidden": 128, "experts": 8, "ffn": 512, "vocab": 256}


def step_fn(world, layout: str):
    """A function running the next training step of `layout` on this world, and its
    Executor."""
    spec = load(SPEC, dims=DIMS)
    par = spec.parallel(layout)
    model = spec.model(par.model)
    ex = Executor(lower_graph(model, par), Mesh(world, **dict(par.mesh)), seed=0)
    ex.use_optimizer(name="adamw", lr=1e-3)
    task = make_task(lower_graph(model, None).program, 0)
    count = iter(range(10**9))
    return (lambda: ex.train_step(task.batch(k := next(count)), step=k)), ex


def dispatch_times(world, ex, calls: int) -> dict:
    """Median seconds of soapstone's alltoallv and mpi4py's Alltoallv on the row counts the
    moe op's dispatch sent in the executor's last step (rows of `hidden` floats)."""
    import numpy as np
    import torch
    from mpi4py import MPI

    send, recv = next(iter(ex.models[0].ctx.moe.values()))["sizes"]
    h = DIMS["hidden"]
    x = torch.randn(sum(send), h)
    mpi = MPI.COMM_WORLD
    sc, rc = [n * h for n in send], [n * h for n in recv]
    sd, rd = [sum(sc[:j]) for j in range(len(sc))], [sum(rc[:j]) for j in range(len(rc))]
    a = x.numpy()

    def raw():
        out = np.empty(sum(rc), dtype=np.float32)
        mpi.Alltoallv([a, (sc, sd), MPI.FLOAT], [out, (rc, rd), MPI.FLOAT])
        return out

    impls = {"soapstone": lambda: world.alltoallv(x, send, recv), "mpi4py": raw}
    got = {n: [] for n in impls}
    for k in range(calls + 10):
        for n, fn in impls.items():
            world.barrier()
            t0 = time.perf_counter()
            fn()
            if k >= 10:
                got[n].append(time.perf_counter() - t0)
    return {"send_rows": send, "recv_rows": recv,
            "us": {n: statistics.median(t) * 1e6 for n, t in got.items()}}


def main() -> None:
    """Time each layout's step; rank 0 prints the figures as one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30, help="timed steps (at least 30)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    world = init("mpi")
    made = {n: step_fn(world, n) for n in ("dp2", "ep2", "dpep")}
    runs = {n: fn for n, (fn, _) in made.items()}
    from mpi4py import MPI

    from soapstone.comm.bench.harness import interleave

    session = interleave(runs, args.steps, warmup=1, comm=MPI.COMM_WORLD)
    med = {n: t.median for n, t in session.timings.items()}
    dispatch = dispatch_times(world, made["dpep"][1], args.calls)
    us = dispatch["us"]
    if world.rank == 0:
        print(session.table())
        print(json.dumps({"dims": DIMS, "seconds": med, **session.to_json(),
                          "vs_dp2": {n: med[n] / med["dp2"] for n in med},
                          "dispatch": dispatch | {"vs_mpi4py": us["soapstone"] / us["mpi4py"]}}))


if __name__ == "__main__":
    main()
