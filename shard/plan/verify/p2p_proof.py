"""The proof that a grouping of pipeline p2p (p2p_groups.py) runs on NCCL.

`simulate` plays every rank's plan under the strictest reading of NCCL's in-order rendezvous:

- each rank issues its groups in order and stays in a group until it completes; compute
  actions are instantaneous (they wait only for the group before them);
- a group completes when every op in it is matched by the peer's op in the peer's current
  or an already issued group, pairing per (src, dst) in FIFO order, without tags.

A plan it runs to the end cannot deadlock on NCCL (the GPU is looser: compute after a
send-only group and the host run on while it is in flight, which only removes waits), and
`check_fifo` proves that the n-th send from a to b carries the same (direction, microbatch,
edge, tensor) as the n-th receive b posts from a. `prove` does both for a schedule's training
step and its forward-only (infer) step; `choose` picks the first grouping proven. Pure data:
no torch.
"""

from __future__ import annotations

import functools

import attrs

from soapstone.shard.plan.p2p_groups import P2P, Group, Item, groupings, plans
from soapstone.shard.plan.schedules import Direction, Schedule


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

    direction: Direction
    mb: int
    edge: int
    tensor: int

    def __str__(self) -> str:
        return f"{self.direction.noun} of microbatch " \
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
    """The first grouping of p2p_groups.groupings(sched) that `prove` accepts (None: none).
    consume suits gpipe, 1f1b and zb1p; interleaved needs pairs (its virtual stages make a
    ring, and receives at their consumption point would leave neighbours both sending),
    except where every rank's microbatches are all warm-up (microbatches = pipe); zbv and
    dualpipev mostly need ordered (a V's neighbours send to each other both ways)."""
    return next((g for g in groupings(sched) if prove(sched, g) is None), None)


def unproven(sched: Schedule) -> str | None:
    """None when `choose` finds a grouping for `sched`; else consume's reason, in words."""
    if choose(sched) is not None:
        return None
    return "; ".join(f"{g}: {prove(sched, g)}" for g in groupings(sched))
