"""1f1b: PipeDream-flush / Megatron. Rank r runs min(P-r-1, M) warm-up forwards, then
alternates one forward and one backward, then drains the backwards. Bubble (P-1)/(M+P-1), at
most P - r microbatches in flight on rank r."""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """Pipe rank r's compute actions: warm-up forwards, steady F/B pairs, drain."""
    s = at(0)
    warm = min(p - r - 1, m)
    acts = [Action("F", i, s) for i in range(warm)]
    for i in range(m - warm):
        acts += [Action("F", warm + i, s), Action("B", i, s)]
    acts += [Action("B", i, s) for i in range(m - warm, m)]
    return acts


def held(p: int, m: int, r: int) -> int:
    """The warm-up's P-r-1 forwards and the steady state's one more (M at most)."""
    return min(p - r, m)


ONE_F_ONE_B = ScheduleKind("1f1b", actions, planned=(1,), held=held)
