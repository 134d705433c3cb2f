"""Every pipeline schedule, one line each: what specs may name, and the one place the
checker, the grammar's error messages, the builder, explain and the executor look a schedule
up. A new schedule is its module (a ScheduleKind) and its line here. Pure data: no torch."""

from __future__ import annotations

from soapstone.shard.plan.schedules.dualpipev import DUALPIPEV
from soapstone.shard.plan.schedules.gpipe import GPIPE
from soapstone.shard.plan.schedules.interleaved import INTERLEAVED
from soapstone.shard.plan.schedules.kind import ScheduleError, ScheduleKind
from soapstone.shard.plan.schedules.one_f_one_b import ONE_F_ONE_B
from soapstone.shard.plan.schedules.zb1p import ZB1P
from soapstone.shard.plan.schedules.zbv import ZBV

SCHEDULES: dict[str, ScheduleKind] = {k.name: k for k in (
    GPIPE,
    ONE_F_ONE_B,
    INTERLEAVED,
    ZB1P,
    ZBV,
    DUALPIPEV,
)}
KINDS = tuple(SCHEDULES)  # their names, in the order messages list them
# the schedules whose backward is split into B (input gradient) and W (weights)
SPLIT = tuple(n for n, k in SCHEDULES.items() if k.split)
# the schedules that take `chunks` virtual stages per rank
CHUNKED = tuple(n for n, k in SCHEDULES.items() if k.chunked)


def get(name: str) -> ScheduleKind:
    """The schedule called `name` (ScheduleError naming the known ones otherwise)."""
    k = SCHEDULES.get(name)
    if k is None:
        raise ScheduleError(f"unknown schedule {name!r}; use one of {', '.join(KINDS)}")
    return k


def theory_bubble(name: str, pipe: int, microbatches: int, chunks: int = 1) -> float:
    """Schedule `name`'s idle fraction with equal per-stage work, by its formula: no schedule
    is built, so any size is cheap."""
    return get(name).bubble(pipe, microbatches, chunks)


def equivalent_microbatches(name: str, pipe: int, microbatches: int) -> int:
    """A microbatch count whose schedule keeps the same peaks in flight on every rank as
    `microbatches` does (the schedule's `walked`)."""
    return get(name).walked(pipe, microbatches)
