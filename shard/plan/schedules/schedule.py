"""A built pipeline schedule: per pipe rank, the ordered list of actions it runs.

Compute actions are `F`, `B` and, where the schedule splits the backward, `W`
(actions.py). Communication actions are derived from them (`with_comm`): `RA`/`RG` post a
non-blocking receive of an activation / a gradient, `SA`/`SG` start a non-blocking send. A
receive is posted one compute action before the one that needs it, so it lands while the
rank computes; sends never block (each is let go once complete, the rest waited on at the
end of the step). Which pipe rank runs a virtual stage is the schedule's placement
(placement.py).

`simulate` plays a schedule with given forward/backward durations, proves it cannot deadlock
(every receive is eventually matched) and yields the timeline `format` draws and whose idle
fraction is the schedule's bubble. `build` makes the schedule a ScheduleKind of the registry
describes. Pure data: no torch.
"""

from __future__ import annotations

import functools

import attrs

from soapstone.shard.plan.schedules import registry
from soapstone.shard.plan.schedules.actions import Action, ActionKind
from soapstone.shard.plan.schedules.kind import ScheduleError, ScheduleKind
from soapstone.shard.plan.schedules.send_order import SendOrder


@attrs.frozen
class Schedule:
    """The action lists of every pipe rank (compute only; `with_comm` adds communication)."""

    kind: str
    pipe: int
    microbatches: int
    chunks: int
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        """Number of virtual stages."""
        return self.pipe * self.chunks

    @property
    def spec(self) -> ScheduleKind:
        """The registry's entry for this schedule's kind."""
        return registry.get(self.kind)

    def rank_of(self, stage: int) -> int:
        """The pipe rank running virtual stage `stage` (the schedule's placement)."""
        return self.spec.rank_of(stage, self.pipe)

    def local(self, a: Action) -> bool:
        """Whether communication action `a` joins two stages of one rank (a V's turn: stage
        P-1 hands its output to stage P in memory, no message)."""
        return self.rank_of(a.stage) == self.rank_of(a.kind.peer(a.stage))

    def receive(self, a: Action) -> Action | None:
        """The receive compute action `a` reads (None: no neighbour, or one on this rank)."""
        r = a.receive(self.stages - 1)
        return None if r is None or self.local(r) else r

    def send(self, a: Action) -> Action | None:
        """The send of compute action `a`'s output (None: no neighbour, or one on this
        rank)."""
        r = a.send(self.stages - 1)
        return None if r is None or self.local(r) else r

    @property
    def split(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradients)."""
        return self.spec.split

    @property
    def frees(self) -> ActionKind:
        """The compute after which a microbatch's activations on a stage are released: its
        whole backward, or a split backward's W."""
        return ActionKind.W if self.split else ActionKind.B

    def theory_bubble(self) -> float:
        """The idle fraction with equal per-stage work: (P-1)/(v*M+P-1) (v = chunks), or
        the schedule's own (zb1p's 1 - 3M/max(3M+P-1, 2M+2P-1): zb1p.py)."""
        return self.spec.bubble(self.pipe, self.microbatches, self.chunks)

    def label(self, a: Action) -> str:
        """A compute action as `format` draws it: `F3` = forward of microbatch 3; with
        chunks, `F3:1` names the rank's chunk."""
        s = f"{a.kind}{a.mb}"
        return s + f":{self.spec.chunk_of(a.stage, self.pipe)}" if self.chunks > 1 else s

    def with_comm(self, rank: int, lookahead: int = 1) -> list[Action]:
        """Rank `rank`'s actions with receives posted `lookahead` compute actions early and
        sends right after the compute producing them (or, where the destination reads
        another message from this rank first, right after that one's: send_order.py)."""
        compute = self.ranks[rank]
        recvs = [self.receive(a) for a in compute]
        # a V sends both ways to one rank: send_order.py (None: each send as made)
        order = SendOrder.of(self, rank) if self.spec.send_in_read_order else None
        out: list[Action] = []
        posted = 0
        for i, a in enumerate(compute):
            while posted < len(compute) and posted <= i + lookahead:
                if recvs[posted] is not None:
                    out.append(recvs[posted])
                posted += 1
            out.append(a)
            send = self.send(a)
            sends = [send] if send is not None else []
            out += order.due(sends) if order is not None else sends
        return out + (order.rest() if order is not None else [])

    def simulate(self, fwd: float = 1.0, bwd: float = 2.0) -> list[list[tuple[Action, float,
                                                                                float]]]:
        """Per rank, (compute action, start, end) with per-stage times `fwd` and `bwd` (divided
        by `chunks`: a virtual stage holds 1/chunks of a rank's layers; a split backward's B
        and W take half of `bwd` each) and free communication. Raises ScheduleError if the
        ranks would wait on each other forever."""
        f, b = fwd / self.chunks, bwd / self.chunks
        if self.split:
            b /= 2
        took = {ActionKind.F: f, ActionKind.B: b, ActionKind.W: b}
        last = self.stages - 1
        done: dict[tuple[ActionKind, int, int], float] = {}
        pos = [0] * self.pipe
        clock = [0.0] * self.pipe
        out: list[list[tuple[Action, float, float]]] = [[] for _ in range(self.pipe)]
        remaining = sum(len(r) for r in self.ranks)
        while remaining:
            progressed = False
            for r in range(self.pipe):
                while pos[r] < len(self.ranks[r]):
                    a = self.ranks[r][pos[r]]
                    dep = a.waits_for(last)
                    if dep is not None and dep not in done:
                        break
                    start = max(clock[r], done[dep] if dep else 0.0)
                    end = start + took[a.kind]
                    done[(a.kind, a.mb, a.stage)] = end
                    clock[r] = end
                    out[r].append((a, start, end))
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = ", ".join(f"rank {r} at {self.ranks[r][pos[r]]}" for r in
                                  range(self.pipe) if pos[r] < len(self.ranks[r]))
                raise ScheduleError(f"{self.kind} schedule deadlocks: {stuck}")
        return out

    def simulated_bubble(self, fwd: float = 1.0, bwd: float = 2.0) -> float:
        """Idle fraction of the simulated timeline: 1 - busy / (ranks * makespan)."""
        tl = self.simulate(fwd, bwd)
        span = max(e for row in tl for _, _, e in row)
        busy = sum(e - s for row in tl for _, s, e in row)
        return 1 - busy / (self.pipe * span)

    def format(self) -> str:
        """The schedule drawn as text: ranks as rows, one column per time slot (forward and
        backward each take one slot; a split backward's B and W one each), `F3` = forward of
        microbatch 3, `.` = idle. With chunks, `F3:1` names the rank's chunk."""
        tl = self.simulate(1.0 * self.chunks, (2.0 if self.split else 1.0) * self.chunks)
        label = self.label
        width = max(len(label(a)) for row in self.ranks for a in row) + 1
        span = int(round(max(e for row in tl for _, _, e in row)))
        lines = [f"schedule {self.kind}: pipe={self.pipe} microbatches={self.microbatches}"
                 + (f" chunks={self.chunks}" if self.chunks > 1 else "")
                 + f"  bubble {self.simulated_bubble(1, 2):.1%} (fwd:bwd 1:2), theory "
                 f"{self.theory_bubble():.1%}"]
        for r, row in enumerate(tl):
            cells = ["." .rjust(width)] * span
            for a, s, _ in row:
                cells[int(round(s))] = label(a).rjust(width)
            lines.append(f"  rank {r} |" + "".join(cells))
        return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=256)
def build(kind: str, pipe: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule of `kind` for `pipe` ranks, `microbatches` and `chunks` per rank (a frozen
    value, cached: the planner and explain ask for the same ones often)."""
    spec = registry.get(kind)
    p, m = pipe, microbatches
    if not spec.chunked:
        if chunks not in (1, spec.stages_per_rank):
            raise ScheduleError(f"chunks = {chunks} needs the {' or '.join(registry.CHUNKED)} "
                                "schedule")
        chunks = spec.stages_per_rank  # a V's two stages per rank are its own
    if spec.whole_groups and m % p:
        raise ScheduleError(f"{kind} needs microbatches ({m}) divisible by pipe ({p})")
    if spec.least is not None and m < spec.least(p):
        raise ScheduleError(f"{kind} needs microbatches >= {spec.least(p)} at pipe {p} "
                            f"({spec.why_least}), got {m}")
    ranks = []
    for r in range(p):
        mine = [spec.stage_at(r, c, p) for c in range(chunks)]
        ranks.append(tuple(spec.actions(r, p, m, chunks, mine.__getitem__)))
    sched = Schedule(kind, p, m, chunks, tuple(ranks))
    sched.simulate()  # refuse a schedule that could deadlock
    return sched
