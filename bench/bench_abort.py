"""Does a failing rank's message reach the user every time? The abort job of
tests/comm/comm_abort.py (4 ranks; rank 2 raises while the others sit in an allreduce), run
many times back to back while another MPI job keeps the cores busy, counted two ways:

- drained: the failure handler as shipped (flush, then wait, bounded, until mpiexec's proxy has
  read the pipes, then MPI Abort);
- undrained: the same job with that wait taken out (`watchdog.drain_stdio` replaced by a plain
  flush in the rank processes), which is how the handler worked when a fresh-clone run lost
  rank 2's traceback.

A run counts as delivered when the combined output holds rank 2's exception line and rank 0's
one-line summary. The figures go to BENCHMARKS.md.

    .venv/bin/python bench/bench_abort.py --runs 50
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "tests/comm/comm_abort.py"
BIN = Path(sys.executable).parent
NEEDLES = ("[rank 2] RuntimeError: boom from rank 2", "[rank 0] soapstone: rank 2 failed")

# The rank-side wrapper for the undrained way: the job as shipped, minus the drain.
UNDRAINED = (
    "import runpy, sys\n"
    "import soapstone.comm.observe.watchdog as w\n"
    "w.drain_stdio = lambda *a, **k: (sys.stdout.flush(), sys.stderr.flush())\n"
    f"sys.argv = [{str(CASE)!r}, 'raise']\n"
    f"runpy.run_path({str(CASE)!r}, run_name='__main__')\n"
)

# Background load: two ranks allreducing 1 MiB in a loop until killed.
LOAD = (
    "import torch\n"
    "from soapstone.comm import init\n"
    "w = init('mpi')\n"
    "x = torch.ones(1 << 18)\n"
    "while True:\n"
    "    w.allreduce(x)\n"
)


def launch(args: list[str]) -> subprocess.CompletedProcess:
    """One 4-rank abort job; its combined output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(BIN / "mpiexec"), "-n", "4", sys.executable, *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def delivered(res: subprocess.CompletedProcess) -> bool:
    """Both the failing rank's message and rank 0's summary arrived."""
    out = res.stdout + res.stderr
    return res.returncode != 0 and all(n in out for n in NEEDLES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--no-load", action="store_true", help="skip the background MPI job")
    args = ap.parse_args()

    load = None
    if not args.no_load:
        load = subprocess.Popen([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-c", LOAD],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    ways = {"drained": [str(CASE), "raise"], "undrained": ["-c", UNDRAINED]}
    ok = dict.fromkeys(ways, 0)
    secs = dict.fromkeys(ways, 0.0)
    try:
        for i in range(args.runs):
            for name, argv in ways.items():  # interleaved: both see the same load
                t = time.perf_counter()
                res = launch(argv)
                secs[name] += time.perf_counter() - t
                ok[name] += delivered(res)
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v}" for k, v in ok.items()),
                  flush=True)
    finally:
        if load is not None:  # SIGTERM: mpiexec passes it on to its ranks
            load.terminate()
            try:
                load.wait(timeout=20)
            except subprocess.TimeoutExpired:
                load.kill()
    print(f"\n{'way':>10} | delivered | mean job s   (4 ranks, "
          f"{'no load' if args.no_load else 'a 2-rank allreduce loop beside'}; "
          f"loadavg {os.getloadavg()[0]:.1f})")
    for name in ways:
        print(f"{name:>10} | {ok[name]:>4}/{args.runs:<4} | {secs[name] / args.runs:8.2f}")


if __name__ == "__main__":
    main()
