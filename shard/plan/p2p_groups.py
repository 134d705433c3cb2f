"""Pipeline p2p in groups, for NCCL's in-order semantics, and the rendezvous that proves it.

NCCL has no tags: on each rank its sends and receives run in issue order on one stream, a
send completes only together with its receive (a rendezvous), and between two ranks the n-th
message sent is the n-th received. Posting every receive ahead (schedules.with_comm, matched
by MPI tag) would leave two neighbours each waiting in a receive whose send sits behind it.

So a rank issues its p2p in *groups*: the sends of one compute action (right after it) and
the receive of the next (just before it, at its consumption point) with no compute between
them go out together, as Megatron's send_forward_recv_backward does in one batch_isend_irecv
(one ncclGroupStart/End). `rank_plan` turns a schedule's compute list into compute actions
and Groups; `simulate` plays every rank's plan under the strictest reading of NCCL:

- each rank issues its groups in order and stays in a group until it completes; compute
  actions are instantaneous (they wait only for the group before them);
- a group completes when every op in it is matched by the peer's op in the peer's current
  or an already issued group, pairing per (src, dst) in FIFO order, without tags.

A plan it runs to the end cannot deadlock on NCCL (the GPU is looser: compute after a
send-only group and the host run on while it is in flight, which only removes waits), and
`check_fifo` proves that the n-th send from a to b carries the same (direction, microbatch,
edge, tensor) as the n-th receive b posts from a. `prove` does both for a schedule's training
step and its forward-only (infer) step. Pure data: no torch.
"""

from __future__ import annotations

import functools

import attrs

from soapstone.shard.plan.schedules import Action, Schedule


@attrs.frozen
class P2P:
    """One message of a group: `action` (RA | RG | SA | SG) over `edge` with pipe rank
    `peer`; `direction` A (activation, downstream) or G (gradient, upstream)."""

    action: Action
    peer: int
    edge: int

    @property
    def sending(self) -> bool:
        """Whether this op sends (SA, SG) rather than receives."""
        return self.action.kind[0] == "S"

    @property
    def direction(self) -> str:
        """A (an activation) or G (a gradient)."""
        return self.action.kind[1]

    def __str__(self) -> str:
        way = "to" if self.sending else "from"
        return f"{self.action} ({'send' if self.sending else 'recv'} edge {self.edge} " \
               f"{way} rank {self.peer})"


@attrs.frozen
class Group:
    """Sends and receives issued together (one NCCL group): sends first, in the order of the
    actions producing them, then the receive of the compute action that follows."""

    ops: tuple[P2P, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(o.action) for o in self.ops) + "]"


Item = Action | Group


def p2p_of(sched: Schedule, a: Action) -> P2P:
    """The message a communication action (RA, RG, SA, SG) of `sched` moves."""
    s = a.stage
    edge, other = {"SA": (s, s + 1), "RA": (s - 1, s - 1), "SG": (s - 1, s - 1),
                   "RG": (s, s + 1)}[a.kind]
    return P2P(a, sched.rank_of(other), edge)


def _recv_of(sched: Schedule, a: Action) -> Action | None:
    last = sched.stages - 1
    if a.kind == "F" and a.stage > 0:
        return Action("RA", a.mb, a.stage)
    if a.kind == "B" and a.stage < last:
        return Action("RG", a.mb, a.stage)
    return None


def _sends_of(sched: Schedule, a: Action) -> list[Action]:
    last = sched.stages - 1
    if a.kind == "F" and a.stage < last:
        return [Action("SA", a.mb, a.stage)]
    if a.kind == "B" and a.stage > 0:
        return [Action("SG", a.mb, a.stage)]
    return []


GROUPINGS = ("consume", "pairs")


def _units(sched: Schedule, compute: list[Action], grouping: str) -> list[list[Action]]:
    """The compute actions cut where groups go: one action per unit (consume), or a
    steady-state forward with the backward after it (pairs) unless that backward's gradient
    comes from this very forward (same microbatch, at or below its stage); a W joins the unit
    before it (it neither sends nor receives)."""
    units: list[list[Action]] = []
    for a in compute:
        prev = units[-1] if units else None
        if prev is not None and (a.kind == "W" or (
                grouping == "pairs" and a.kind == "B" and len(prev) == 1
                and prev[0].kind == "F" and not (a.mb == prev[0].mb
                                                 and a.stage >= prev[0].stage))):
            prev.append(a)
        else:
            units.append([a])
    return units


