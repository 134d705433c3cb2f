"""The watchdog's cost: soapstone's comm calls and training steps with the flight recorder on
(the default) and off, side by side.

    .venv/bin/python bench/bench_watchdog.py calls
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_watchdog.py dp

The watchdog's per-call work is the flight recorder's entry: the deadline runs from that entry
(a blocking call in progress is the ring's newest entry), so nothing else is armed per call.
Unrecorded communicators (SOAPSTONE_FLIGHT_RECORDER=0) go through the same C call, which
numbers and counts the op but keeps no entry; the watchdog thread runs in both cases (it wakes
once a poll, at most once a second by default).

calls: one process (1 rank), the same 8-byte tensor through two communicators over the same
MPI communicator, one recording and one not. Each call is timed alone (perf_counter_ns), in
turns of 200 calls per communicator with the order rotating, the first 20 calls of a turn not
counted (they pay for switching communicators); figures are medians. A load of other jobs
shows up as outliers, which the median leaves out. Then the parts of a recorded call, each
timed alone in a loop (the lowest of many loops, since load only adds time): the rings' `run`
around a call that does nothing, keeping no entry (what every call costs: it numbers and counts
the op) and keeping one (the difference is what recording costs).

dp: bench_dp's model (gpt scaled to ~21M parameters, AdamW, 2 ranks, data parallel) as ZeRO 0
(buckets overlapped with backward) and ZeRO 3, each built twice, recorded and not, the twins
trained step by step in turn on the same batches (ABBA order, so that each runs first and after
the other equally often), and the pair built again in the other order (the model built second
runs faster, whichever it is); median step time of the slowest rank, the geometric mean of the
two orders' ratios, and the comm calls one step records.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

BLOCK, SKIP = 200, 20


def per_call_ns(fns: dict, rounds: int) -> dict:
    """{name: median ns of one call of fns[name]()}: turns of BLOCK calls each, the order
    rotating every round, the first SKIP calls of a turn not counted."""
    clock = time.perf_counter_ns
    names = list(fns)
    samples: dict[str, list[int]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, out = fns[name], samples[name]
            for i in range(BLOCK):
                t0 = clock()
                fn()
                dt = clock() - t0
                if i >= SKIP:
                    out.append(dt)
    return {k: statistics.median(v) for k, v in samples.items()}


def part_ns(rounds: int, n: int = 2000) -> dict:
    """{part of a comm call: ns}, each timed alone in a loop of n, minus the loop it replaces;
    the lowest of `rounds` loops (another job's load only ever adds time). Every call goes
    through the rings' `run` (it numbers and counts the op); recording adds the entry."""
    import torch

    from soapstone.comm.accounting import bus_factor
    from soapstone.comm.observe.flight_recorder import FlightRecorder
    from soapstone.comm.op_table import COUNTED_OPS

    kept, bare = (FlightRecorder(c, 0, 2, [0, 1], "bench") for c in (512, 0))
    for ring in (kept, bare):
        for op in COUNTED_OPS:
            ring.count_as(op, *bus_factor(op, 2))
    t, t3 = torch.zeros(2), torch.zeros(2, 2, 2)
    dtype, args = t.dtype, (t,)

    def func(_):
        return None

    def direct():
        for _ in range(n):
            func(*args)

    def loop(ring, x):
        def go():
            for _ in range(n):
                ring.run("allreduce", x, dtype, -1, False, 1, False, func, (x,))
        return go

    parts = {"direct": direct, "bare": loop(bare, t), "kept": loop(kept, t),
             "bare3": loop(bare, t3), "kept3": loop(kept, t3)}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            t0 = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - t0) / n)
    low = {k: min(v) for k, v in times.items()}
    return {"run, nothing kept (numbered, counted), less the direct call":
            low["bare"] - low["direct"],
            "the entry (run kept less run not kept), 1-d tensor": low["kept"] - low["bare"],
            "the same, 3-d tensor": low["kept3"] - low["bare3"]}


