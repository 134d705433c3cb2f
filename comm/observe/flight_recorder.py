"""Flight recorder: each communicator's ring buffer of its last N operations.

Every collective and p2p call of a Communicator (communicator.py) records one entry before it
reaches the backend and completes it afterwards (or, for `async_op=True`, in `Work.wait()`).
The entries live in C (flight_ring.c, the base class of FlightRecorder): preallocated structs
that a call fills with numbers, so recording allocates nothing that lives on. A handle (an int)
names an entry; reading one gives a new plain list:

    [seq, op, shape, dtype, bytes, peer, t_start, t_wait, t_end, state]

- seq: collectives are numbered 1, 2, ... per communicator, so the n-th collective of every
  member rank is the same call (a mismatch is a divergence); p2p ops have their own counter.
- shape, dtype: the tensor's shape (a tuple) and torch.dtype; bytes: its size, read with the
  shape from torch's C++ tensor where the install built the reader (tensor_reader.cpp).
- peer: -1 for a collective, else the peer rank of a send/recv in this communicator.
- t_*: time.monotonic(); t_wait is when wait() started on an async op (0.0 before).
- state: STARTED (in a blocking call), POSTED (async, not waited yet), WAITING (in wait()),
  ENQUEUED (NCCL: on the stream, not known complete), DONE or FAILED.

Collectives and p2p ops have a ring each, indexed by their seq, so the newest entry of either is
found without a search: the watchdog reads it (a blocking call in progress is the newest entry,
STARTED) and `active`, the entry a wait() is blocked on; the deadline runs from its t_start, or
t_wait for a wait(). The hot path (Communicator._call and _p2p) is one C call per op, `run`,
which numbers and counts the op, starts the entry, calls the backend and ends it; Work.wait
adds `wait_begin` and `wait_end` (BENCHMARKS.md, "The watchdog's cost"; bench_watchdog.py).

The rings are also the communicator's byte counter (`stats`, `count_as`, `count`) and number
every op (`seq`, `p2p_seq`) and every p2p message per peer (`sent`, `recvd`: a dump shows who
stopped sending even after the ring has wrapped) whether or not entries are kept. So the Python
of a comm call is the same recorded or not, and recording costs only the entry.

SOAPSTONE_FLIGHT_RECORDER=N keeps the last N entries per communicator (default 512; rounded up
to a power of two, so that a seq finds its slot with a mask); 0 keeps none, and the watchdog
then works from samples of the main thread's stack (see status.sample_blocked); dumps hold
the op each rank is in, its number and the per-peer counts, not a history. `keep(N)` changes
it for one communicator. A recorder exists either way (`recording` says which): it names the
communicator.
Reading (dumps, the watchdog's status replies): `snapshot()` turns a recorder into JSON data.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

from soapstone.comm.errors import UserError
from soapstone.comm.observe._flight_ring import STATES, Ring

SEQ, OP, SHAPE, DTYPE, NBYTES, PEER, T_START, T_WAIT, T_END, STATE = range(10)
STARTED, POSTED, WAITING, ENQUEUED, DONE, FAILED = STATES
IN_FLIGHT = (STARTED, POSTED, WAITING, ENQUEUED)
SENDS = ("send", "isend")
DEFAULT_CAPACITY = 512
_now = time.monotonic


class RecorderError(UserError):
    """A bad SOAPSTONE_FLIGHT_RECORDER value."""


def capacity_from_env() -> int:
    """SOAPSTONE_FLIGHT_RECORDER: entries kept per communicator (0: off; default 512)."""
    text = os.environ.get("SOAPSTONE_FLIGHT_RECORDER", "").strip()
    if not text:
        return DEFAULT_CAPACITY
    if not text.isdigit():
        raise RecorderError(
            f"SOAPSTONE_FLIGHT_RECORDER={text!r} must be a whole number of entries >= 0 "
            f"(0 turns the flight recorder off; default {DEFAULT_CAPACITY})")
    return int(text)


# every live recorder, for the watchdog and the dumps (weak: a recorder lives with its comm)
_live: weakref.WeakValueDictionary[int, FlightRecorder] = weakref.WeakValueDictionary()
_made: dict[tuple, int] = {}  # (label, world ranks) -> recorders made with it, for `index`
_lock = threading.Lock()
_ids = iter(range(1 << 62))


def live_recorders() -> list[FlightRecorder]:
    """Every recorder whose communicator is still referenced, oldest first."""
    with _lock:
        items = sorted(_live.items())
    return [r for _, r in items]


def new_recorder(comm) -> FlightRecorder:
    """The recorder of a new communicator (not recording when SOAPSTONE_FLIGHT_RECORDER=0); its
    world ranks come from `comm.mpi`, the MPI communicator over the same ranks."""
    capacity = capacity_from_env()
    mpi = getattr(comm, "mpi", None)
    label, ranks = "world", list(range(comm.size))
    if mpi is not None:
        from mpi4py import MPI

        if mpi != MPI.COMM_WORLD:
            label = "split"
            world_group, group = MPI.COMM_WORLD.Get_group(), mpi.Get_group()
            try:
                ranks = list(group.Translate_ranks(list(range(comm.size)), world_group))
            finally:
                group.Free()
                world_group.Free()
    return FlightRecorder(capacity, comm.rank, comm.size, ranks, label)


def _power_of_two(capacity: int) -> int:
    return 1 << max(0, capacity - 1).bit_length() if capacity > 0 else 0


class FlightRecorder(Ring):
    """The rings of one communicator (see the module doc). `rank`, `size`: in the communicator;
    `world_ranks[i]`: the world rank of its rank i; `label`: what it is (a mesh axis name like
    'data' or 'data+model', 'world', or 'split'). The storage and the recording methods are the
    C base class's (flight_ring.c): `run`, `start`, `done`, `fail`, `post`, `wait_begin`,
    `wait_end`, `enqueued`, `complete`, `entry`, `newest`, `entries`, `keep`, and `seq`,
    `p2p_seq`, `current`, `active`, `sent`, `recvd`; the byte counter's `count_as`, `count`,
    `stats`, `reset_stats`. Entries are named by handles (ints); reading one gives a new
    list."""

    __slots__ = ("size", "rank", "world_ranks", "label", "index", "pending", "recording",
                 "sampled", "__weakref__")

    def __init__(self, capacity: int, rank: int, size: int, world_ranks: list[int],
                 label: str):
        self.recording = capacity > 0
        super().__init__(_power_of_two(capacity), size)
        self.rank, self.size = rank, size
        self.world_ranks = list(world_ranks)
        self.pending: list[tuple[int, object]] = []  # NCCL: (handle, CUDA event) not yet fired
        self.sampled: list | None = None  # not recording: the op the watchdog saw it blocked in
        self.label = ""
        self.index = 0
        self.set_label(label)
        with _lock:
            _live[next(_ids)] = self

    def set_label(self, label: str) -> None:
        """Name this communicator (a mesh axis); `index` tells apart communicators with the same
        label and ranks (made in the same order on every member)."""
        key = (label, tuple(self.world_ranks))
        with _lock:
            self.index = _made.get(key, 0)
            _made[key] = self.index + 1
        self.label = label

    @property
    def key(self) -> str:
        """The same string on every member rank: label, world ranks, index."""
        ranks = ",".join(map(str, self.world_ranks))
        return f"{self.label}[{ranks}]" + (f"#{self.index}" if self.index else "")

    # -- recording by name, step by step: an entry can be left STARTED, as a rank blocked in
    # a call looks (the in-process tests build their divergences so). The comm layer does
    # not use these: every op goes through `run` (Communicator._call and _p2p).
    def collective(self, op: str, t, posted: bool = False) -> int:
        """Record collective `op` on tensor `t` starting now (posted: async, not waited); its
        handle."""
        self.start(op, t, t.dtype)
        return self.post() if posted else self.current

    def p2p(self, op: str, t, peer: int) -> int:
        """Record a send or recv with `peer` (a rank of this communicator) starting now; its
        handle."""
        self.start(op, t, t.dtype, peer, op in SENDS)
        return self.current

    def enqueue(self, h: int, event) -> None:
        """NCCL: entry `h` is on the stream; `event` (a CUDA event recorded after it) tells
        when it completed. The watchdog polls it (state ENQUEUED until then)."""
        self.enqueued(h)
        self.pending.append((h, event))

    def blocked(self) -> list | None:
        """The entry this rank is held up in on this communicator, if any: a wait(), the newest
        collective or p2p entry while STARTED, or (NCCL) the oldest op still on the stream."""
        if not self.recording:
            return self.sampled
        if self.active:
            e = self.entry(self.active)
            if e is not None and e[STATE] == WAITING:
                return e
        for p2p in (False, True):
            e = self.entry(self.newest(p2p))
            if e is not None and e[STATE] == STARTED:
                return e
        pending = self.pending
        return self.entry(pending[0][0]) if pending else None

    def last_activity(self) -> float:
        """When this communicator's newest entries ended (or started, if still running): a
        time.monotonic() value, 0.0 before any."""
        if not self.recording:
            return 0.0
        times = [0.0]
        for p2p in (False, True):
            e = self.entry(self.newest(p2p))
            if e is not None:
                times.append(e[T_END] or e[T_START])
        return max(times)

    # -- reading ------------------------------------------------------------------------------
    def entries(self) -> list[list]:
        """The kept entries of both rings, oldest first by start time (copies, safe to read from
        another thread)."""
        if not self.recording:
            return [list(self.sampled)] if self.sampled else []
        out = super().entries()
        out.sort(key=lambda e: e[T_START])
        return out

    def last_collective(self) -> list | None:
        """The newest collective entry (None before the first; not recording: the one the
        rank is blocked in, if any)."""
        if not self.recording:
            e = self.sampled
            return None if e is None or e[PEER] >= 0 else list(e)
        return self.entry(self.newest(False))

    def counts(self) -> tuple[int, int]:
        """(collectives, p2p ops) started on this communicator, recorded or not."""
        return self.seq, self.p2p_seq

    def keep(self, capacity: int) -> None:
        """Keep the last `capacity` ops from now on (0: none, as SOAPSTONE_FLIGHT_RECORDER=0;
        rounded up to a power of two), dropping the entries kept so far; numbering and the
        byte counter go on."""
        super().keep(_power_of_two(capacity))
        self.recording = capacity > 0

    def snapshot(self, now: float | None = None, entries: bool = True) -> dict:
        """This recorder as JSON data: identity, counters, the active op and the entries
        (times as seconds before `now`, a time.monotonic() value)."""
        now = _now() if now is None else now
        active = self.blocked()
        seq, p2p_seq = self.counts()
        out = {
            "key": self.key, "label": self.label, "world_ranks": self.world_ranks,
            "rank": self.rank, "size": self.size, "seq": seq, "p2p_seq": p2p_seq,
            "recording": self.recording, "sent": self.sent, "recvd": self.recvd,
            "active": None if active is None else describe(active, now),
        }
        last = self.last_collective()
        out["last_collective"] = None if last is None else describe(last, now)
        if entries:
            out["entries"] = [describe(e, now) for e in self.entries()]
        return out


def describe(e: list, now: float) -> dict:
    """One entry as JSON data; ages in seconds before `now`."""
    from soapstone.comm.dtypes import dtype_name

    started = e[T_START]
    d = {"seq": e[SEQ], "kind": "p2p" if e[PEER] >= 0 else "collective", "op": e[OP],
         "shape": list(e[SHAPE]), "dtype": dtype_name(e[DTYPE]), "bytes": e[NBYTES],
         "state": e[STATE], "started_s_ago": round(now - started, 6)}
    if e[PEER] >= 0:
        d["peer"] = e[PEER]
    if e[T_WAIT]:
        d["waiting_s"] = round((e[T_END] or now) - e[T_WAIT], 6)
    if e[T_END]:
        d["duration_s"] = round(e[T_END] - started, 6)
    else:
        d["blocked_s"] = round(now - (e[T_WAIT] or started), 6)
    return d


def entry_text(d: dict, label: str = "") -> str:
    """One described entry in a line: `allreduce #17 on data (4,) float32 16 B: waiting 5.0s`."""
    where = f" on {label}" if label else ""
    peer = ""
    if d.get("kind") == "p2p":
        peer = (" to" if d["op"] in SENDS else " from") + f" rank {d['peer']}"
        name = f"{d['op']}{peer} (p2p #{d['seq']}){where}"
    else:
        name = f"{d['op']} #{d['seq']}{where}"
    shape = "(" + ", ".join(map(str, d["shape"])) + ("," if len(d["shape"]) == 1 else "") + ")"
    state = d["state"]
    if state == DONE:
        how = f"done in {d.get('duration_s', 0) * 1e3:.3g} ms, {d['started_s_ago']:.3g}s ago"
    elif state in (STARTED, WAITING, ENQUEUED):
        how = f"{state}, blocked {d.get('blocked_s', 0):.3g}s"
    else:
        how = f"{state} {d['started_s_ago']:.3g}s ago"
    return f"{name} {shape} {d['dtype']} {d['bytes']} B: {how}"
