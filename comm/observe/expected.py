"""Where each rank should be: the layout's expected calls of one training step, per communicator.

The layout's plan (soapstone.shard.plan.verify.sequence, derived before launch) is handed down as
plain data, since comm knows nothing of models:

    expect({"model[0,1]": {"collective": [op, ...], "p2p": [op, ...]}, ...})

each op a dict with "op", "shape", "dtype", "bytes", "peer" and "what" (the plan's one-line
description: phase, stage, microbatch, the spec value that made it). `step_began()` marks the
start of a training step: positions count from the communicator's call counters at that mark
(steps after the last mark wrap around the step's length). `positions(snapshots)` says, for
each communicator of a rank's status, how many calls of the step it has made, which planned
call it is in (or makes next), and whether the call it is blocked in differs from the plan.
The watchdog puts that in every status (dumps, replies), so a timeout report and `soapstone
debug hang` can say which operation each rank should have reached.
"""

from __future__ import annotations

import threading

from soapstone.comm.observe.flight_recorder import live_recorders

_lock = threading.Lock()
_plan: dict[str, dict[str, list[dict]]] = {}
_base: dict[str, tuple[int, int]] = {}


def _key(recorder_key: str) -> str:
    """A recorder's key without the index telling apart communicators over the same ranks."""
    return recorder_key.split("#")[0]


def expect(plan: dict[str, dict[str, list[dict]]]) -> None:
    """Take this rank's expected calls of one step (see the module doc), counted from now."""
    with _lock:
        _plan.clear()
        _plan.update(plan)
    step_began()


def clear() -> None:
    """Forget the plan (reports then say nothing about it)."""
    with _lock:
        _plan.clear()
        _base.clear()


def step_began() -> None:
    """A training step starts now: each communicator's call counters become its step's zero."""
    if not _plan:
        return
    marks = {}
    for rec in live_recorders():
        k = _key(rec.key)
        if k in _plan:
            marks[k] = rec.counts()
    with _lock:
        _base.clear()
        _base.update(marks)


def _where(made: int, ops: list[dict], blocked: dict | None, zero: int) -> dict:
    """Position of a rank that has started `made` calls of a step of `ops` (blocked: the call
    it is in, if any, as the recorder describes it: its number, less the step's `zero`, is its
    place, which for a wait on a call posted earlier is not the newest)."""
    n = len(ops)
    out = {"made": made, "of": n}
    if not n:
        return out
    at = blocked["seq"] - zero if blocked is not None else 0
    if at > 0:
        want = ops[(at - 1) % n]
        out["at"] = (at - 1) % n + 1
        out["planned"] = want["what"]
        same = (want["op"] == blocked.get("op") or
                want["op"] == "send" and blocked.get("op") in ("send", "isend") or
                want["op"] == "recv" and blocked.get("op") in ("recv", "irecv"))
        got = list(blocked.get("shape", []))
        # -1 in a plan's shape: a size decided at run time (moe's alltoallv rows)
        fits = len(got) == len(want["shape"]) and all(
            w in (-1, g) for w, g in zip(want["shape"], got, strict=True))
        if not (same and fits and want["dtype"] == blocked.get("dtype")):
            out["differs"] = True
    else:
        out["next"] = made % n + 1
        out["planned"] = ops[made % n]["what"]
    return out


def positions(snapshots: list[dict], active: dict | None) -> dict[str, dict]:
    """communicator key -> {"collective": where, "p2p": where} for the communicators of a
    rank's recorder snapshots that the plan names; `active` is the call the rank is blocked
    in (key + described entry), if any."""
    with _lock:
        plan, base = dict(_plan), dict(_base)
    out: dict[str, dict] = {}
    for snap in snapshots:
        k = _key(snap["key"])
        if k not in plan:
            continue
        seq0, p2p0 = base.get(k, (0, 0))
        mine = active if active and _key(active.get("key", "")) == k else None
        row = {}
        for kind, done, zero in (("collective", snap["seq"], seq0), ("p2p", snap["p2p_seq"],
                                                                      p2p0)):
            blocked = mine if mine and (mine.get("kind") == kind) else None
            row[kind] = _where(done - zero, plan[k].get(kind, []), blocked, zero)
        out[snap["key"]] = row
    return out


def position_lines(rank: int, where: dict[str, dict], key: str | None = None,
                   kind: str | None = None) -> list[str]:
    """A rank's positions as report lines (only communicator `key`'s, and only its calls of
    `kind` (collective | p2p), when given)."""
    lines = []
    for k, row in where.items():
        if key is not None and _key(k) != _key(key):
            continue
        for which, w in row.items():
            if not w.get("of") or kind not in (None, which):
                continue
            calls = "collectives" if which == "collective" else "p2p calls"
            if "at" in w:
                state = (f"in call {w['at']} of the step's {w['of']} {calls}, which the plan "
                         f"says is {w['planned']}")
                if w.get("differs"):
                    state += " -- it called something else: it left the plan"
            else:
                state = (f"has made {w['made']} {calls} this step; the plan's next "
                         f"(call {w['next']} of {w['of']}) is {w['planned']}")
            lines.append(f"rank {rank} on {k}: {state}")
    return lines
