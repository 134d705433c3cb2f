"""Pipeline schedules as data: per pipe rank, the ordered list of actions it runs.

Compute actions are `F` (forward of microbatch `mb` through virtual stage `stage`) and `B`
(its backward); a zero-bubble schedule splits the backward in two, `B` (the input gradient,
which the stage upstream waits for) and `W` (the weight gradients, which nobody waits for).
Communication actions are derived from them (`with_comm`): `RA`/`RG` post a non-blocking
receive of an activation / a gradient, `SA`/`SG` start a non-blocking send. A receive is
posted one compute action before the one that needs it, so it lands while the rank computes;
sends never block (each is let go once complete, the rest waited on at the end of the step).
Virtual stage v runs on pipe rank v mod P; chunk c of rank r is virtual stage c*P + r.

- gpipe: all forwards, then all backwards.
- 1f1b: rank r runs min(P-r-1, M) warm-up forwards, then alternates one forward and one
  backward, then drains the backwards (PipeDream-flush / Megatron). Bubble (P-1)/(M+P-1).
- interleaved: Megatron's interleaved 1F1B over `chunks` virtual stages per rank, microbatches
  in groups of P; warm-up (P-r-1)*2 + (chunks-1)*P. Bubble (P-1)/(chunks*M+P-1).
- zb1p: ZB-H1 of the zero-bubble paper (Qi et al. 2023): 1F1B's warm-up and order with the
  backward split into B and W; rank r runs B alone for its first r backwards and
  then one W (the oldest pending) after each B, the last r W's at the end. The B's travel
  upstream faster than 1F1B's whole backwards and the deferred W's fill the wait for them, at
  1F1B's peak activation memory (every rank holds up to min(P, M) microbatches until their
  W, as 1F1B's rank 0 does). Bubble, with per-stage times F = B = W = 1 (B and W each half
  of the backward in `simulate`'s cost model): each rank works 3M in a step of length
  T = max(3M + P-1, 2M + 2P-1), so the idle fraction is 1 - 3M/T. For M >= P the first
  term wins: each rank idles (P-1)(F+B-W) = P-1, and the bubble is (P-1)/(3M+P-1), a third
  of 1F1B's 3(P-1) units. For M < P no rank reaches a steady F-B-W rhythm and the chain
  decides: the last stage runs F,B of every microbatch back to back (from P-1 to P-1+2M),
  the last B climbs P-1 stages, and rank 0 ends with its W (`simulate` agrees for both).

`simulate` plays a schedule with given forward/backward durations, proves it cannot deadlock
(every receive is eventually matched) and yields the timeline `format` draws and whose idle
fraction is the schedule's bubble.
"""

from __future__ import annotations

import functools

import attrs

from soapstone.comm.errors import UserError

KINDS = ("gpipe", "1f1b", "interleaved", "zb1p")
# the schedules whose backward is split into B (input gradient) and W (weights)
SPLIT = ("zb1p",)


class ScheduleError(UserError, ValueError):
    """A schedule that is malformed or would deadlock."""