@functools.lru_cache(maxsize=512)
def rank_plan(sched: Schedule, rank: int, forward_only: bool = False,
              grouping: str = "consume") -> tuple[Item, ...]:
    """Pipe rank `rank`'s compute actions with its p2p in Groups: before each unit of compute
    (`_units`) one group, the sends of the unit before it and the receives the unit reads,
    and the last sends at the end. consume: Megatron's 1F1B (each receive just before the
    action reading it); pairs: Megatron's interleaved steady state (a forward and a backward
    run back to back, their sends and the next pair's receives in one group).
    forward_only: the forward actions alone (Executor.infer)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping {grouping!r}: use one of {GROUPINGS}")
    compute = [a for a in sched.ranks[rank] if not forward_only or a.kind == "F"]
    out: list[Item] = []
    pending: list[Action] = []  # sends of the unit just run
    weights: list[Action] = []  # its trailing W actions
    for unit in _units(sched, compute, grouping):
        ops = pending + [r for r in (_recv_of(sched, a) for a in unit) if r is not None]
        if ops:
            out.append(Group(tuple(p2p_of(sched, x) for x in ops)))
        # a W runs after the group carrying its unit's sends, not before: zb1p's point is that
        # B's input gradient leaves at once while W fills the wait (W has no p2p, so the
        # order of groups, which is what the proof checks, is the same)
        out.extend(weights)
        k = len(unit)
        while k and unit[k - 1].kind == "W":
            k -= 1
        out.extend(unit[:k])
        weights = unit[k:]
        pending = [s for a in unit for s in _sends_of(sched, a)]
    if pending:
        out.append(Group(tuple(p2p_of(sched, x) for x in pending)))
    out.extend(weights)
    return tuple(out)


def plans(sched: Schedule, forward_only: bool = False,
          grouping: str = "consume") -> dict[int, tuple[Item, ...]]:
    """Every pipe rank's rank_plan."""
    return {r: rank_plan(sched, r, forward_only, grouping) for r in range(sched.pipe)}


@attrs.frozen
class Stuck:
    """A rank that cannot finish: the group it waits in and its ops without a partner."""

    rank: int
    position: int  # the group's index in the rank's plan
    group: Group
    unmatched: tuple[P2P, ...]


@attrs.frozen
class Rendezvous:
    """What `simulate` found: ok, or the ranks stuck in a deadlock (the first one reached)."""

    stuck: tuple[Stuck, ...] = ()
    groups: int = 0  # groups completed

    @property
    def ok(self) -> bool:
        """Every rank ran its plan to the end."""
        return not self.stuck

    def describe(self) -> str:
        """The deadlock in words: each stuck rank, its group, and the ops nobody matches."""
        if self.ok:
            return f"ok: {self.groups} p2p groups complete"
        lines = ["p2p deadlock under NCCL's in-order rendezvous:"]
        for s in self.stuck:
            lines.append(f"  rank {s.rank} waits in group {s.position} {s.group} for "
                         + "; ".join(str(o) for o in s.unmatched))
        return "\n".join(lines)


def simulate(rank_plans: dict[int, tuple[Item, ...]]) -> Rendezvous:
    """Play every rank's plan under the rendezvous of the module doc; the first deadlock or
    ok. Any plans may be given (tests pass deliberately bad ones)."""
    pos = dict.fromkeys(rank_plans, 0)
    sent: dict[tuple[int, int], int] = {}  # (src, dst) -> sends issued
    recvd: dict[tuple[int, int], int] = {}  # (src, dst) -> receives issued
    issued: dict[int, list[tuple[P2P, int]] | None] = dict.fromkeys(rank_plans)
    done = 0

    def issue(r: int, g: Group) -> list[tuple[P2P, int]]:
        out = []
        for o in g.ops:
            key = (r, o.peer) if o.sending else (o.peer, r)
            count = sent if o.sending else recvd
            n = count.get(key, 0)
            count[key] = n + 1
            out.append((o, n))
        return out

    def unmatched(r: int) -> list[P2P]:
        bad = []
        for o, n in issued[r]:
            key = (r, o.peer) if o.sending else (o.peer, r)
            if (recvd if o.sending else sent).get(key, 0) <= n:
                bad.append(o)
        return bad

    moved = True
    while moved:
        moved = False
        for r, plan in rank_plans.items():
            while pos[r] < len(plan):
                item = plan[pos[r]]
                if isinstance(item, Group):
                    if issued[r] is None:
                        issued[r] = issue(r, item)
                        moved = True
                    if unmatched(r):
                        break
                    issued[r] = None
                    done += 1
                pos[r] += 1
                moved = True
    stuck = tuple(Stuck(r, pos[r], plan[pos[r]], tuple(unmatched(r)))
                  for r, plan in rank_plans.items() if pos[r] < len(plan))
    return Rendezvous(stuck, done)


