"""gpipe: all forwards, then all backwards (every microbatch's activations held at once)."""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """Pipe rank r's compute actions: F of every microbatch, then B of every one."""
    s = at(0)
    return [Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]


def held(p: int, m: int, r: int) -> int:
    """Every microbatch is in flight after the last forward."""
    return m


GPIPE = ScheduleKind("gpipe", actions, held=held)
