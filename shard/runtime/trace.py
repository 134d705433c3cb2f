"""Pipeline timelines: what each rank computed when, as a Chrome trace, a PNG, a bubble.

Each rank records (kind, microbatch, virtual stage, start, end) for every compute action of a
step, with times in seconds from a barrier at the start of the step (ranks on one machine
share the monotonic clock; across machines the barrier aligns them to within its latency).
`gather` collects every pipe rank's events on each rank; `write_chrome_trace` writes JSON that
Perfetto or chrome://tracing opens (one row per rank); `write_png` draws the schedule with
matplotlib if it is installed (forward, backward and weight gradients in three colours).
"""

from __future__ import annotations

import json
import time

import attrs
import torch

KIND_CODE = {"F": 0, "B": 1, "R": 2, "W": 3}  # R: waiting for a receive; W: weight grads
WORK = ("F", "B", "W")  # the kinds that compute
CODE_KIND = {v: k for k, v in KIND_CODE.items()}


@attrs.frozen
class Event:
    """One action on one rank: kind F | B | W | R (F, B, W as in shard/plan/schedules/
    actions.py; R waiting for a receive), microbatch, virtual stage, start, end (s)."""

    rank: int
    kind: str
    mb: int
    stage: int
    start: float
    end: float


class Timeline:
    """Events of one rank for one step (`begin` resets the clock)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.t0 = time.perf_counter()
        self.events: list[Event] = []

    def begin(self) -> None:
        """Start a new step: clear the events, zero the clock."""
        self.events = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since `begin`."""
        return time.perf_counter() - self.t0

    def record(self, kind: str, mb: int, stage: int, start: float, end: float) -> None:
        """Add one event (times from `now()`)."""
        self.events.append(Event(self.rank, kind, mb, stage, start, end))


def gather(timeline: Timeline, comm) -> list[Event]:
    """Every rank's events (collective over `comm`, the pipe communicator; None: this rank)."""
    rows = [[e.rank, KIND_CODE[e.kind], e.mb, e.stage, e.start, e.end]
            for e in timeline.events]
    if comm is None or comm.size == 1:
        return list(timeline.events)
    count = torch.tensor([float(len(rows))], dtype=torch.float64)
    most = int(comm.allreduce(count.clone(), op="max"))
    t = torch.full((most, 6), -1.0, dtype=torch.float64)
    if rows:
        t[:len(rows)] = torch.tensor(rows, dtype=torch.float64)
    everything = comm.allgather(t, dim=0)
    return [Event(int(r[0]), CODE_KIND[int(r[1])], int(r[2]), int(r[3]), float(r[4]),
                  float(r[5])) for r in everything.tolist() if r[1] >= 0]


def bubble(events: list[Event], ranks: int | None = None) -> float:
    """Measured idle fraction: 1 - compute time / (ranks * span), span from the first start
    to the last end over all ranks."""
    work = [e for e in events if e.kind in WORK]
    if not work:
        return 0.0
    n = ranks or len({e.rank for e in events})
    span = max(e.end for e in work) - min(e.start for e in work)
    busy = sum(e.end - e.start for e in work)
    return max(0.0, 1 - busy / (n * span)) if span > 0 else 0.0


def write_chrome_trace(path, events: list[Event], name: str = "soapstone pipeline") -> None:
    """Chrome trace-event JSON (Perfetto, chrome://tracing): one thread per rank."""
    out = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for r in sorted({e.rank for e in events}):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                    "args": {"name": f"pipe rank {r}"}})
    for e in events:
        label = {"F": "forward", "B": "backward", "W": "weight gradients",
                 "R": "wait"}[e.kind]
        out.append({"name": f"{e.kind}{e.mb}" if e.kind != "R" else "wait", "cat": label,
                    "ph": "X", "pid": 0, "tid": e.rank, "ts": e.start * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "args": {"microbatch": e.mb, "stage": e.stage}})
    with open(path, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


def write_png(path, events: list[Event], title: str = "") -> bool:
    """Draw the timeline (ranks as rows; forward blue, backward orange, weight gradients
    green). Returns False, doing nothing, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    colour = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
    for e in events:
        if e.kind not in colour:
            continue
        ax.barh(e.rank, (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.8,
                color=colour[e.kind], edgecolor="black", linewidth=0.3)
        ax.text((e.start + e.end) / 2 * 1e3, e.rank, f"{e.kind}{e.mb}", ha="center",
                va="center", fontsize=6, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or f"pipeline timeline (bubble {bubble(events):.1%})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
