"""Reading the flight recorders of all ranks: who is behind, in which operation (pure data).

Input: one *status* per world rank, the JSON data a rank writes in a dump (status.status):

    {"rank": R, "host": ..., "pid": ..., "reason": ..., "idle_s": ..., "main_stack": [lines],
     "active": {"key": K, **entry} | None,        # the op this rank is blocked in, if any
     "comms": [recorder snapshot, ...]}            # flight_recorder.FlightRecorder.snapshot

`divergences(statuses)` finds, per communicator, the ranks that have started fewer collectives
than others (behind), ranks that disagree on the op (or shape, dtype) of the same collective,
and p2p messages waited for but never sent (or sends nobody receives). `missing_ranks(...)`
answers the watchdog's question for one timed-out op: which ranks did not arrive, and
`timeout_report(...)` is the watchdog's report of it.
Ranks are world ranks everywhere in the text. Used by the watchdog's report and by
`soapstone debug hang DIR`; no MPI, no torch.
"""

from __future__ import annotations

from soapstone.comm.observe import expected
from soapstone.comm.observe.flight_recorder import SENDS, entry_text
from soapstone.comm.observe.peers import Peers


def _ranks(rs) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def comm_views(statuses: dict[int, dict]) -> dict[str, dict[int, dict]]:
    """communicator key -> {world rank: that rank's snapshot of it}."""
    out: dict[str, dict[int, dict]] = {}
    for rank, st in statuses.items():
        for snap in st.get("comms", []):
            out.setdefault(snap["key"], {})[rank] = snap
    return out


def doing(st: dict | None, short: bool = False) -> str:
    """What a rank is doing now, from its status: its blocked op or 'not in a comm call'.
    short: the op without its shape and timing."""
    if st is None:
        return "no status (it did not answer: dead, or stuck in native code holding the GIL)"
    act = st.get("active")
    if act:
        text = entry_text(act, act["key"])
        return "blocked in " + (text.split(" (")[0] if short and act["kind"] != "p2p" else
                                text.rsplit(" (", 1)[0] if short else text)
    idle = st.get("idle_s")
    if idle is None:
        return "not in a communication call (none made yet)"
    return f"not in a communication call (last one ended {idle:.3g}s ago)"


def _collective_at(snap: dict, seq: int) -> dict | None:
    """The entry of collective `seq` in a snapshot (None if not kept or not started)."""
    last = snap.get("last_collective")
    if last and last["seq"] == seq:
        return last
    for e in snap.get("entries", ()):
        if e["kind"] == "collective" and e["seq"] == seq:
            return e
    return None


def _signature(e: dict) -> tuple:
    return (e["op"], tuple(e["shape"]), e["dtype"])


def missing_ranks(statuses: dict[int, dict], key: str, entry: dict,
                  rank: int) -> tuple[list, list, list]:
    """For the op `entry` of world rank `rank` on communicator `key` (timed out): (ranks that did
    not arrive, ranks that arrived in a different op [(rank, entry)], ranks with no status).
    Collective: members that have started fewer than `entry['seq']` collectives on it. p2p: the
    peer, when it has sent (received) fewer messages to (from) `rank` than `rank` waits for."""
    views = comm_views(statuses).get(key, {})
    members = next(iter(views.values()), {}).get("world_ranks", [])
    behind, other, silent = [], [], []
    if entry.get("kind") == "p2p":
        peer = members[entry["peer"]] if entry["peer"] < len(members) else None
        mine, theirs = views.get(rank), views.get(peer)
        if theirs is None or mine is None:
            return [], [], [] if peer is None else [peer]
        if not (mine.get("recording", True) and theirs.get("recording", True)):
            return [peer], [], []  # no per-peer counts: the peer is the one waited on
        mine_key, their_key, _ = _P2P_TEXT[entry["op"] in SENDS]
        if theirs[their_key][members.index(rank)] < mine[mine_key][entry["peer"]]:
            behind.append(peer)
        return behind, other, silent
    seq = entry["seq"]
    for r in members:
        snap = views.get(r)
        if snap is None:
            silent.append(r)
        elif snap["seq"] < seq:
            behind.append(r)
        else:
            theirs = _collective_at(snap, seq)
            if theirs is not None and _signature(theirs) != _signature(entry):
                other.append((r, theirs))
    return behind, other, silent


def divergences(statuses: dict[int, dict], skip: str | None = None) -> list[str]:
    """Every divergence found, as text, the longest-blocked first (see the module doc).
    `skip`: a communicator key whose ranks-behind finding is reported elsewhere."""
    found: list[tuple[float, str]] = []
    views = comm_views(statuses)
    for key, snaps in views.items():
        members = next(iter(snaps.values()))["world_ranks"]
        found.extend(_collective_divergence(statuses, key, snaps, members, key == skip))
        found.extend(_p2p_divergence(statuses, key, snaps, members))
    found.sort(key=lambda x: -x[0])
    return [text for _, text in found]


def _blocked_s(st: dict | None) -> float:
    act = (st or {}).get("active") or {}
    return float(act.get("blocked_s", 0.0))


