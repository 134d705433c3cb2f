"""The timing harness of the side-by-side benchmarks (bench/*.py, `soapstone gpu-check`): figures
that hold on a shared machine.

bench_dp, bench_tp, bench_pipe, bench_zb and bench_executor time their implementations
through `interleave`:
- interleaved step by step: every round runs each implementation once, in an order that
  rotates round by round, so no implementation always runs first after the barrier or right
  after the same neighbour, and a load that comes and goes falls on all of them alike;
- at least MIN_STEPS (30) timed steps after the warm-up;
- one step's time is the slowest rank's (MPI MAX), taken between a barrier and the end of the
  step (after a device synchronize on a GPU, where calls return once enqueued);
- reported: the median with its interquartile range, and the load average before and after
  (os.getloadavg: the run queue of the whole machine, which other people's jobs share);
- `compare`: a ratio whose interquartile ranges overlap is a tie, not a win;
- `clock`: wall time by default; `time.process_time` times the CPU each rank's process spent
  in the step (all its threads), which other jobs on a loaded machine disturb far less.
"""

from __future__ import annotations

import enum
import os
import statistics
import time
from collections.abc import Callable

import attrs

MIN_STEPS = 30


class Verdict(enum.Enum):
    """What a ratio of two timings says once their spread is counted."""

    FASTER = "faster"
    SLOWER = "slower"
    TIE = "tie (interquartile ranges overlap)"


@attrs.frozen
class Timing:
    """One implementation's timed steps (seconds, the slowest rank's each)."""

    name: str
    times: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median step."""
        return statistics.median(self.times)

    @property
    def q1(self) -> float:
        """The first quartile."""
        return _quartiles(self.times)[0]

    @property
    def q3(self) -> float:
        """The third quartile."""
        return _quartiles(self.times)[1]

    def text(self) -> str:
        """`123.4 ms (IQR 120.1-130.2)`."""
        return f"{self.median * 1e3:.1f} ms (IQR {self.q1 * 1e3:.1f}-{self.q3 * 1e3:.1f})"

    def to_json(self) -> dict:
        """median, q1, q3 and steps, in seconds."""
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3,
                "steps": len(self.times)}


def _quartiles(times) -> tuple[float, float]:
    if len(times) < 2:
        return times[0], times[0]
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[0], q[2]


@attrs.frozen
class Ratio:
    """`peer` over `ours` (above 1: ours is faster), with the verdict of their spreads."""

    ours: Timing
    peer: Timing

    @property
    def value(self) -> float:
        """peer's median over ours."""
        return self.peer.median / self.ours.median

    @property
    def verdict(self) -> Verdict:
        """A tie when the interquartile ranges overlap, else who is faster."""
        if self.ours.q3 < self.peer.q1:
            return Verdict.FASTER
        if self.peer.q3 < self.ours.q1:
            return Verdict.SLOWER
        return Verdict.TIE

    def text(self) -> str:
        """`1.23x (ours faster)` or `1.02x (tie: ...)`."""
        v = self.verdict
        who = f"{self.ours.name} {v.value}" if v is not Verdict.TIE else v.value
        return f"{self.peer.name} / {self.ours.name} = {self.value:.2f}x ({who})"

    def to_json(self) -> dict:
        """The ratio and its verdict."""
        return {"ours": self.ours.name, "peer": self.peer.name, "ratio": self.value,
                "verdict": self.verdict.name.lower()}


def load_average() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


@attrs.frozen
class Session:
    """What `interleave` measured: a Timing per implementation, every step's return value
    (warm-up included) and the load average before and after."""

    timings: dict[str, Timing]
    values: dict[str, list]
    load_before: float
    load_after: float

    def load_text(self) -> str:
        """`load average 6.1 -> 7.3 on 2 cores`."""
        return (f"load average {self.load_before:.1f} -> {self.load_after:.1f} on "
                f"{os.cpu_count()} cores")

    def compare(self, ours: str, peer: str) -> Ratio:
        """The ratio of two of the timings (peer over ours)."""
        return Ratio(self.timings[ours], self.timings[peer])

    def table(self) -> str:
        """One line per implementation: median, IQR, steps; then the load."""
        width = max(len(n) for n in self.timings)
        rows = [f"  {n:<{width}}  {t.text()}  [{len(t.times)} steps]"
                for n, t in self.timings.items()]
        return "\n".join([*rows, f"  ({self.load_text()})"])

    def to_json(self) -> dict:
        """The timings and the load."""
        return {"timings": {n: t.to_json() for n, t in self.timings.items()},
                "load_before": self.load_before, "load_after": self.load_after,
                "cores": os.cpu_count()}


def interleave(runs: dict[str, Callable[[], object]], steps: int = MIN_STEPS, warmup: int = 2,
               comm=None, sync: Callable[[], None] | None = None,
               after: Callable[[str, int, object], None] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> Session:
    """Run every implementation `warmup + steps` times, one step each per round in a rotating
    order, and time the steps after the warm-up. `comm`: an mpi4py communicator (a barrier
    before each step; the step's time is its slowest rank's), None for one process; `sync`:
    called before the clock is read (a GPU's synchronize); `after(name, step, value)`: called
    on every rank after each step, untimed (per-step figures such as a measured bubble);
    `clock`: what a step's time is read from (default the wall clock).
    ValueError under MIN_STEPS timed steps: fewer do not make a median that holds."""
    if steps < MIN_STEPS:
        raise ValueError(f"steps={steps}: time at least {MIN_STEPS} steps after the warm-up")
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    values: dict[str, list] = {n: [] for n in names}
    before = _agreed_load(comm)
    for i in range(warmup + steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if sync is not None:
                sync()
            if comm is not None:
                comm.Barrier()
            t0 = clock()
            value = runs[name]()
            if sync is not None:
                sync()
            dt = clock() - t0
            if comm is not None:
                from mpi4py import MPI

                dt = comm.allreduce(dt, op=MPI.MAX)
            values[name].append(value)
            if i >= warmup:
                times[name].append(dt)
            if after is not None:
                after(name, i, value)
    timings = {n: Timing(n, tuple(times[n])) for n in names}
    return Session(timings, values, before, _agreed_load(comm))


def _agreed_load(comm) -> float:
    # every rank reports rank 0's reading, so the ranks print the same figures
    load = load_average()
    return comm.bcast(load, root=0) if comm is not None else load
