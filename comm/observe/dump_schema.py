"""The dumps `soapstone debug hang DIR` reads, checked field by field before any is read.

A dump (`rank<R>.json`, status.write_dump) is a status as diagnose.py describes it: rank,
size, host, pid, reason, active, idle_s, comms (recorder snapshots with their entries),
main_stack, expected (the layout's plan, expected.positions), failure. Every field the report
reads is checked for type and range, and the dumps against each other: one dump per rank, the
same world size, each communicator's members alike in every dump, its counters one per member.
A dump that fails is a DumpError naming the file and the field (`rank0.json: comms[1].seq:
'x' is a string, want a whole number >= 0`), exit 2: never a traceback, never a dump dropped.
Pure Python: no MPI, no torch.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.comm.observe.flight_recorder import STATES

FIX = ("the dump was edited or damaged; dump the job again (SIGUSR1 to mpiexec, or the next "
       "timeout) or remove the file")
RANK_FILE = re.compile(r"rank(\d+)\.json")


class DumpError(UserError):
    """A dump directory without dumps, or a dump that is not one (exit 2)."""


class Checker:
    """Typed reads of one dump's JSON, each failure a DumpError naming the file and field."""

    def __init__(self, name: str):
        self.name = name

    def fail(self, path: str, problem: str) -> DumpError:
        """`FILE: PATH: PROBLEM; FIX`."""
        return DumpError(f"{self.name}: {path}: {problem}; {FIX}")

    def want(self, ok: bool, v, path: str, what: str) -> None:
        """Raise unless `ok`: `v` at `path` is not `what`."""
        if not ok:
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            kind = {dict: " is an object", list: " is a list", str: " is a string",
                    bool: " is a boolean", type(None): " is null"}.get(type(v), "")
            raise self.fail(path, f"{shown}{kind}, want {what}")

    def whole(self, v, path: str, least: int = 0) -> int:
        """A whole number >= least (a boolean is not one)."""
        self.want(type(v) is int and v >= least, v, path, f"a whole number >= {least}")
        return v

    def number(self, v, path: str) -> float:
        """A finite number."""
        # a comparison, not math.isfinite, which overflows on a JSON integer of 400 digits
        self.want(type(v) in (int, float) and -math.inf < v < math.inf, v, path, "a number")
        return v

    def text(self, v, path: str) -> str:
        """A string."""
        self.want(isinstance(v, str), v, path, "a string")
        return v

    def obj(self, v, path: str) -> dict:
        """A JSON object."""
        self.want(isinstance(v, dict), v, path, "an object")
        return v

    def texts(self, v, path: str) -> list[str]:
        """A list of strings."""
        self.want(isinstance(v, list) and all(isinstance(x, str) for x in v), v, path,
                  "a list of strings")
        return v

    def wholes(self, v, path: str, n: int | None = None) -> list[int]:
        """A list of (n) whole numbers >= 0."""
        self.want(isinstance(v, list) and (n is None or len(v) == n), v, path,
                  f"a list of {n} whole numbers" if n is not None else "a list of whole numbers")
        for i, x in enumerate(v):
            self.whole(x, f"{path}[{i}]")
        return v

    def need(self, d: dict, key: str, path: str):
        """d[key], or the error saying it is missing."""
        if key not in d:
            raise self.fail(f"{path}.{key}" if path else key, "missing")
        return d[key]

    def entry(self, e, path: str, members: int | None, keyed: bool = False) -> None:
        """A flight-recorder entry (flight_recorder.describe; `keyed`: with its communicator's
        key, as a status's `active`); a p2p peer indexes the communicator's `members`."""
        e = self.obj(e, path)
        if keyed:
            self.text(self.need(e, "key", path), f"{path}.key")
        self.whole(self.need(e, "seq", path), f"{path}.seq")
        kind = self.need(e, "kind", path)
        self.want(kind in ("collective", "p2p"), kind, f"{path}.kind", "'collective' or 'p2p'")
        self.text(self.need(e, "op", path), f"{path}.op")
        self.wholes(self.need(e, "shape", path), f"{path}.shape")
        self.text(self.need(e, "dtype", path), f"{path}.dtype")
        self.whole(self.need(e, "bytes", path), f"{path}.bytes")
        state = self.need(e, "state", path)
        self.want(state in STATES, state, f"{path}.state", "one of " + ", ".join(STATES))
        self.number(self.need(e, "started_s_ago", path), f"{path}.started_s_ago")
        for key in ("waiting_s", "duration_s", "blocked_s"):
            if key in e:
                self.number(e[key], f"{path}.{key}")
        if kind == "p2p":
            peer = self.whole(self.need(e, "peer", path), f"{path}.peer")
            if members is not None and peer >= members:
                raise self.fail(f"{path}.peer", f"{peer}, but its communicator has {members} "
                                "members")

    def snapshot(self, s, path: str, rank: int) -> dict:
        """A recorder snapshot (FlightRecorder.snapshot) of a communicator holding `rank`."""
        s = self.obj(s, path)
        self.text(self.need(s, "key", path), f"{path}.key")
        members = self.wholes(self.need(s, "world_ranks", path), f"{path}.world_ranks")
        if rank not in members or len(set(members)) != len(members):
            raise self.fail(f"{path}.world_ranks", f"{members}: want distinct ranks, this "
                            f"dump's rank {rank} among them")
        self.whole(self.need(s, "seq", path), f"{path}.seq")
        for key in ("p2p_seq", "rank", "size"):
            if key in s:
                self.whole(s[key], f"{path}.{key}")
        for key in ("sent", "recvd"):
            self.wholes(self.need(s, key, path), f"{path}.{key}", len(members))
        if "recording" in s:
            self.want(isinstance(s["recording"], bool), s["recording"], f"{path}.recording",
                      "true or false")
        for key in ("active", "last_collective"):
            if s.get(key) is not None:
                self.entry(s[key], f"{path}.{key}", len(members))
        if "entries" in s:
            self.want(isinstance(s["entries"], list), s["entries"], f"{path}.entries",
                      "a list of entries")
            for i, e in enumerate(s["entries"]):
                self.entry(e, f"{path}.entries[{i}]", len(members))
        return s

    def expected(self, v, path: str) -> None:
        """The plan's positions (expected.positions): key -> {collective|p2p: where}."""
        for key, row in self.obj(v, path).items():
            for which, w in self.obj(row, f"{path}[{key!r}]").items():
                at = f"{path}[{key!r}].{which}"
                self.want(which in ("collective", "p2p"), which, at, "'collective' or 'p2p'")
                w = self.obj(w, at)
                for k in ("made", "of"):
                    self.whole(self.need(w, k, at), f"{at}.{k}")
                if not w["of"]:
                    continue  # no calls planned there: the report says nothing of it
                # in a planned call (at), or between two (next), and which the plan says
                where = "at" if "at" in w else "next"
                self.whole(self.need(w, where, at), f"{at}.{where}")
                self.text(self.need(w, "planned", at), f"{at}.planned")


