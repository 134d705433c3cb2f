"""interleaved: Megatron's interleaved 1F1B over `chunks` virtual stages per rank,
microbatches in groups of P; warm-up (P-r-1)*2 + (chunks-1)*P. Bubble (P-1)/(chunks*M+P-1)."""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """Pipe rank r's compute actions: 1F1B over its units (a microbatch through one chunk),
    forwards chunk by chunk, backwards in the reverse chunk order."""
    total = m * chunks

    def unit(k: int, backward: bool) -> Action:
        group, within = divmod(k, p * chunks)
        chunk = within // p
        if backward:
            chunk = chunks - 1 - chunk
        mb = group * p + within % p
        return Action("B" if backward else "F", mb, at(chunk))

    warm = min((p - r - 1) * 2 + (chunks - 1) * p, total)
    acts = [unit(k, False) for k in range(warm)]
    for i in range(total - warm):
        acts += [unit(warm + i, False), unit(i, True)]
    acts += [unit(k, True) for k in range(total - warm, total)]
    return acts


def walked(p: int, m: int) -> int:
    """Its pattern is periodic once M >= 2P (tests/dsl/test_bounded.py checks
    it), so the microbatches in flight at every peak of a huge M are those of 4P."""
    return 4 * p if m > 4 * p else m


INTERLEAVED = ScheduleKind("interleaved", actions, chunked=True, whole_groups=True,
                           needs_stages=True, planned=(2, 4), walked=walked)
