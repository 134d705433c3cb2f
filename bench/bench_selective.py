"""Selective recompute beside none and full recompute: memory kept and time paid.

On one rank (or, under mpiexec, per rank of one 2-rank layout family), gpt.par's model at
bench_recompute.py's dims in three forms: no recompute (`single`), `recompute selective`
(`sel_single`, tests/specs/selective_layouts.par) and `recompute layer` (`rc_single`,
tests/specs/recompute_layouts.par). For each: the step's peak resident memory above what the
process held before it (bench_memory.py's method), explain's activations + working set, and
the median time of a training step (forward, backward, AdamW), the three runs' steps taken in
turn. The figures that matter are the ratios to no recompute. Memory is measured with every
allocation over 64 KiB served by its own mmap (bench_memory.py), which makes each allocation
cost page faults; --time-only times the steps with the allocator as it is, in a process that
measures no memory.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_selective.py [--steps 30] [--json F]
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_selective.py --time-only
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_selective.py --tp2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import _exact_rss, measure  # noqa: E402
from bench_recompute import DIMS, alternate, soapstone_step  # noqa: E402

SEL = str(ROOT / "tests/specs/selective_layouts.par")
RC = str(ROOT / "tests/specs/recompute_layouts.par")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps (at least 30)")
    ap.add_argument("--tp2", action="store_true", help="the tp2 layouts, per rank (2 ranks)")
    ap.add_argument("--time-only", action="store_true",
                    help="time the steps only, with the default allocator")
    ap.add_argument("--json", metavar="F")
    args = ap.parse_args()
    import torch

    from soapstone.comm import Mesh, init

    torch.set_num_threads(1)
    if not args.time_only:
        _exact_rss()
    comm = init("mpi")
    suffix = "tp2" if args.tp2 else "single"
    cases = {"none": (SEL, "tp2" if args.tp2 else "single"),
             "selective": (SEL, f"sel_{suffix}"), "layer": (RC, f"rc_{suffix}")}
    mesh = Mesh(comm, model=2) if args.tp2 else None
    rows = {}
    for name, (spec, layout) in cases.items():
        if args.time_only:
            rows[name] = {"layout": layout, "peak_step_bytes": 0, "explain_bytes": 0}
            continue
        m = measure(spec, DIMS, layout, comm)
        rows[name] = {"layout": layout, "peak_step_bytes": m["peak_step_bytes"],
                      "explain_bytes": m["explain_activation_bytes"]
                      + m["explain_transient_bytes"] - m["input_bytes"]}
    runs = {name: soapstone_step(layout, spec, mesh) for name, (spec, layout) in cases.items()}
    for name, t in alternate(args.steps, **runs).items():
        rows[name]["step_s"] = t
    for r in rows.values():
        r["explain_error"] = r["explain_bytes"] / r["peak_step_bytes"] - 1 \
            if r["peak_step_bytes"] else None
    mib = 2 ** 20
    from mpi4py import MPI

    every = MPI.COMM_WORLD.allgather(rows)
    if comm.rank != 0:
        return 0
    print(f"{'rank':>4} {'recompute':<10} {'layout':<10} {'peak MiB':>9} {'explain':>8} "
          f"{'err':>6} {'step ms':>8} {'peak/none':>9} {'time/none':>9}")
    for rank, rs in enumerate(every):
        for name, r in rs.items():
            memory = "-" * 9 + " " + "-" * 8 + " " + "-" * 6 + " " if args.time_only else (
                f"{r['peak_step_bytes'] / mib:>9.1f} {r['explain_bytes'] / mib:>8.1f} "
                f"{r['explain_error']:>+6.1%} ")
            ratio = "-" * 9 if args.time_only else \
                f"{r['peak_step_bytes'] / rs['none']['peak_step_bytes']:>9.2f}"
            print(f"{rank:>4} {name:<10} {r['layout']:<10} {memory}{r['step_s'] * 1e3:>8.1f} "
                  f"{ratio} {r['step_s'] / rs['none']['step_s']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"dims": DIMS, "ranks": every}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
