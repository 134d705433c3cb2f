"""What a pipe rank holds in flight under a schedule, and its peak with the working set: per
virtual stage, the microbatches between their F and their B (and, where the backward is
split, between B and W), at each of the rank's actions, and the bytes that makes with that
action's own working set on top (explain's pipeline memory, the planner's fit).

The peak is taken per action, never as the most held plus the largest working set: a large
working set (the last stage's logits and their gradient) may come when little is held. At an
F, what is held after it (its microbatch's saves are all made by its end) and the forward's
working set; at a B, what is held before it (its microbatch's saves are read to its end)
and the backward's. Where the backward is split, B's and W's own (activations.py's Phases):
at a B, what is held before it and B's, which ends with the gradients it keeps for W; at a
W, what is held before it (its microbatch's saved bytes and kept gradients) and W's.

A schedule of a hypothetical layout is never built whole: one stage per rank has a closed
form (its ScheduleKind's `held`), the others walk a schedule of as few microbatches as keep
the same peaks (its `walked`), so M = 1e9 costs what M = 4P does. Pure data: no torch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from soapstone.shard.plan import schedules

# an action's phase: whose working set it runs with (a whole backward, or a split one's B
# or W), the index into a stage's working sets
FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3


class ScheduleShape(NamedTuple):
    """A schedule's name and size, for what has closed forms (never built: M may be 1e9)."""

    kind: str
    pipe: int
    microbatches: int
    chunks: int


class Peak(NamedTuple):
    """A pipe rank's peak: the bytes held in flight at the action where held + working set
    is largest, that action's working set, and the most microbatches in flight per stage."""

    held: int
    working: int
    live: dict[int, int]


def in_flight(schedule, rank: int, act: dict[int, int], sent: dict[int, int] | None = None,
              kept: dict[int, int] | None = None,
              work: dict[int, tuple[int, ...]] | None = None) -> Peak:
    """The peak of pipe rank `rank` under `schedule` (a built Schedule or a ScheduleShape),
    as the executor keeps its microbatches, per virtual stage s: from a microbatch's F to its
    B, act[s] (saved for backward) and sent[s] (the outputs s sends forward, stored for its
    B); where the backward is split, from B to W, act[s] and kept[s] (the gradients B keeps
    for W). work[s]: s's (forward, backward[, B, W]) working sets (none: 0; no B and W:
    the backward's), added at each action of s to what is held then (module doc)."""
    sent, kept, work = sent or {}, kept or {}, work or {}
    snapshots, peak_live = live_in_flight(schedule.kind, schedule.pipe,
                                          schedule.microbatches, schedule.chunks, rank)
    best = (0, 0)
    each: dict[int, tuple[int, int]] = {}  # per stage: bytes before its B, between B and W
    for phase, stage, snap in snapshots:
        held = 0
        for s, n, w in snap:
            if s not in each:
                a = act.get(s, 0)
                each[s] = (a + sent.get(s, 0), a + kept.get(s, 0))
            before_b, before_w = each[s]
            held += n * before_b + w * before_w
        ws = work.get(stage, (0, 0))
        ws = ws[phase] if phase < len(ws) else ws[BACKWARD]
        best = max(best, (held + ws, held))
    return Peak(best[1], best[0] - best[1], dict(peak_live))


@functools.lru_cache(maxsize=4096)
def live_in_flight(kind: str, pipe: int, m: int, chunks: int, rank: int):
    """`walk_in_flight`'s answer for any M without a walk over M: a schedule with one stage
    per rank and a closed form for what its stage holds (its `held`: gpipe M, 1f1b
    min(P-r, M)) answers at once (held after its last warm-up F and before the B that
    follows); the others walk a schedule of as few microbatches as keep the same peaks (their
    `walked`). Cached: the planner asks for many layouts."""
    spec = schedules.get(kind)
    if chunks == 1 and spec.held is not None:
        stage, n = spec.stage_at(rank, 0, pipe), spec.held(pipe, m, rank)
        return (((FORWARD, stage, ((stage, n, 0),)), (BACKWARD, stage, ((stage, n, 0),))),
                ((stage, n),))
    return walk_in_flight(kind, pipe, spec.walked(pipe, m), chunks, rank)


def walk_in_flight(kind: str, pipe: int, m: int, chunks: int, rank: int):
    """Walking rank `rank`'s F/B/W actions: at each, its phase, its stage and per stage the
    microbatches before their B and those between B and W, as the module doc takes them
    (per phase and stage only the snapshots no other dominates: bytes are >= 0, so the peak
    is at one of them), sorted; and the peak in flight per stage."""
    before_b: dict[int, int] = {}
    before_w: dict[int, int] = {}
    peak_live: dict[int, int] = {}
    snaps: set[tuple[int, int, tuple[tuple[int, int, int], ...]]] = set()
    sched = schedules.build(kind, pipe, m, chunks)
    F, B = schedules.ActionKind.F, schedules.ActionKind.B

    def snap(phase: int, stage: int) -> None:
        snaps.add((phase, stage, tuple((t, n, before_w.get(t, 0))
                                       for t, n in sorted(before_b.items()))))

    for a in sched.ranks[rank]:
        s = a.stage
        if a.kind is F:
            before_b[s] = before_b.get(s, 0) + 1
            snap(FORWARD, s)
        elif a.kind is B:
            snap(INPUT_GRAD if sched.split else BACKWARD, s)
            before_b[s] -= 1
            if sched.split:  # its saved values stay until W, beside the gradients it keeps
                before_w[s] = before_w.get(s, 0) + 1
        else:
            snap(WEIGHT_GRAD, s)
            before_w[s] -= 1
        peak_live[s] = max(peak_live.get(s, 0), before_b.get(s, 0) + before_w.get(s, 0))
    return undominated(snaps), tuple(peak_live.items())


def undominated(snaps) -> tuple:
    """Of (phase, stage, per-stage counts) snapshots, those no other of the same phase and
    stage holds at least as many of in every count of, sorted."""
    keep: dict[tuple[int, int], list[dict[int, tuple[int, int]]]] = {}
    # by total, largest first: a dominating one comes first
    for phase, stage, x in sorted(snaps, key=lambda x: -sum(n + w for _, n, w in x[2])):
        mine = keep.setdefault((phase, stage), [])
        if not any(all(n <= y.get(s, (0, 0))[0] and w <= y.get(s, (0, 0))[1]
                       for s, n, w in x) for y in mine):
            mine.append({s: (n, w) for s, n, w in x})
    return tuple(sorted((phase, stage, tuple((s, n, w) for s, (n, w) in sorted(y.items())))
                        for (phase, stage), ys in keep.items() for y in ys))
