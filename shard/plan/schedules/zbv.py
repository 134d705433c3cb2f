"""zbv: ZB-V of the zero-bubble paper (Qi et al. 2023, section 6; torch's
ScheduleZBVZeroBubble orders it the same way).

Two virtual stages per rank in a V (placement.v_shape): rank r holds stage r (chunk 0, on
the way down) and stage 2P-1-r (chunk 1, on the way back), so rank 0 holds the first stage
and the loss, and the last rank holds the turn (stages P-1 and P, handed over in memory).
The backward is split into B (input gradient) and W (weight gradients), as zb1p's. Rank r
runs: 2(P-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); P-r triples (F, B, W of
chunk 1); the steady state, F B W of chunk 0 then F B W of chunk 1, while forwards are left;
the cool-down, r pairs (B chunk 0, B chunk 1), P-r pairs (B chunk 0, the oldest W chunk 0),
then the W's left, chunk 1's first. It is built for max(M, 2P-1) microbatches (the fewest
that fill the V) and the actions of microbatches >= M dropped, so any M runs.

Memory: a rank holds at most 2P microbatch-chunks of activations, each half a rank's layers:
P microbatches' worth, zb1p's and 1F1B's rank-0 peak. Bubble, with per-chunk times
F = B = W = 1 (`simulate`'s cost model: a chunk is half a rank's layers): each rank works 6M
in a step of T = max(6M + P-1, 4M + 4P-2), so the idle fraction is 1 - 6M/T. Once
2M >= 3P-1 the first term wins: the steady state has no bubble (the paper's
(P-1)(F+B-2W) = 0) and each rank idles only the P-1 chunk-forwards the last rank waits for
the first microbatch to come down, which the deferred W's cannot fill: (P-1)/(6M+P-1), half
of zb1p's (P-1)/(3M+P-1). With fewer microbatches the V's chain decides (`simulate` agrees
for both, tests/shard/pipeline/test_zbv.py).
"""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind
from soapstone.shard.plan.schedules.placement import v_shape


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """ZB-V for pipe rank r (the module doc's phases)."""
    n = max(m, 2 * p - 1)
    down, back = at(0), at(1)
    acts: list[Action] = []
    count = {(k, s): 0 for k in "FBW" for s in (down, back)}

    def run(kind: str, stage: int) -> None:
        acts.append(Action(kind, count[(kind, stage)], stage))
        count[(kind, stage)] += 1

    for _ in range(2 * (p - r) - 1):
        run("F", down)
    for _ in range(r):
        run("F", back)
        run("F", down)
    for _ in range(p - r):
        for k in "FBW":
            run(k, back)
    while count[("F", back)] < count[("F", down)] or count[("F", down)] < n:
        if count[("F", down)] < n:
            run("F", down)
        for stage, kinds in ((down, "BW"), (back, "FBW")):
            for k in kinds:
                run(k, stage)
    for _ in range(r):
        run("B", down)
        run("B", back)
    for _ in range(p - r):
        run("B", down)
        run("W", down)
    for stage in (back, down):
        while count[("W", stage)] < count[("B", stage)]:
            run("W", stage)
    return [a for a in acts if a.mb < m]


def bubble(p: int, m: int, v: int) -> float:
    """1 - 6M/max(6M+P-1, 4M+4P-2) (the module doc)."""
    return 1 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)


def formula(p: int, m: int, v: int) -> str:
    """bubble's formula as explain prints it: its steady state needs 2M >= 3P-1."""
    return "(p-1)/(6m+p-1)" if 2 * m >= 3 * p - 1 else "1-6m/(4m+4p-2)"


def walked(p: int, m: int) -> int:
    """From M = 2P on, every M holds the same microbatch-chunks at its peaks as 2P does
    (tests/shard/pipeline/test_zbv.py walks both)."""
    return min(m, 2 * p)


ZBV = ScheduleKind("zbv", actions, place=v_shape, split=True, needs_stages=True,
                   stages_per_rank=2, send_in_read_order=True, bubble=bubble, formula=formula,
                   walked=walked,
                   why_stages="it places two stages per rank in a V and splits their backward",
                   memory="parameters 1x (one copy of each stage); activations of at most 2P "
                   "microbatch-chunks per rank, P microbatches' worth (1F1B's rank-0 peak)")
