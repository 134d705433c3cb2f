"""MoE training step at 2 ranks: experts split (ep2, dpep) against experts replicated (dp2).

examples/moe.par at larger dims, each layout an Executor on the same 2 MPI ranks, their steps
(forward, backward, AdamW) taken in turn so machine load falls on all alike; rank 0 prints the
median seconds per step and the ratio to dp2 (the same model with every expert on every rank).

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_moe.py [--steps 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from soapstone.comm import Mesh, init
from soapstone.dsl import load
from soapstone.dsl.stages import lower_graph
from soapstone.shard.data import make_task
from soapstone.shard.executor import Executor

SPEC = str(Path(__file__).resolve().parents[1] / "examples/moe.par")
DIMS = {"batch": 8, "seq": 64, "hidden": 128, "experts": 8, "ffn": 512, "vocab": 256}


def step_fn(world, layout: str):
    """A function running the next training step of `layout` on this world."""
    spec = load(SPEC, dims=DIMS)
    par = spec.parallel(layout)
    model = spec.model(par.model)
    ex = Executor(lower_graph(model, par), Mesh(world, **dict(par.mesh)), seed=0)
    ex.use_optimizer(name="adamw", lr=1e-3)
    task = make_task(lower_graph(model, None).program, 0)
    count = iter(range(10**9))
    return lambda: ex.train_step(task.batch(k := next(count)), step=k)


def main() -> None:
    """Time each layout's step; rank 0 prints the figures as one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    world = init("mpi")
    runs = {n: step_fn(world, n) for n in ("dp2", "ep2", "dpep")}
    times: dict[str, list[float]] = {n: [] for n in runs}
    for k in range(args.steps + 1):
        for n, run in runs.items():
            world.barrier()
            t0 = time.perf_counter()
            run()
            world.barrier()
            if k:
                times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    if world.rank == 0:
        print(json.dumps({"dims": DIMS, "seconds": med,
                          "vs_dp2": {n: med[n] / med["dp2"] for n in med}}))


if __name__ == "__main__":
    main()
