"""zb1p: ZB-H1 of the zero-bubble paper (Qi et al. 2023).

1F1B's warm-up and order with the backward split into B (the input gradient, which the stage
upstream waits for) and W (the weight gradients, which nobody waits for); rank r runs B alone
for its first r backwards and then one W (the oldest pending) after each B, the last r W's at
the end. The B's travel upstream faster than 1F1B's whole backwards and the deferred W's fill
the wait for them, at 1F1B's peak activation memory (every rank holds up to min(P, M)
microbatches until their W, as 1F1B's rank 0 does). Bubble, with per-stage times
F = B = W = 1 (B and W each half of the backward in `simulate`'s cost model): each rank works
3M in a step of length T = max(3M + P-1, 2M + 2P-1), so the idle fraction is 1 - 3M/T. For
M >= P the first term wins: each rank idles (P-1)(F+B-W) = P-1, and the bubble is
(P-1)/(3M+P-1), a third of 1F1B's 3(P-1) units. For M < P no rank reaches a steady F-B-W
rhythm and the chain decides: the last stage runs F,B of every microbatch back to back (from
P-1 to P-1+2M), the last B climbs P-1 stages, and rank 0 ends with its W (`simulate` agrees
for both).
"""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """ZB-H1 for pipe rank r: 1F1B with B and W apart, W deferred by r."""
    s = at(0)
    warm = min(p - r - 1, m)
    acts = [Action("F", i, s) for i in range(warm)]
    done_w = 0
    for k in range(m):  # the k-th backward: after a forward while any are left
        if warm + k < m:
            acts.append(Action("F", warm + k, s))
        acts.append(Action("B", k, s))
        if k >= r:  # r input gradients run ahead of their weight gradients
            acts.append(Action("W", done_w, s))
            done_w += 1
    acts += [Action("W", i, s) for i in range(done_w, m)]
    return acts


def bubble(p: int, m: int, v: int) -> float:
    """1 - 3M/max(3M+P-1, 2M+2P-1) (the module doc)."""
    return 1 - 3 * m / max(3 * m + p - 1, 2 * m + 2 * p - 1)


def formula(p: int, m: int, v: int) -> str:
    """bubble's formula as explain prints it: its steady state needs M >= P."""
    return "(p-1)/(3m+p-1)" if m >= p else "1-3m/(2m+2p-1)"


def walked(p: int, m: int) -> int:
    """From M = P on, every M holds the same microbatches at its peaks (before B, and between
    B and W) as P does (tests/dsl/test_bounded.py walks both)."""
    return min(p, m)


ZB1P = ScheduleKind("zb1p", actions, split=True, needs_stages=True, walked=walked,
                    why_stages="it splits a stage's backward to fill the pipeline's bubble",
                    bubble=bubble, formula=formula)
