"""What a pipe rank holds in flight under a schedule: per virtual stage, the microbatches
between their F and their B (and, where the backward is split, between B and W), at the
moments that can be the rank's peak, and the bytes that makes (explain's pipeline memory,
the planner's fit). A schedule of a hypothetical layout is never built whole: one stage per
rank has a closed form (its ScheduleKind's `held`), the others walk a schedule of as few
microbatches as keep the same peaks (its `walked`), so M = 1e9 costs what M = 4P does.
Pure data: no torch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from soapstone.shard.plan import schedules


class ScheduleShape(NamedTuple):
    """A schedule's name and size, for what has closed forms (never built: M may be 1e9)."""

    kind: str
    pipe: int
    microbatches: int
    chunks: int


def in_flight(schedule, rank: int, act: dict[int, int], sent: dict[int, int] | None = None,
              kept: dict[int, int] | None = None) -> tuple[int, dict[int, int]]:
    """Peak bytes of the microbatches pipe rank `rank` holds under `schedule` (a built
    Schedule or a ScheduleShape), as the executor keeps them, per virtual stage s: from a
    microbatch's F to its B, act[s] (saved for backward) and sent[s] (the outputs s sends
    forward, stored for its B); where the backward is split, from B to W, act[s] and kept[s]
    (the gradients B keeps for W). And the peak number in flight (F done, the backward's last
    part not) per stage."""
    sent, kept = sent or {}, kept or {}
    snapshots, peak_live = live_in_flight(schedule.kind, schedule.pipe,
                                          schedule.microbatches, schedule.chunks, rank)
    peak = max((sum(n * (act.get(s, 0) + sent.get(s, 0)) + w * (act.get(s, 0) + kept.get(s, 0))
                    for s, n, w in snap) for snap in snapshots), default=0)
    return peak, dict(peak_live)


@functools.lru_cache(maxsize=4096)
def live_in_flight(kind: str, pipe: int, m: int, chunks: int, rank: int):
    """`walk_in_flight`'s answer for any M without a walk over M: a schedule with one stage
    per rank and a closed form for what its stage holds (its `held`: gpipe M, 1f1b
    min(P-r, M)) answers at once; the others walk a schedule of as few microbatches as keep
    the same peaks (their `walked`). Cached: the planner asks for many layouts."""
    spec = schedules.get(kind)
    if chunks == 1 and spec.held is not None:
        stage, n = spec.stage_at(rank, 0, pipe), spec.held(pipe, m, rank)
        return (((stage, n, 0),),), ((stage, n),)
    return walk_in_flight(kind, pipe, spec.walked(pipe, m), chunks, rank)


def walk_in_flight(kind: str, pipe: int, m: int, chunks: int, rank: int):
    """Walking rank `rank`'s F/B/W actions: after each F (and each B of a split backward),
    per stage, the microbatches before their B and those between B and W (only snapshots no
    other dominates: bytes are >= 0, so the peak is at one of them), and the peak in flight
    per stage."""
    before_b: dict[int, int] = {}
    before_w: dict[int, int] = {}
    peak_live: dict[int, int] = {}
    snaps: set[tuple[tuple[int, int, int], ...]] = set()
    sched = schedules.build(kind, pipe, m, chunks)
    F, B = schedules.ActionKind.F, schedules.ActionKind.B
    for a in sched.ranks[rank]:
        s = a.stage
        if a.kind is F:
            before_b[s] = before_b.get(s, 0) + 1
        elif a.kind is B:
            before_b[s] -= 1
            if sched.split:  # its saved values stay until W
                before_w[s] = before_w.get(s, 0) + 1
        else:
            before_w[s] -= 1
        peak_live[s] = max(peak_live.get(s, 0), before_b[s] + before_w.get(s, 0))
        if a.kind is F or (a.kind is B and sched.split):
            snaps.add(tuple((t, n, before_w.get(t, 0)) for t, n in sorted(before_b.items())))

    keep: list[dict[int, tuple[int, int]]] = []  # by total, largest first: a dominating one
    for x in sorted(snaps, key=lambda x: -sum(n + w for _, n, w in x)):  # comes first
        if not any(all(n <= y.get(s, (0, 0))[0] and w <= y.get(s, (0, 0))[1]
                       for s, n, w in x) for y in keep):
            keep.append({s: (n, w) for s, n, w in x})
    return (tuple(tuple((s, n, w) for s, (n, w) in y.items()) for y in keep),
            tuple(peak_live.items()))
