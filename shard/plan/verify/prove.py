"""Prove a layout before launch: every rank's collectives and p2p messages pair up and finish.

From every rank's expected sequence (sequence.py) `verify_sequences` proves that
- every member of each communicator issues the same collectives in the same order (kind,
  shape, dtype);
- every send has exactly one receive with the same shape and dtype, and between two ranks the
  n-th message sent is the n-th receive posted (NCCL has no tags: it pairs messages by order);
- the step can complete: a simulation of the blocking semantics (a collective returns when
  every member has entered it, a wait on a receive when its send is posted, a wait on a send
  when its receive is posted) runs every rank to its end, or names the cycle of waits;
and `verify_layout` adds that each rank's bytes per mesh axis and collective equal explain's.
A failure is a VerifyError (a UserError: exit 2) naming the two ranks, the communicator, the
position in the sequence and both sides' operations with the spec value that made each.
Pure data: no torch.
"""

from __future__ import annotations

import attrs

from soapstone.comm.errors import UserError
from soapstone.shard.plan.verify.calls import Op
from soapstone.shard.plan.verify.sequence import rank_sequences


class VerifyError(UserError):
    """A layout whose ranks would not issue matching communication (see the module doc)."""


@attrs.frozen
class Verified:
    """What a proof covered: ranks, communicators, calls and messages checked."""

    ranks: int
    communicators: int
    collectives: int
    messages: int
    derived: int = 0  # ranks whose sequences were derived (verify_layout: representatives)

    def summary(self) -> str:
        """One line for `check --verify`."""
        if self.ranks == 1:
            return "1 rank, no communication to match"
        who = f"{self.ranks} ranks"
        if self.derived and self.derived < self.ranks:
            who += (f" (derived: one pipe column of {self.derived}; the others make the same "
                    "calls on their own communicators)")
        return (f"{who}: {self.collectives} collective calls on {self.communicators} "
                f"communicators and {self.messages} p2p messages per step match and complete")


def _at(seq: tuple[Op, ...], op: Op) -> int:
    """An op's position in its rank's sequence, counted from 1."""
    return next(i for i, o in enumerate(seq) if o is op) + 1


def check_groups(seqs: dict[int, tuple[Op, ...]]) -> tuple[int, int]:
    """Every member of each communicator issues the same collectives; (communicators, calls)."""
    by_key: dict[str, dict[int, list[Op]]] = {}
    members: dict[str, tuple[int, ...]] = {}
    for r, seq in seqs.items():
        for o in seq:
            if o.is_p2p:
                continue
            by_key.setdefault(o.key, {}).setdefault(r, []).append(o)
            members[o.key] = o.ranks
    calls = 0
    for key, lists in sorted(by_key.items()):
        ranks = members[key]
        ref = ranks[0] if ranks[0] in lists else min(lists)
        want = lists[ref]
        for r in ranks:
            if r not in seqs:  # a rank not derived (verify_layout's representatives)
                continue
            got = lists.get(r, [])
            calls += len(got)
            if r == ref:
                continue
            for j in range(max(len(want), len(got))):
                a = want[j] if j < len(want) else None
                b = got[j] if j < len(got) else None
                if a is not None and b is not None and a.signature() == b.signature():
                    continue
                raise VerifyError(_group_text(key, j + 1, ref, a, r, b, seqs))
    return len(by_key), calls


def _side(rank: int, op: Op | None, seqs, key: str, n: int) -> str:
    if op is None:
        mine = sum(1 for o in seqs.get(rank, ()) if o.key == key and not o.is_p2p)
        return f"rank {rank} issues none (it makes {mine} collective call" \
               f"{'s' if mine != 1 else ''} on {key}, not {n})"
    return f"rank {rank} (its call {_at(seqs[rank], op)}): {op.describe()}"


def _group_text(key, pos, ra, a, rb, b, seqs) -> str:
    return (f"collective {pos} on {key} differs between rank {ra} and rank {rb}:\n"
            f"  {_side(ra, a, seqs, key, pos)}\n  {_side(rb, b, seqs, key, pos)}\n"
            "hint: every member of a communicator must make the same collective calls in the "
            "same order, or the job hangs or mixes data")


