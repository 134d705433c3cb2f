"""Pipeline p2p in groups, for NCCL's in-order semantics.

NCCL has no tags: on each rank its sends and receives run in issue order on one stream, a
send completes only together with its receive (a rendezvous), and between two ranks the n-th
message sent is the n-th received. Posting every receive ahead (schedules.with_comm, matched
by MPI tag) would leave two neighbours each waiting in a receive whose send sits behind it.

So a rank issues its p2p in *groups*: the sends of one compute action (right after it) and
the receive of the next (just before it, at its consumption point) with no compute between
them go out together, as Megatron's send_forward_recv_backward does in one batch_isend_irecv
(one ncclGroupStart/End). `rank_plan` turns a schedule's compute list into compute actions
and Groups, in one of three groupings (GROUPINGS); p2p_proof.py proves which grouping of a
schedule cannot deadlock and pairs its messages in order. Pure data: no torch.
"""

from __future__ import annotations

import functools

import attrs

from soapstone.shard.plan.schedules import Action, ActionKind, Direction, Schedule
from soapstone.shard.plan.schedules.send_order import SendOrder, message


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
        return self.action.kind.sending

    @property
    def direction(self) -> Direction:
        """A (an activation) or G (a gradient)."""
        return self.action.kind.direction

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
    return P2P(a, sched.rank_of(a.kind.peer(a.stage)), a.kind.edge(a.stage))


GROUPINGS = ("consume", "pairs", "ordered")


def groupings(sched: Schedule) -> tuple[str, ...]:
    """The groupings tried for `sched`, in order: `ordered` only where its kind sends in its
    readers' order (a V: send_order.py)."""
    return GROUPINGS if sched.spec.send_in_read_order else GROUPINGS[:2]


def _units(sched: Schedule, compute: list[Action], grouping: str) -> list[list[Action]]:
    """The compute actions cut where groups go: one action per unit (consume), or a
    steady-state forward with the backward after it (pairs) unless that backward's gradient
    comes from this very forward (same microbatch, at or below its stage); a W joins the unit
    before it (it neither sends nor receives)."""
    units: list[list[Action]] = []
    for a in compute:
        prev = units[-1] if units else None
        if prev is not None and (not a.kind.messages or (
                grouping == "pairs" and a.kind is ActionKind.B and len(prev) == 1
                and prev[0].kind is ActionKind.F and not (a.mb == prev[0].mb
                                                          and a.stage >= prev[0].stage))):
            prev.append(a)
        else:
            units.append([a])
    return units


def _made(sched: Schedule) -> dict[tuple, float]:
    """When each message is made in the schedule's simulated timeline: (direction,
    microbatch, edge) -> the end of the compute sending it."""
    out = {}
    for row in sched.simulate():
        for a, _, end in row:
            s = sched.send(a)
            if s is not None:
                out[message(s)] = end
    return out


def _ahead(sched: Schedule, mine: list[Action], posted: set[Action], ops: list[Action],
           now: float, made: dict[tuple, float]) -> list[Action]:
    """The `ordered` grouping's early receives: for each rank a group sends to, the next
    message this rank reads from it, if that one is made by `now` in the simulated timeline
    and the group receives nothing else from it. Between the two legs of a V, neighbours
    send to each other at once; a send-only group on each side would wait for the other
    forever (NCCL's rendezvous), a receive beside each send pairs them; a message made later
    would hold the group up for it. Receives from one peer still go in the order read."""
    peer = sched.rank_of

    def src(r: Action) -> int:
        return peer(r.kind.peer(r.stage))

    recv_from = {src(o) for o in ops if o.kind.receiving}
    got = set(ops)
    out = []
    for dst in dict.fromkeys(peer(o.kind.peer(o.stage)) for o in ops if o.kind.sending):
        if dst in recv_from:
            continue
        nxt = next((r for r in mine if src(r) == dst and r not in posted and r not in got),
                   None)
        if nxt is not None and made[message(nxt)] <= now:
            out.append(nxt)
    return out


