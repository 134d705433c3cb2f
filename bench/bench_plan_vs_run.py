"""The cost model against reality: the planner's predicted step time of every layout of a
scaled-up gpt.par on N ranks next to the measured one, with their rank correlation (Spearman)
and the median relative error.

    mpiexec -n 4 .venv/bin/soapstone bench calibrate -o cpu4.json
    OMP_NUM_THREADS=1 mpiexec -n 4 .venv/bin/python bench/bench_plan_vs_run.py \\
        --profile cpu4.json [--steps 4] [--json F]

Every layout `soapstone plan` would cost (dsl/search/space.py candidates; ZeRO 0 and 1, the
schedules, microbatches, sequence parallelism) is built and trained for a few AdamW steps in
this one launch, one after another; the measured time is the median step after a warm-up
(the slowest rank's). The prediction is the cost model's on the calibrated profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DIMS = {"batch": 16, "seq": 128, "hidden": 256, "heads": 8, "ffn": 1024, "vocab": 1024}


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a calibrated profile (bench calibrate)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per layout (default 4)")
    ap.add_argument("--zero", default="0,1", help="ZeRO stages to include (default 0,1)")
    ap.add_argument("--json", metavar="F", help="also write the rows (rank 0)")
    args = ap.parse_args()
    import torch
    from mpi4py import MPI

    from soapstone.comm import Mesh, init
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import candidates, to_parallel
    from soapstone.shard.data.source import make_task
    from soapstone.shard.plan.analysis.hardware import load_profile
    from soapstone.shard.train.trainer import Trainer

    torch.set_num_threads(1)
    world = init("mpi")
    mpi = MPI.COMM_WORLD
    text = Path("examples/gpt.par").read_text().split("parallel single")[0]
    model = load(text, dims=DIMS).model()
    planner = Planner(model, load_profile(args.profile), exact=True)
    zeros = {int(z) for z in args.zero.split(",")}
    cands = [c for c in candidates(model, planner.dims, world.size, planner.profile, [])
             if c.zero in zeros]
    task = make_task(lower_graph(model, None).program, 0)
    rows = []
    for c in cands:
        par = to_parallel(model, planner.dims, c)
        graph = lower_graph(model, par)
        mesh = Mesh(world, **dict(par.mesh)) if graph.world_size > 1 else None
        trainer = Trainer(graph, mesh, task=task, seed=0, optimizer="adamw", lr=1e-3)
        times = []
        for i in range(args.steps + 1):
            mpi.Barrier()
            t0 = time.perf_counter()
            trainer.step(i)
            t = mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            times.append(t)
        if mesh is not None:
            mesh.free()
        measured = statistics.median(times[1:])
        predicted = planner.cost(c).time.total
        rows.append({"layout": c.label, "predicted_s": predicted, "measured_s": measured,
                     "rel_error": predicted / measured - 1})
        if world.rank == 0:
            print(f"{c.label:<32} predicted {predicted * 1e3:8.2f} ms  measured "
                  f"{measured * 1e3:8.2f} ms  ({predicted / measured - 1:+.0%})", flush=True)
    if world.rank == 0:
        rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
        med = statistics.median(abs(r["rel_error"]) for r in rows)
        print(f"{len(rows)} layouts on {world.size} ranks: Spearman {rho:.2f}, median |relative "
              f"error| {med:.0%}")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "spearman": rho,
                                                   "median_abs_rel_error": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