def check_dump(data, name: str) -> dict:
    """One dump's JSON, checked (module doc); returns it."""
    c = Checker(name)
    d = c.obj(data, "(top level)")
    rank = c.whole(c.need(d, "rank", ""), "rank")
    if "size" in d and c.whole(d["size"], "size", 1) <= rank:
        raise c.fail("size", f"{d['size']}, but the dump is of rank {rank}")
    for key in ("host", "reason", "failure"):
        if d.get(key) is not None:
            c.text(d[key], key)
    if "pid" in d:
        c.whole(d["pid"], "pid")
    for key in ("time", "idle_s"):
        if d.get(key) is not None:
            c.number(d[key], key)
    comms = d.get("comms", [])
    c.want(isinstance(comms, list), comms, "comms", "a list of recorder snapshots")
    members = {}
    for i, s in enumerate(comms):
        s = c.snapshot(s, f"comms[{i}]", rank)
        members[s["key"]] = len(s["world_ranks"])
    if d.get("active") is not None:
        c.entry(d["active"], "active", None, keyed=True)
        key = d["active"]["key"]
        if key in members and d["active"]["kind"] == "p2p" and d["active"]["peer"] >= \
                members[key]:
            raise c.fail("active.peer", f"{d['active']['peer']}, but {key} has "
                         f"{members[key]} members")
    if "main_stack" in d:
        c.texts(d["main_stack"], "main_stack")
    if d.get("expected") is not None:
        c.expected(d["expected"], "expected")
    return d


def check_dumps(files: dict[Path, dict]) -> dict[int, dict]:
    """{rank: dump} of every file's checked dump; DumpError when the dumps disagree: two of
    one rank, a file named for another rank, different world sizes or members of one
    communicator (dumps of different jobs, or edited)."""
    dumps: dict[int, dict] = {}
    where: dict[int, Path] = {}
    for f, data in files.items():
        d = check_dump(data, str(f))
        rank = d["rank"]
        if rank in dumps:  # the one a dict of ranks would silently drop
            raise DumpError(f"{where[rank]} and {f}: both are dumps of rank {rank}; the dumps "
                            f"disagree: {FIX}")
        dumps[rank], where[rank] = d, f
    for rank, f in where.items():  # write_dump names each file for its rank
        named = RANK_FILE.fullmatch(f.name)
        if named and int(named.group(1)) != rank:
            raise DumpError(f"{f}: rank: {rank}, but the file is named for rank "
                            f"{named.group(1)}; {FIX}")
    sizes = {d["size"]: r for r, d in dumps.items() if "size" in d}
    if len(sizes) > 1:
        (a, ra), (b, rb) = sorted(sizes.items())[:2]
        raise DumpError(f"{where[ra]} and {where[rb]}: world sizes {a} and {b}; the dumps "
                        "disagree (of different jobs?): dump the job again and read one job's "
                        "dumps")
    seen: dict[str, tuple[list, int]] = {}
    for r, d in sorted(dumps.items()):
        for s in d.get("comms", []):
            first = seen.setdefault(s["key"], (s["world_ranks"], r))
            if first[0] != s["world_ranks"]:
                raise DumpError(f"{where[first[1]]} and {where[r]}: communicator {s['key']} has "
                                f"members {first[0]} in one and {s['world_ranks']} in the "
                                f"other; the dumps disagree: {FIX}")
    return dumps
