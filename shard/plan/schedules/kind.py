"""What one schedule module supplies: a ScheduleKind, its line in the registry.

A schedule is its action lists (`actions`: per pipe rank, the ordered compute actions), the
placement of its virtual stages on pipe ranks (`place`), and the few facts the checker, the
builder, explain and the executor ask of it instead of testing its name: whether its backward
is split into B and W, whether it takes `chunks` virtual stages per rank, whether it needs
pipeline stages, its theoretical bubble and that formula's text, and whether the planner
tries it. Pure data: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from soapstone.comm.errors import UserError
from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.placement import round_robin


class ScheduleError(UserError, ValueError):
    """A schedule that is malformed or would deadlock."""


def staggered_bubble(p: int, m: int, v: int) -> float:
    """(p-1)/(v*m+p-1): GPipe's and 1F1B's idle fraction, interleaved's with v chunks."""
    return (p - 1) / (v * m + p - 1)


def staggered_formula(p: int, m: int, v: int) -> str:
    """staggered_bubble's formula as explain prints it."""
    return "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)"


def every_microbatch(p: int, m: int) -> int:
    """The microbatches a walk of the schedule needs to find its peaks in flight: all of them
    (the kinds explain has a closed form for never walk at all)."""
    return m


# (rank, pipe, microbatches, chunks, at) -> the rank's compute actions, where at(c) is the
# virtual stage of the rank's chunk c under the schedule's placement
Builder = Callable[[int, int, int, int, Callable[[int], int]], list[Action]]


@attrs.frozen
class ScheduleKind:
    """One schedule: its name in specs, its action lists, its placement and its facts."""

    name: str
    actions: Builder
    # stage -> (pipe rank, chunk): placement.py
    place: Callable[[int, int], tuple[int, int]] = round_robin
    split: bool = False  # the backward is split into B (input gradient) and W (weights)
    chunked: bool = False  # takes `chunks` >= 2 virtual stages per rank
    whole_groups: bool = False  # runs microbatches in groups of `pipe`: m % pipe == 0
    needs_stages: bool = False  # refuses a layout without pipeline stages
    why_stages: str = ""  # why, for the checker's message
    bubble: Callable[[int, int, int], float] = staggered_bubble  # (p, m, chunks) -> idle
    formula: Callable[[int, int, int], str] = staggered_formula  # its text, for explain
    planned: tuple[int, ...] = ()  # the chunk counts `soapstone plan` tries (none: not tried)
    # (p, m) -> a microbatch count with the same peaks in flight on every rank: what a walk
    # of a huge M builds instead (explain, plan and the fit check never build one of M = 1e9)
    walked: Callable[[int, int], int] = every_microbatch
    # (p, m, rank) -> the microbatches a rank's one stage holds at its peak, in closed form
    # (None: walk); read with one chunk per rank and an unsplit backward
    held: Callable[[int, int, int], int] | None = None
    # virtual stages per rank of a kind that is not `chunked` (a V: 2, fixed by its placement)
    stages_per_rank: int = 1
    # pipe -> the fewest microbatches it takes, and why (the checker's message); None: any
    least: Callable[[int], int] | None = None
    why_least: str = ""
    memory: str = ""  # what explain says of its memory, beside the figures (published forms)
    # it sends both ways to one neighbour (a V): each send waits until its reader reads it
    # next (send_order.py) and the `ordered` p2p grouping is tried; the others keep their
    # sends as made, so the verifier still refuses ranks that disagree on the order
    send_in_read_order: bool = False

    def per_rank(self, chunks: int) -> int:
        """Virtual stages per rank: `chunks` for a chunked kind, else its own count."""
        return chunks if self.chunked else self.stages_per_rank

    def rank_of(self, stage: int, pipe: int) -> int:
        """The pipe rank holding virtual stage `stage`."""
        return self.place(stage, pipe)[0]

    def chunk_of(self, stage: int, pipe: int) -> int:
        """Which of its rank's chunks virtual stage `stage` is."""
        return self.place(stage, pipe)[1]

    def stage_at(self, rank: int, chunk: int, pipe: int) -> int:
        """The virtual stage that is chunk `chunk` of pipe rank `rank` (place's inverse)."""
        for v in range((chunk + 1) * pipe):
            if self.place(v, pipe) == (rank, chunk):
                return v
        raise ScheduleError(f"schedule {self.name}: no virtual stage is chunk {chunk} of pipe "
                            f"rank {rank} (pipe = {pipe})")

    def ranks(self, pipe: int, chunks: int) -> list[int]:
        """The pipe rank of every virtual stage, in stage order."""
        return [self.rank_of(v, pipe) for v in range(pipe * chunks)]