@attrs.frozen
class Message:
    """What one send or receive carries: direction, microbatch, edge, tensor index."""

    direction: str
    mb: int
    edge: int
    tensor: int

    def __str__(self) -> str:
        return f"{'activation' if self.direction == 'A' else 'gradient'} of microbatch " \
               f"{self.mb} over edge {self.edge}, tensor {self.tensor}"


def channels(rank_plans: dict[int, tuple[Item, ...]], ntensors=None
             ) -> dict[tuple[int, int], tuple[list[Message], list[Message]]]:
    """Per (src, dst) pipe ranks: the messages src sends and dst receives, in issue order.
    ntensors(direction, edge): how many tensors one action moves (default 1); each goes as
    its own message, in tensor order on both sides."""
    out: dict[tuple[int, int], tuple[list[Message], list[Message]]] = {}
    for r, plan in rank_plans.items():
        for item in plan:
            if not isinstance(item, Group):
                continue
            for o in item.ops:
                key = (r, o.peer) if o.sending else (o.peer, r)
                side = out.setdefault(key, ([], []))[0 if o.sending else 1]
                k = ntensors(o.direction, o.edge) if ntensors else 1
                side.extend(Message(o.direction, o.action.mb, o.edge, i) for i in range(k))
    return out


def check_fifo(rank_plans: dict[int, tuple[Item, ...]], ntensors=None) -> str | None:
    """None when, between every two ranks, the n-th message sent is the n-th received (and
    as many are sent as received); else the first disagreement in words."""
    for (src, dst), (sends, recvs) in sorted(channels(rank_plans, ntensors).items()):
        for n, (s, r) in enumerate(zip(sends, recvs, strict=False), 1):
            if s != r:
                return (f"message {n} from pipe rank {src} to {dst}: rank {src} sends the {s}, "
                        f"rank {dst} receives it as the {r}")
        if len(sends) != len(recvs):
            return (f"pipe rank {src} sends {len(sends)} messages to rank {dst}, which "
                    f"receives {len(recvs)}")
    return None


def prove(sched: Schedule, grouping: str = "consume", ntensors=None) -> str | None:
    """None when the `grouping` plans of `sched`, for a training step and for a forward-only
    one, run to completion under `simulate` and pair messages in FIFO order; else why not."""
    for forward_only in (False, True):
        ps = plans(sched, forward_only, grouping)
        what = "forward-only step" if forward_only else "training step"
        bad = check_fifo(ps, ntensors)
        if bad is not None:
            return f"{what}: {bad}"
        got = simulate(ps)
        if not got.ok:
            return f"{what}: {got.describe()}"
    return None


@functools.lru_cache(maxsize=256)
def choose(sched: Schedule) -> str | None:
    """The first grouping of GROUPINGS that `prove` accepts for `sched` (None: neither).
    consume suits gpipe, 1f1b and zb1p; interleaved needs pairs (its virtual stages make a
    ring, and receives at their consumption point would leave neighbours both sending),
    except where every rank's microbatches are all warm-up (microbatches = pipe)."""
    return next((g for g in GROUPINGS if prove(sched, g) is None), None)


def unproven(sched: Schedule) -> str | None:
    """None when `choose` finds a grouping for `sched`; else consume's reason, in words."""
    if choose(sched) is not None:
        return None
    return "; ".join(f"{g}: {prove(sched, g)}" for g in GROUPINGS)