@functools.lru_cache(maxsize=512)
def rank_plan(sched: Schedule, rank: int, forward_only: bool = False,
              grouping: str = "consume") -> tuple[Item, ...]:
    """Pipe rank `rank`'s compute actions with its p2p in Groups: before each unit of compute
    (`_units`) one group, the sends of the unit before it and the receives the unit reads,
    and the last sends at the end (a V's same-rank hand-off is no message: in no group).
    consume: Megatron's 1F1B (each receive just before the action reading it); pairs:
    Megatron's interleaved steady state (a forward and a backward run back to back, their
    sends and the next pair's receives in one group); ordered: consume's groups, a send held
    back until its destination reads it next (send_order.py: a V sends both ways).
    forward_only: the forward actions alone (Executor.infer)."""
    if grouping not in GROUPINGS:  # not user input: p2p_proof.choose picks it
        raise ValueError(f"grouping {grouping!r}: use one of {GROUPINGS}")
    compute = [a for a in sched.ranks[rank] if not forward_only or a.kind is ActionKind.F]
    out: list[Item] = []
    pending: list[Action] = []  # sends of the unit just run
    weights: list[Action] = []  # its trailing W actions
    ordered = grouping == "ordered"
    # ordered: sends as their readers read them
    order = SendOrder.of(sched, rank, forward_only) if ordered else None
    mine = [r for r in (sched.receive(a) for a in compute) if r is not None]
    posted: set[Action] = set()  # ordered: receives posted ahead of their unit
    made = _made(sched) if ordered else {}
    start = {a: t for a, t, _ in sched.simulate()[rank]} if ordered else {}
    for unit in _units(sched, compute, grouping):
        if ordered:
            pending = order.due(pending)
        ops = pending + [r for r in (sched.receive(a) for a in unit)
                         if r is not None and r not in posted]
        if ordered:  # a peer sent to may be sending to us: its next message joins the group
            ops += _ahead(sched, mine, posted, ops, start[unit[0]], made)
            posted.update(o for o in ops if o.kind.receiving)
        if ops:
            out.append(Group(tuple(p2p_of(sched, x) for x in ops)))
        # a W runs after the group carrying its unit's sends, not before: zb1p's point is that
        # B's input gradient leaves at once while W fills the wait (W has no p2p, so the
        # order of groups, which is what the proof checks, is the same)
        out.extend(weights)
        k = len(unit)
        while k and not unit[k - 1].kind.messages:
            k -= 1
        out.extend(unit[:k])
        weights = unit[k:]
        pending = [s for s in (sched.send(a) for a in unit) if s is not None]
    if ordered:
        pending = order.due(pending) + order.rest()  # any left: the proof names them
    if pending:
        out.append(Group(tuple(p2p_of(sched, x) for x in pending)))
    out.extend(weights)
    return tuple(out)


def plans(sched: Schedule, forward_only: bool = False,
          grouping: str = "consume") -> dict[int, tuple[Item, ...]]:
    """Every pipe rank's rank_plan."""
    return {r: rank_plan(sched, r, forward_only, grouping) for r in range(sched.pipe)}


def format_plans(sched: Schedule, grouping: str) -> str:
    """Every pipe rank's grouped plan as text, one line each: compute actions as in
    Schedule.format (`F3`, `B3`, `W3`; `:c` the chunk) and each group in brackets."""
    label = sched.label

    def item(x: Item) -> str:
        return "[" + " ".join(label(o.action) for o in x.ops) + "]" if isinstance(x, Group) \
            else label(x)

    lines = [f"p2p on cuda or SOAPSTONE_P2P=grouped ({grouping} grouping; [...] = one NCCL "
             "group):"]
    lines += [f"  rank {r} | " + " ".join(item(x) for x in rank_plan(sched, r, False, grouping))
              for r in range(sched.pipe)]
    return "\n".join(lines) + "\n"