def calls(rounds: int) -> None:
    """Print the per-call table (one process)."""
    import torch

    from soapstone.comm import init
    from soapstone.comm.backends.mpi import MPICommunicator

    world = init("mpi")
    bare = MPICommunicator(world.mpi)
    bare.flight.keep(0)  # the same MPI communicator, nothing recorded per call
    x = torch.zeros(2)
    fns = {("unrecorded", "allreduce"): lambda: bare.allreduce(x),
           ("recorded", "allreduce"): lambda: world.allreduce(x),
           ("unrecorded", "async"): lambda: bare.allreduce(x, async_op=True).wait(),
           ("recorded", "async"): lambda: world.allreduce(x, async_op=True).wait()}
    med = per_call_ns(fns, rounds)
    from soapstone.comm.communicator import TENSOR_READING

    print(f"# the flight recorder per comm call: 1 process, median ns of single calls "
          f"({rounds} rounds of {BLOCK}-call turns); load average {os.getloadavg()[0]:.1f}; "
          f"shapes read through {TENSOR_READING}")
    print(f"{'call':34s} {'unrecorded':>10s} {'recorded':>9s} {'+ns':>6s} {'ratio':>7s}")
    for key, label in (("allreduce", "allreduce 8 B"),
                       ("async", "allreduce 8 B async_op, then wait()")):
        a, b = med[("unrecorded", key)], med[("recorded", key)]
        print(f"{label:34s} {a:10.0f} {b:9.0f} {b - a:+6.0f} {b / a:7.3f}x")
    parts = part_ns(10 * rounds)
    print("# the parts of a recorded call, each alone (ns, lowest of many loops): "
          + "; ".join(f"{k} {v:.0f}" for k, v in parts.items()))


def dp(steps: int) -> None:
    """Print the data-parallel steps with and without recording (2 ranks)."""
    import torch
    from mpi4py import MPI

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dp import batches, soapstone_model

    from soapstone.comm import init
    from soapstone.comm.backends.mpi import MPICommunicator
    from soapstone.comm.observe.flight_recorder import live_recorders

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = init("mpi")

    def build(zero: int, recorded: bool):
        """The train step of one model; `recorded`: its communicators record."""
        if recorded:
            return soapstone_model(zero, world=world)[0]
        old = os.environ.get("SOAPSTONE_FLIGHT_RECORDER")
        os.environ["SOAPSTONE_FLIGHT_RECORDER"] = "0"  # read as each communicator is made
        try:
            return soapstone_model(zero, world=MPICommunicator(MPI.COMM_WORLD))[0]
        finally:
            if old is None:
                os.environ.pop("SOAPSTONE_FLIGHT_RECORDER", None)
            else:
                os.environ["SOAPSTONE_FLIGHT_RECORDER"] = old

    data = batches(steps + 2)
    med: dict[tuple, float] = {}
    ops: dict[tuple, int] = {}
    # one pair at a time (the twins alone in memory), built twice in both orders: the model
    # built second runs up to 4% faster at ZeRO 0 whichever it is (memory placement), so a
    # ratio from one build order measures the order, not the recorder
    for zero in (0, 3):
        for first in ("recorded", "unrecorded"):
            built = {first: build(zero, first == "recorded")}
            second = "unrecorded" if first == "recorded" else "recorded"
            built[second] = build(zero, second == "recorded")
            names = list(built)
            times: dict[str, list[float]] = {k: [] for k in names}
            for i, b in enumerate(data):
                for name in names if i % 2 else names[::-1]:  # ABBA: each first, each after
                    before = sum(r.seq + r.p2p_seq for r in live_recorders() if r.recording)
                    MPI.COMM_WORLD.Barrier()
                    t0 = time.perf_counter()
                    built[name](b)
                    dt = time.perf_counter() - t0
                    ops[zero, name] = sum(r.seq + r.p2p_seq for r in live_recorders()
                                          if r.recording) - before
                    if i >= 2:
                        times[name].append(MPI.COMM_WORLD.allreduce(dt, op=MPI.MAX))
            med |= {(zero, first, k): statistics.median(v) for k, v in times.items()}
            del built
    if MPI.COMM_WORLD.rank == 0:
        print(f"# bench_dp's model, 2 ranks, median of {steps} steps (slowest rank), each model "
              f"and its twin in turn, the pair built in both orders; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'config':42s} {'step ms':>8s} {'recorded calls/step':>20s}")
        for (zero, first, name), v in med.items():
            print(f"{f'zero {zero}, {name} (built {first} first)':42s} {v * 1e3:8.1f} "
                  f"{ops[zero, name]:20d}")
        for z in (0, 3):
            ratios = [med[(z, f, "recorded")] / med[(z, f, "unrecorded")]
                      for f in ("recorded", "unrecorded")]
            print(f"# zero {z}: recorded / unrecorded {math.sqrt(ratios[0] * ratios[1]):.3f}x "
                  f"(built recorded first {ratios[0]:.3f}x, unrecorded first {ratios[1]:.3f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["calls", "dp"])
    ap.add_argument("--rounds", type=int, default=30, help="calls: rounds of turns")
    ap.add_argument("--steps", type=int, default=10, help="dp: timed steps per model")
    args = ap.parse_args()
    if args.what == "calls":
        calls(args.rounds)
    else:
        dp(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