def check_p2p(seqs: dict[int, tuple[Op, ...]]) -> int:
    """Every send has exactly one matching receive, in the same order on both sides; the
    number of messages."""
    sends: dict[tuple, list[tuple[int, Op]]] = {}  # (src, dst, key) -> in posting order
    recvs: dict[tuple, list[tuple[int, Op]]] = {}
    for r, seq in seqs.items():
        for o in seq:
            if o.kind == "send":
                sends.setdefault((r, o.peer, o.key), []).append((r, o))
            elif o.kind == "recv":
                recvs.setdefault((o.peer, r, o.key), []).append((r, o))
    total = 0
    for ch in sorted(set(sends) | set(recvs)):
        src, dst, key = ch
        out, into = sends.get(ch, []), recvs.get(ch, [])
        by_tag: dict[tuple, list[Op]] = {}
        for _, o in into:
            by_tag.setdefault(o.tag, []).append(o)
        sent: dict[tuple, Op] = {}
        for _, o in out:
            if o.tag in sent:
                raise VerifyError(
                    f"p2p on {key}: rank {src} sends one message to rank {dst} twice:\n"
                    f"  rank {src} (its call {_at(seqs[src], sent[o.tag])}): "
                    f"{sent[o.tag].describe()}\n"
                    f"  rank {src} (its call {_at(seqs[src], o)}): {o.describe()}\n"
                    "hint: each boundary tensor of a microbatch crosses an edge once")
            sent[o.tag] = o
            got = by_tag.get(o.tag, [])
            if not got:
                theirs = ", ".join(f"{x.tag[0]}{x.tag[2]}" for _, x in into[:8]) or "none"
                raise VerifyError(
                    f"p2p on {key}: rank {src} sends a message rank {dst} never receives:\n"
                    f"  rank {src} (its call {_at(seqs[src], o)}): {o.describe()}\n"
                    f"  rank {dst} posts no receive for it (its receives from rank {src}: "
                    f"{len(into)}, tags {theirs})\n"
                    "hint: a send without its receive leaves the sender waiting at the step's "
                    "end and the message in flight")
            if len(got) > 1:
                raise VerifyError(
                    f"p2p on {key}: rank {dst} posts {len(got)} receives for one message of "
                    f"rank {src}:\n  rank {src} (its call {_at(seqs[src], o)}): {o.describe()}"
                    "\n" + "\n".join(f"  rank {dst} (its call {_at(seqs[dst], x)}): "
                                     f"{x.describe()}" for x in got))
            r = got[0]
            if (o.shape, o.dtype) != (r.shape, r.dtype):
                raise VerifyError(
                    f"p2p on {key}: a message of rank {src} to rank {dst} has another shape "
                    f"or dtype on each side:\n"
                    f"  rank {src} (its call {_at(seqs[src], o)}) sends {o.describe()}\n"
                    f"  rank {dst} (its call {_at(seqs[dst], r)}) receives {r.describe()}\n"
                    "hint: the receiver allocates what it expects; both stages must compile "
                    "the boundary tensor alike")
        tags = {o.tag for _, o in out}
        for _, r in into:
            if r.tag not in tags:
                raise VerifyError(
                    f"p2p on {key}: rank {dst} waits for a message rank {src} never sends:\n"
                    f"  rank {dst} (its call {_at(seqs[dst], r)}): {r.describe()}\n"
                    f"  rank {src} sends {len(out)} messages to rank {dst}, none with this "
                    "microbatch, edge and tensor\n"
                    "hint: a receive without its send hangs the receiver")
        for n, ((_, o), (_, r)) in enumerate(zip(out, into, strict=False), 1):
            if o.tag != r.tag:
                raise VerifyError(
                    f"p2p on {key}: message {n} from rank {src} to rank {dst} is not the one "
                    f"rank {dst} expects in that place:\n"
                    f"  rank {src} (its call {_at(seqs[src], o)}) sends {o.describe()}\n"
                    f"  rank {dst} (its call {_at(seqs[dst], r)}) receives {r.describe()}\n"
                    "hint: the two ranks run the schedule's microbatches in different orders;"
                    " NCCL pairs messages between two ranks by order, not by tag")
        total += len(out)
    return total


