"""A rank's status, for the watchdog's reports and dumps: its flight recorders, what it is
blocked in (for communicators that do not record, found on the main thread's stack), its
stacks; the dump file and its short stderr form (diagnose.py reads statuses).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from soapstone.comm.observe import expected
from soapstone.comm.observe.diagnose import doing, stack_tail
from soapstone.comm.observe.flight_recorder import (
    STARTED,
    T_START,
    WAITING,
    describe,
    entry_text,
    live_recorders,
)

_COMM_DIR = str(Path(__file__).resolve().parents[1])


def main_stack() -> list[str]:
    """The main thread's Python stack as traceback lines (outermost first), without the frames
    inside soapstone.comm below the first (the call the program made; faulthandler's stacks
    in the dump file have every frame)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    frames = traceback.extract_stack(frame)
    while len(frames) > 1 and all(f.filename.startswith(_COMM_DIR) for f in frames[-2:]):
        frames.pop()
    if frames and frames[-1].filename.startswith(_COMM_DIR) and len(frames) > 1 and \
            frames[-1].name in ("abort_on_exception", "_on_signals"):
        frames.pop()  # the failure handler or the watchdog itself: not where the program is
    return "".join(traceback.format_list(frames)).rstrip("\n").split("\n")


def all_stacks() -> str:
    """faulthandler's dump of every thread's stack (the text it writes to a file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def status(reason: str, entries: bool = True) -> dict:
    """This process's state for a dump or a reply (see diagnose.py for the format)."""
    from mpi4py import MPI

    now = time.monotonic()
    sample_blocked(now)
    comms, active, last_end = [], None, 0.0
    for rec in live_recorders():
        comms.append(rec.snapshot(now, entries))
        e = rec.blocked()
        if e is not None:
            active = {"key": rec.key, **describe(e, now)}
        last_end = max(last_end, rec.last_activity())
    return {"rank": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size(),
            "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
            "time": time.time(), "active": active,
            "idle_s": round(now - last_end, 3) if last_end else None,
            "comms": comms, "main_stack": main_stack(),
            "expected": expected.positions(comms, active)}  # the layout's plan, if handed one



def say(rank: int, lines, stream=None) -> None:
    """Write `lines` to stderr (or `stream`), each prefixed with the rank, and flush."""
    stream = stream or sys.stderr
    with contextlib.suppress(Exception):
        stream.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        stream.flush()


def dump_lines(st: dict, limit: int = 4) -> list[str]:
    """The short stderr form of a dump: what the rank is doing, its newest ops, its stack."""
    lines = [f"flight recorder ({st['reason']}): {doing(st)}"]
    newest = []
    for snap in st["comms"]:
        for e in snap.get("entries", ())[-limit:]:
            newest.append((-e["started_s_ago"], snap["key"], e))
    newest.sort(key=lambda x: x[0])
    for _, key, e in newest[-limit:]:
        lines.append("  " + entry_text(e, key))
    lines.append("  main thread, innermost frames:")
    lines.extend("  " + s for s in stack_tail(st, 4))
    return lines


def write_dump(st: dict, trace_dir: str | None) -> str | None:
    """Write `st` (plus every thread's stack) to trace_dir/rank<R>.json; return the path."""
    if not trace_dir:
        return None
    st = dict(st, stacks=all_stacks())
    path = Path(trace_dir, f"rank{st['rank']}.json")
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(st, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        say(st["rank"], [f"cannot write the dump {path}: {e}"])
        return None
    return str(path)


# -- communicators that do not record: where the main thread is, from its stack -------------
_sample: dict = {"frame": None, "rec": None}
_codes: dict = {}


def _blocking_codes() -> dict:
    """The code objects of the comm calls a main thread can be found blocked in."""
    if not _codes:
        from soapstone.comm.communicator import blocking_calls

        _codes.update(blocking_calls())
    return _codes


def sample_blocked(now: float) -> None:
    """For communicators that do not record (SOAPSTONE_FLIGHT_RECORDER=0): find the comm call
    the main thread is in from its stack and keep it as that recorder's `sampled` entry,
    started when this call was first seen (the same frame object seen again is the same call,
    still blocked). This costs the hot path nothing; the deadline is then good to a poll."""
    codes = _blocking_codes()
    frame = sys._current_frames().get(threading.main_thread().ident)
    found = None
    for _ in range(64):
        if frame is None:
            break
        name = codes.get(frame.f_code)
        if name is not None:
            found = _sampled_call(frame, name)
            break
        frame = frame.f_back
    prev = _sample["rec"]
    if found is None or found[0] is not prev or frame is not _sample["frame"]:
        if prev is not None:
            prev.sampled = None
        _sample["frame"], _sample["rec"] = None, None
        if found is None:
            return
        rec, entry = found
        rec.sampled = entry
        entry[T_START] = now
        _sample["frame"], _sample["rec"] = frame, rec


def _sampled_call(frame, name: str):
    """(recorder, entry) for a comm call found on the stack, or None when it is recorded (the
    recorder watches it) or cannot be attributed."""
    import torch

    local = frame.f_locals
    obj = local.get("self")
    if name == "wait":
        info = getattr(obj, "_entry", None)
        if getattr(obj, "_rec", None) is not None or not isinstance(info, tuple):
            return None
        comm, op, t, peer = info
    else:
        comm = obj
        flight = getattr(comm, "flight", None)
        if flight is None or flight.recording:
            return None
        op = local.get("op", name) if name == "p2p" else name
        t, peer = local.get("t"), local.get("peer", -1)
    if not isinstance(t, torch.Tensor):
        t = torch.empty(0)
    coll, p2p = comm.flight.counts()
    entry = [coll if peer < 0 else p2p, op, t.shape, t.dtype, t.numel() * t.element_size(),
             peer, 0.0, 0.0, 0.0, WAITING if name == "wait" else STARTED]
    return comm.flight, entry
