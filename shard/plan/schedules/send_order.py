"""The order a rank sends its messages in: the order each destination reads them.

NCCL pairs the messages between two ranks by order alone (no tags), and the verifier holds
every layout to that (shard/plan/verify/prove.py). Where all of a rank's messages to a
neighbour flow one way along the stages, sending each right after the compute that makes it
is already the reader's order. A V (zbv, dualpipev) sends both ways to one neighbour: rank 0
sends activations down the first leg and gradients up the second to rank 1, which may read a
gradient before an activation made earlier. So a send is held back until it is the next
message its destination reads from this rank (`SendOrder`), for the ahead mode
(Schedule.with_comm) and the grouped one (p2p_groups.py's `ordered`), in the schedules that
say so (ScheduleKind.send_in_read_order): the others send as they make, so that ranks which
disagree on the order (a bug) are still refused by the verifier rather than papered over.
Pure data: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from soapstone.shard.plan.schedules.actions import Action


def message(a: Action) -> tuple:
    """What a send or receive moves, the same on both ends: (direction, microbatch, edge)."""
    return a.kind.direction, a.mb, a.kind.edge(a.stage)


@attrs.define
class SendOrder:
    """One rank's sends, each let out once its destination reads it next."""

    rank_of: Callable[[int], int]  # virtual stage -> pipe rank (the schedule's placement)
    reads: dict[int, list[tuple]]  # per destination, the messages it reads from this rank
    read: dict[int, int] = attrs.Factory(dict)  # per destination, how many are let out
    held: list[Action] = attrs.Factory(list)

    @classmethod
    def of(cls, sched, rank: int, forward_only: bool = False) -> SendOrder:
        """The order for pipe rank `rank` of schedule `sched` (a built Schedule): every
        other rank's reads from it, in the order its compute reads them."""
        reads: dict[int, list[tuple]] = {}
        for peer in range(sched.pipe):
            for a in sched.ranks[peer]:
                if forward_only and a.kind.direction is not None and a.kind.direction.flow < 0:
                    continue
                r = sched.receive(a) if a.kind.messages else None
                if r is not None and sched.rank_of(r.kind.peer(r.stage)) == rank:
                    reads.setdefault(peer, []).append(message(r))
        return cls(sched.rank_of, reads)

    def due(self, sends: list[Action]) -> list[Action]:
        """Hold `sends`; let out, in order, every held send its destination reads next."""
        self.held += sends
        out: list[Action] = []
        moved = True
        while moved:
            moved = False
            for a in list(self.held):
                dst = self.rank_of(a.kind.peer(a.stage))
                n, want = self.read.get(dst, 0), self.reads.get(dst, [])
                if n < len(want) and want[n] == message(a):
                    self.read[dst] = n + 1
                    self.held.remove(a)
                    out.append(a)
                    moved = True
        return out

    def rest(self) -> list[Action]:
        """What is still held at the step's end (none where every read is sent: the
        verifier names any other)."""
        out, self.held = self.held, []
        return out