def simulate(seqs: dict[int, tuple[Op, ...]]) -> None:
    """Play every rank's sequence under blocking semantics; VerifyError naming a cycle of
    waits (or the ranks stuck) when the step cannot finish."""
    pos = dict.fromkeys(seqs, 0)
    posted: set[tuple] = set()  # (kind, src, dst, key, tag) of posted sends and receives
    arrived: dict[tuple[str, int], set[int]] = {}  # (key, nth call) -> members there
    count: dict[tuple[int, str], int] = {}  # (rank, key) -> collectives done
    active = set(seqs)
    while active:
        moved = False
        for r in sorted(active):
            seq = seqs[r]
            while pos[r] < len(seq):
                o = seq[pos[r]]
                if o.kind in ("send", "recv"):
                    src, dst = (r, o.peer) if o.kind == "send" else (o.peer, r)
                    posted.add((o.kind, src, dst, o.key, o.tag))
                elif o.kind == "wait":
                    # waiting on my receive needs their send, on my send their receive
                    need = ("send", o.peer, r) if o.waits == "recv" else ("recv", r, o.peer)
                    if (*need, o.key, o.tag) not in posted:
                        break
                else:
                    n = count.get((r, o.key), 0)
                    here = arrived.setdefault((o.key, n), set())
                    here.add(r)
                    if len(here) < sum(1 for m in o.ranks if m in seqs):
                        break
                    for m in (m for m in o.ranks if m in seqs):  # all there: all return
                        count[(m, o.key)] = count.get((m, o.key), 0) + 1
                        if m != r:
                            pos[m] += 1
                            active.add(m)
                    del arrived[(o.key, n)]
                pos[r] += 1
                moved = True
            if pos[r] >= len(seq):
                active.discard(r)
        if not moved and active:
            raise VerifyError(_deadlock_text(seqs, pos, active, count))


def _blockers(seqs, pos, r, count) -> list[int]:
    """The ranks rank r is waiting for."""
    o = seqs[r][pos[r]]
    if o.kind == "wait":
        return [o.peer]
    n = count.get((r, o.key), 0)
    return [m for m in o.ranks if m != r and m in seqs and not (
        pos.get(m, 0) < len(seqs.get(m, ())) and seqs[m][pos[m]].key == o.key
        and count.get((m, o.key), 0) == n)]


def _deadlock_text(seqs, pos, active, count) -> str:
    stuck = {r: _blockers(seqs, pos, r, count) for r in sorted(active)}
    cycle = _cycle(stuck)
    if cycle is None:
        r = min(active)
        cycle = [r] + stuck[r][:1]
    lines = ["the step cannot finish: the ranks wait for each other in a cycle:"
             if len(cycle) > 1 and cycle[0] in stuck.get(cycle[-1], ()) else
             "the step cannot finish: ranks wait for ranks that never get there:"]
    for r in cycle:
        if r in active:
            o = seqs[r][pos[r]]
            who = ", ".join(map(str, stuck[r])) or "nobody"
            many = "s" if len(stuck[r]) > 1 else ""
            lines.append(f"  rank {r} (its call {pos[r] + 1}) waits for rank{many} {who} in "
                         f"{o.describe()}")
        else:
            lines.append(f"  rank {r} has finished its step (all {len(seqs[r])} calls)")
    lines.append("hint: every rank posts its receives before it waits and makes collective "
                 "calls in one order; a layout that reaches this point would hang at run time")
    return "\n".join(lines)