@attrs.frozen
class Action:
    """kind: F | B | W (compute; B is the whole backward, or only the input gradient where
    W follows), RA | RG (post receive of activation / gradient), SA | SG (send)."""

    kind: str
    mb: int
    stage: int  # virtual stage

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@{self.stage}"


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

    def rank_of(self, stage: int) -> int:
        """The pipe rank running virtual stage `stage`."""
        return stage % self.pipe

    @property
    def split(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradients)."""
        return self.kind in SPLIT

    def theory_bubble(self) -> float:
        """The idle fraction with equal per-stage work: (P-1)/(v*M+P-1) (v = chunks), or
        zb1p's 1 - 3M/max(3M+P-1, 2M+2P-1) (F = B = W; the module doc)."""
        p, m, v = self.pipe, self.microbatches, self.chunks
        if self.split:
            return 1 - 3 * m / max(3 * m + p - 1, 2 * m + 2 * p - 1)
        return (p - 1) / (v * m + p - 1)

    def with_comm(self, rank: int, lookahead: int = 1) -> list[Action]:
        """Rank `rank`'s actions with receives posted `lookahead` compute actions early and
        sends right after the compute producing them."""
        compute = self.ranks[rank]
        last = self.stages - 1
        recvs = [self._recv_of(a, last) for a in compute]
        out: list[Action] = []
        posted = 0
        for i, a in enumerate(compute):
            while posted < len(compute) and posted <= i + lookahead:
                if recvs[posted] is not None:
                    out.append(recvs[posted])
                posted += 1
            out.append(a)
            if a.kind == "F" and a.stage < last:
                out.append(Action("SA", a.mb, a.stage))
            elif a.kind == "B" and a.stage > 0:
                out.append(Action("SG", a.mb, a.stage))
        return out

    @staticmethod
    def _recv_of(a: Action, last: int) -> Action | None:
        if a.kind == "F" and a.stage > 0:
            return Action("RA", a.mb, a.stage)
        if a.kind == "B" and a.stage < last:
            return Action("RG", a.mb, a.stage)
        return None

    def simulate(self, fwd: float = 1.0, bwd: float = 2.0) -> list[list[tuple[Action, float,
                                                                                float]]]:
        """Per rank, (compute action, start, end) with per-stage times `fwd` and `bwd` (divided
        by `chunks`: a virtual stage holds 1/chunks of a rank's layers; a split backward's B
        and W take half of `bwd` each) and free communication. Raises ScheduleError if the
        ranks would wait on each other forever."""
        f, b = fwd / self.chunks, bwd / self.chunks
        if self.split:
            b /= 2
        took = {"F": f, "B": b, "W": b}
        last = self.stages - 1
        done: dict[tuple[str, int, int], float] = {}
        pos = [0] * self.pipe
        clock = [0.0] * self.pipe
        out: list[list[tuple[Action, float, float]]] = [[] for _ in range(self.pipe)]
        remaining = sum(len(r) for r in self.ranks)
        while remaining:
            progressed = False
            for r in range(self.pipe):
                while pos[r] < len(self.ranks[r]):
                    a = self.ranks[r][pos[r]]
                    if a.kind == "F":
                        dep = ("F", a.mb, a.stage - 1) if a.stage > 0 else None
                    elif a.kind == "W":  # its own B, on this rank
                        dep = ("B", a.mb, a.stage)
                    else:
                        dep = ("B", a.mb, a.stage + 1) if a.stage < last else ("F", a.mb, last)
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

        def label(a: Action) -> str:
            s = f"{a.kind}{a.mb}"
            return s + f":{a.stage // self.pipe}" if self.chunks > 1 else s

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
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule {kind!r}; use one of {', '.join(KINDS)}")
    p, m = pipe, microbatches
    if kind != "interleaved" and chunks != 1:
        raise ScheduleError(f"chunks = {chunks} needs the interleaved schedule")
    if kind == "interleaved" and m % p:
        raise ScheduleError(f"interleaved needs microbatches ({m}) divisible by pipe ({p})")
    ranks = []
    for r in range(p):
        if kind == "zb1p":
            acts = _zb1p(r, p, m)
        elif kind == "gpipe":
            acts = [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
        elif kind == "1f1b":
            warm = min(p - r - 1, m)
            acts = [Action("F", i, r) for i in range(warm)]
            for i in range(m - warm):
                acts += [Action("F", warm + i, r), Action("B", i, r)]
            acts += [Action("B", i, r) for i in range(m - warm, m)]
        else:
            acts = _interleaved(r, p, m, chunks)
        ranks.append(tuple(acts))
    sched = Schedule(kind, p, m, chunks, tuple(ranks))
    sched.simulate()  # refuse a schedule that could deadlock
    return sched


def _interleaved(r: int, p: int, m: int, chunks: int) -> list[Action]:
    total = m * chunks

    def unit(k: int, backward: bool) -> Action:
        group, within = divmod(k, p * chunks)
        chunk = within // p
        if backward:
            chunk = chunks - 1 - chunk
        mb = group * p + within % p
        return Action("B" if backward else "F", mb, chunk * p + r)

    warm = min((p - r - 1) * 2 + (chunks - 1) * p, total)
    acts = [unit(k, False) for k in range(warm)]
    for i in range(total - warm):
        acts += [unit(warm + i, False), unit(i, True)]
    acts += [unit(k, True) for k in range(total - warm, total)]
    return acts


def _zb1p(r: int, p: int, m: int) -> list[Action]:
    """ZB-H1 for pipe rank r (the module doc): 1F1B with B and W apart, W deferred by r."""
    warm = min(p - r - 1, m)
    acts = [Action("F", i, r) for i in range(warm)]
    done_w = 0
    for k in range(m):  # the k-th backward: after a forward while any are left
        if warm + k < m:
            acts.append(Action("F", warm + k, r))
        acts.append(Action("B", k, r))
        if k >= r:  # r input gradients run ahead of their weight gradients
            acts.append(Action("W", done_w, r))
            done_w += 1
    acts += [Action("W", i, r) for i in range(done_w, m)]
    return acts