def _collective_divergence(statuses, key, snaps, members, skip_behind=False):
    seqs = {r: s["seq"] for r, s in snaps.items()}
    top = max(seqs.values())
    ahead = sorted(r for r, n in seqs.items() if n == top)
    lines = []
    behind = sorted(r for r, n in seqs.items() if n < top)
    silent = sorted(set(members) - set(snaps))
    if behind and not skip_behind:
        e = _collective_at(snaps[ahead[0]], top)
        what = entry_text(e, key) if e else f"collective #{top} on {key}"
        text = (f"{_ranks(behind)} behind on {key}: {_ranks(ahead)} reached {what}; ")
        text += "; ".join(f"rank {r} has started {seqs[r]} collectives there and is "
                          f"{doing(statuses.get(r), True)}" for r in behind)
        lines.append((max(_blocked_s(statuses.get(r)) for r in ahead) + 1e6, text))
    at_top = {r: _collective_at(snaps[r], top) for r in ahead}
    sigs: dict[tuple, list[int]] = {}
    for r, e in at_top.items():
        if e is not None:
            sigs.setdefault(_signature(e), []).append(r)
    if len(sigs) > 1:
        parts = [f"{_ranks(rs)} called {op}{tuple(shape)} {dtype}"
                 for (op, shape, dtype), rs in sigs.items()]
        lines.append((2e6, f"ranks disagree on collective #{top} of {key}: " + "; ".join(parts)))
    if silent and (behind or any(_blocked_s(statuses.get(r)) for r in ahead)):
        lines.append((0.0, f"{_ranks(silent)} of {key}: {doing(None)}"))
    return lines


_P2P_TEXT = {  # blocked in a send / a receive: (my counter, the peer's, how to say it)
    True: ("sent", "recvd", "it has sent {want} messages to rank {peer} on {key}, which has "
                            "posted {got} receives from it"),
    False: ("recvd", "sent", "it waits for message {want} from rank {peer} on {key}, which has "
                             "sent {got}"),
}


def _p2p_divergence(statuses, key, snaps, members):
    lines = []
    for r, snap in snaps.items():
        act = (statuses.get(r) or {}).get("active")
        if not act or act.get("key") != key or act.get("kind") != "p2p":
            continue
        pi = act["peer"]
        peer = members[pi]
        theirs = snaps.get(peer)
        blocked = act.get("blocked_s", 0.0)
        if theirs is None:
            lines.append((blocked, f"rank {r} is {doing(statuses[r], True)}; rank {peer}: "
                                   f"{doing(None)}"))
            continue
        if not (snap.get("recording", True) and theirs.get("recording", True)):
            lines.append((blocked, f"rank {r} is {doing(statuses[r], True)}; rank {peer} is "
                                   f"{doing(statuses.get(peer), True)} (message counts per "
                                   "peer need the flight recorder)"))
            continue
        mine_key, their_key, text = _P2P_TEXT[act["op"] in SENDS]
        want, got = snap[mine_key][pi], theirs[their_key][members.index(r)]
        if got < want:
            said = text.format(want=want, peer=peer, key=key, got=got)
            lines.append((blocked, f"rank {r} is {doing(statuses[r], True)}: {said} and is "
                                   f"{doing(statuses.get(peer), True)}"))
    return lines


def stack_tail(st: dict | None, frames: int = 6) -> list[str]:
    """The innermost `frames` frames of a rank's main-thread stack (two lines each)."""
    if not st or not st.get("main_stack"):
        return ["(no stack)"]
    lines = st["main_stack"]
    return lines[-2 * frames:]


def timeout_report(rank: int, timeout: float, waited: float, key: str, entry: dict,
                   statuses: dict[int, dict], trace_dir: str | None,
                   peers: Peers | None = None) -> list[str]:
    """The watchdog's report for op `entry` on communicator `key` (this rank's, timed out),
    given every rank's status, as lines."""
    lines = [f"soapstone watchdog: collective timeout: rank {rank} waited {waited:.1f}s "
             f"(SOAPSTONE_COLLECTIVE_TIMEOUT={timeout:g}) in "
             + entry_text(entry, key).split(":")[0]]
    behind, other, silent = missing_ranks(statuses, key, entry, rank)
    if behind:
        lines.append("  did not arrive: " + ", ".join(f"rank {r}" for r in behind))
        for r in behind:
            snap = comm_views(statuses).get(key, {}).get(r, {})
            count = ("" if entry.get("kind") == "p2p" and not snap.get("recording", True) else
                     f" it has sent {sum(snap.get('sent', []))} and posted "
                     f"{sum(snap.get('recvd', []))} receives on {key};"
                     if entry.get("kind") == "p2p" else
                     f" it has started {snap.get('seq', '?')} collectives on {key};")
            lines.append(f"    rank {r}:{count} it is {doing(statuses.get(r))}")
    for r, e in other:
        lines.append(f"  arrived in another op: rank {r} called {entry_text(e, key)}")
    for r in silent:
        lines.append(f"  no status from {peers.name(r) if peers else f'rank {r}'}: "
                     f"{doing(None)}")
    plan = [line for r in sorted(statuses) for line in expected.position_lines(
        r, statuses[r].get("expected") or {}, key, entry.get("kind"))]
    if plan:
        lines.append("  where the layout's plan puts each rank (calls of one step):")
        lines.extend("    " + line for line in plan)
    if not (behind or other or silent):
        lines.append("  every rank of the communicator arrived (a hang inside the backend?)")
    found = divergences(statuses, skip=key if entry.get("kind") != "p2p" else None)
    if found:
        lines.append("  divergences:")
        lines.extend("    " + text for text in found[:6])
    for r in behind + [r for r, _ in other]:
        lines.append(f"  rank {r}'s stack, innermost frames:")
        lines.extend("    " + s for s in stack_tail(statuses.get(r)))
    return lines


def report_end(trace_dir: str | None) -> list[str]:
    """The last lines of a watchdog report: where the dumps are, and that the job ends."""
    return [f"  per-rank dumps: {trace_dir} (read them with: soapstone debug hang {trace_dir})"
            if trace_dir else
            "  per-rank dumps: set SOAPSTONE_TRACE_DIR (or run --debug-dir) to keep them for "
            "`soapstone debug hang DIR`", "  aborting the job"]