def _cycle(stuck: dict[int, list[int]]) -> list[int] | None:
    """A cycle in the wait-for graph, as ranks in wait order."""
    for start in stuck:
        path, seen = [start], {start: 0}
        r = start
        while True:
            nxt = next((m for m in stuck.get(r, ()) if m in stuck), None)
            if nxt is None:
                break
            if nxt in seen:
                return path[seen[nxt]:]
            seen[nxt] = len(path)
            path.append(nxt)
            r = nxt
    return None


def check_bytes(graph, seqs: dict[int, tuple[Op, ...]], optimizer: str = "adamw") -> None:
    """Each rank's bytes per (mesh axes, collective) equal explain's figures for its pipe rank
    (estimate_pipeline's rows per pipe rank; estimate's for one stage of whole batches)."""
    from soapstone.shard.plan.analysis.explain import estimate, estimate_pipeline

    zero = graph.stages[0].program.zero
    if graph.axis is not None or graph.microbatches > 1:
        rows = estimate_pipeline(graph, zero, optimizer).rank_traffic
    else:
        rows = [estimate(graph.program, zero, optimizer).traffic]
    want = []
    for traffic in rows:
        per: dict[tuple[str, str], int] = {}
        for t in traffic:
            if t.bytes:
                per[(t.axis, t.kind)] = per.get((t.axis, t.kind), 0) + t.bytes
        want.append(per)
    names, sizes = [a for a, _ in graph.mesh], [n for _, n in graph.mesh]
    for r, seq in seqs.items():
        pipe_rank = 0
        if graph.axis is not None:
            k, rr = names.index(graph.axis), r
            for i in range(len(sizes) - 1, k, -1):
                rr //= sizes[i]
            pipe_rank = rr % sizes[k]
        mine: dict[tuple[str, str], int] = {}
        for o in seq:
            if o.kind in ("recv", "wait") or not o.bytes:
                continue
            key = (",".join(o.axes), o.kind)
            mine[key] = mine.get(key, 0) + o.bytes
        theirs = want[pipe_rank]
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            text = "\n".join(f"  [{a}] {kind}: the sequence sends {mine.get((a, kind), 0)} B, "
                             f"explain says {theirs.get((a, kind), 0)} B" for a, kind in diff)
            raise VerifyError(f"rank {r}: its calls' bytes differ from explain's figures:\n"
                              f"{text}")


def verify_sequences(seqs: dict[int, tuple[Op, ...]]) -> Verified:
    """The three proofs of the module doc on given sequences (tests mutate them)."""
    comms, calls = check_groups(seqs)
    messages = check_p2p(seqs)
    simulate(seqs)
    return Verified(len(seqs), comms, calls, messages)


def representatives(graph) -> tuple[int, ...]:
    """One world rank per pipe coordinate (the others' coordinates 0)."""
    if graph.axis is None:
        return (0,)
    names, sizes = [a for a, _ in graph.mesh], [n for _, n in graph.mesh]
    k = names.index(graph.axis)
    stride = 1
    for n in sizes[k + 1:]:
        stride *= n
    return tuple(c * stride for c in range(sizes[k]))


def verify_layout(graph, schedule=None, locate=None, optimizer: str = "adamw",
                  ranks: tuple[int, ...] | None = None, p2p: str = "ahead") -> Verified:
    """Derive every rank's sequence of `graph` (under `schedule`, default the graph's) and
    prove it (verify_sequences), and that its bytes are explain's; VerifyError otherwise.

    ranks: derive only these (default all). `representatives(graph)` is enough for a proof:
    a rank's sequence depends on its coordinates only through its pipe rank (which stages
    it runs) and the names of its communicators and peers, so ranks that differ off the pipe
    axis make the same calls on their own copies of each communicator: every such
    communicator's members agree by construction, they enter each collective together (the
    simulation counts the members derived), and all p2p stays within one pipe column.
    p2p: the executor's p2p mode whose order to prove (ahead | grouped)."""
    seqs = rank_sequences(graph, schedule, locate, ranks, p2p)
    out = verify_sequences(seqs)
    check_bytes(graph, seqs, optimizer)
    return attrs.evolve(out, ranks=graph.world_size, derived=len(seqs))
