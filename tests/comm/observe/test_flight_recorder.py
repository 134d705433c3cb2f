"""The flight recorder's ring and the hang diagnosis, in-process (no MPI: pure data).

Real communicators recording real ops: tests/comm/observe/recorder_cases.py (under mpiexec)."""

from __future__ import annotations

import pytest
import torch

from soapstone.comm.accounting import bus_factor
from soapstone.comm.observe import diagnose
from soapstone.comm.observe.flight_recorder import (
    DONE,
    FAILED,
    NBYTES,
    POSTED,
    SHAPE,
    STARTED,
    STATE,
    T_END,
    T_START,
    WAITING,
    FlightRecorder,
    RecorderError,
    capacity_from_env,
    entry_text,
)
from soapstone.comm.observe.watchdog import WatchdogError, check_timeout, timeout_from_env
from soapstone.comm.op_table import COUNTED_OPS


def rec(capacity=4, rank=0, size=2, label="data"):
    r = FlightRecorder(capacity, rank, size, list(range(size)), label)
    for op in COUNTED_OPS:  # as a Communicator does
        r.count_as(op, *bus_factor(op, size))
    return r


def test_ring_keeps_the_newest_entries_in_order():
    r = rec(capacity=4)
    t = torch.ones(3, 2)
    for _ in range(6):
        r.done(r.collective("allreduce", t))
    kept = r.entries()
    assert [e[0] for e in kept] == [3, 4, 5, 6]
    assert all(e[STATE] == DONE for e in kept)
    snap = r.snapshot()
    assert snap["seq"] == 6 and snap["last_collective"]["seq"] == 6
    assert snap["entries"][0]["shape"] == [3, 2] and snap["entries"][0]["dtype"] == "float32"
    assert snap["entries"][0]["bytes"] == 24  # worked out from the shape and dtype


def test_an_entry_overwritten_by_the_wrapped_ring_is_gone():
    r = rec(capacity=2)
    t = torch.ones(2)
    first = r.collective("allreduce", t)
    for _ in range(2):
        r.done(r.collective("allreduce", t))
    assert r.entry(first) is None
    r.done(first)  # a stale handle changes nothing
    assert [e[0] for e in r.entries()] == [2, 3]


def test_states_of_blocking_async_and_failed_ops():
    r = rec()
    t = torch.ones(2)
    e = r.collective("allgather", t)
    assert r.entry(e)[STATE] == STARTED and r.blocked()[:T_START] == r.entry(e)[:T_START]
    r.fail(e)
    assert r.entry(e)[STATE] == FAILED and r.blocked() is None
    w = r.collective("allreduce", t, posted=True)
    assert r.entry(w)[STATE] == POSTED and r.blocked() is None  # nobody blocked on it yet
    r.wait_begin(w)
    assert r.entry(w)[STATE] == WAITING and r.blocked()[:T_START] == r.entry(w)[:T_START]
    assert r.active == w
    r.wait_end(w)
    assert r.blocked() is None and r.entry(w)[STATE] == DONE and r.active == 0
    w = r.collective("allreduce", t, posted=True)
    r.wait_begin(w)
    r.fail(w)  # what Work.wait does when the backend's wait raises
    assert r.blocked() is None and r.entry(w)[STATE] == FAILED and r.active == 0


def test_times_are_monotonic_clock_seconds():
    import time

    r = rec()
    t = torch.ones(2)
    before = time.monotonic()
    h = r.collective("allreduce", t)
    time.sleep(0.05)
    r.done(h)
    after = time.monotonic()
    e = r.entry(h)
    assert before - 1e-3 <= e[T_START] < e[T_END] <= after + 1e-3
    assert e[T_END] - e[T_START] == pytest.approx(0.05, abs=0.04)


def test_run_records_around_the_call_and_marks_what_it_raised():
    r = rec()
    t = torch.ones(4, dtype=torch.float64)
    assert r.run("allreduce", t, t.dtype, -1, False, 1, False, lambda x: x + 1, (t,))[0] == 2
    assert r.entry(r.current)[NBYTES] == 32 and r.entry(r.current)[STATE] == DONE
    with pytest.raises(ZeroDivisionError):
        r.run("broadcast", t, t.dtype, -1, False, 1, False, lambda: 1 / 0, ())
    assert r.entry(r.current)[1:3] == ["broadcast", (4,)]
    assert r.entry(r.current)[STATE] == FAILED
    r.run("isend", t, t.dtype, 1, True, 1, True, lambda: None, ())
    assert r.entry(r.current)[STATE] == POSTED and r.sent == [0, 1] and r.p2p_seq == 1
    big = torch.ones([1] * 10)  # more dims than an entry holds inline
    r.run("allreduce", big, big.dtype, -1, False, 1, False, lambda: None, ())
    assert r.entry(r.current)[2] == (1,) * 10


def test_p2p_counts_per_peer_and_its_own_seq():
    r = rec(size=3, rank=1)
    t = torch.ones(2)
    r.done(r.p2p("isend", t, 2))
    r.done(r.p2p("irecv", t, 0))
    r.done(r.p2p("recv", t, 0))
    assert r.sent == [0, 0, 1] and r.recvd == [2, 0, 0]
    assert r.seq == 0 and r.p2p_seq == 3
    text = entry_text(r.snapshot()["entries"][-1], "pipe")
    assert text.startswith("recv from rank 0 (p2p #3) on pipe (2,) float32 8 B: done")


def test_recorders_with_the_same_label_and_ranks_get_distinct_keys():
    a, b = rec(label="solo"), rec(label="solo")
    assert a.key != b.key and a.key.startswith("solo[0,1]")


def test_bad_settings_are_user_errors(monkeypatch):
    monkeypatch.setenv("SOAPSTONE_FLIGHT_RECORDER", "-3")
    with pytest.raises(RecorderError, match="whole number"):
        capacity_from_env()
    monkeypatch.setenv("SOAPSTONE_COLLECTIVE_TIMEOUT", "-1")
    with pytest.raises(WatchdogError, match=">= 0"):
        timeout_from_env()
    for bad in ("nan", "inf", "soon"):
        with pytest.raises(WatchdogError):
            check_timeout(bad)
    assert check_timeout("0") == 0 and check_timeout(2.5) == 2.5


# -- diagnosis on hand-made statuses ---------------------------------------------------------
def _entry(seq, op, state="done", shape=(4,), kind="collective", peer=None, blocked=0.0):
    e = {"seq": seq, "kind": kind, "op": op, "shape": list(shape), "dtype": "float32",
         "bytes": 16, "state": state, "started_s_ago": 1.0}
    if peer is not None:
        e["peer"] = peer
    if state in ("started", "waiting"):
        e["blocked_s"] = blocked
    else:
        e["duration_s"] = 0.001
    return e


def _status(rank, seq, last, active=None, sent=(0, 0), recvd=(0, 0), key="data[0,1]"):
    snap = {"key": key, "label": "data", "world_ranks": [0, 1], "rank": rank, "size": 2,
            "seq": seq, "p2p_seq": 0, "sent": list(sent), "recvd": list(recvd),
            "active": active, "last_collective": last, "entries": [last] if last else []}
    return {"rank": rank, "reason": "test", "idle_s": 2.0, "comms": [snap],
            "active": None if active is None else {"key": key, **active},
            "main_stack": [f'  File "job.py", line {10 + rank}, in step', "    work()"]}


def test_a_rank_behind_is_named_with_what_it_is_doing():
    waiting = _entry(5, "allreduce", "started", blocked=3.0)
    statuses = {0: _status(0, 5, waiting, active=waiting), 1: _status(1, 4, _entry(4, "allreduce"))}
    behind, other, silent = diagnose.missing_ranks(statuses, "data[0,1]", waiting, 0)
    assert (behind, other, silent) == ([1], [], [])
    (text,) = diagnose.divergences(statuses)
    assert text.startswith("rank 1 behind on data[0,1]: rank 0 reached allreduce #5")
    assert "rank 1 has started 4 collectives there and is not in a communication call" in text


def test_ranks_calling_different_collectives_are_a_disagreement():
    mine = _entry(3, "allreduce", "started", blocked=3.0)
    theirs = _entry(3, "allgather", "started", blocked=3.0)
    statuses = {0: _status(0, 3, mine, active=mine), 1: _status(1, 3, theirs, active=theirs)}
    behind, other, _ = diagnose.missing_ranks(statuses, "data[0,1]", mine, 0)
    assert behind == [] and [r for r, _ in other] == [1] and other[0][1]["op"] == "allgather"
    found = diagnose.divergences(statuses)
    assert found == ["ranks disagree on collective #3 of data[0,1]: rank 0 called "
                     "allreduce(4,) float32; rank 1 called allgather(4,) float32"]


def test_a_receive_whose_message_was_never_sent():
    wait = _entry(1, "irecv", "waiting", kind="p2p", peer=0, blocked=3.0)
    statuses = {0: _status(0, 0, None, sent=(0, 0)),
                1: _status(1, 0, None, active=wait, recvd=(1, 0))}
    behind, _, _ = diagnose.missing_ranks(statuses, "data[0,1]", wait, 1)
    assert behind == [0]
    (text,) = diagnose.divergences(statuses)
    assert "rank 1 is blocked in irecv from rank 0 (p2p #1) on data[0,1]:" in text
    assert "it waits for message 1 from rank 0 on data[0,1], which has sent 0" in text


def test_a_rank_without_status_is_reported_as_silent():
    waiting = _entry(2, "allreduce", "started", blocked=3.0)
    statuses = {0: _status(0, 2, waiting, active=waiting)}
    assert diagnose.missing_ranks(statuses, "data[0,1]", waiting, 0) == ([], [], [1])


def test_enqueued_entries_complete_in_stream_order():
    """The NCCL bookkeeping (events stand in for CUDA events: no GPU needed)."""
    from soapstone.comm.observe.watchdog import Watchdog

    class Event:
        def __init__(self, fired):
            self.fired = fired

        def query(self):
            return self.fired

    r = rec()
    t = torch.ones(2)
    events = [Event(True), Event(False), Event(True)]
    handles = []
    for ev in events:
        h = r.collective("allreduce", t)
        r.done(h)
        r.enqueue(h, ev)
        handles.append(h)
    assert r.blocked()[0] == 1
    Watchdog._poll_events(r)
    assert r.entry(handles[0])[STATE] == DONE
    assert r.blocked()[0] == 2  # the stream is stuck there: the third waits behind it
    events[1].fired = True
    Watchdog._poll_events(r)
    assert r.pending == [] and all(r.entry(h)[STATE] == DONE for h in handles)


def test_the_rings_hold_what_they_keep_and_release_what_they_overwrite():
    """The C rings own a reference to each kept entry's op name and dtype (and its shape, past
    eight dims): wrapping many times leaves no reference behind."""
    import sys

    r = rec(capacity=4)
    op = "".join(["all", "reduce"])  # a string of its own, not the interned literal
    t, big = torch.ones(3), torch.ones([1] * 10)

    def record(ring, n):
        for _ in range(n):
            ring.run(op, t, t.dtype, -1, False, 1, False, lambda: None, ())
            ring.run(op, big, big.dtype, -1, False, 1, False, lambda: None, ())

    record(r, 10)
    before = sys.getrefcount(op)
    record(r, 1000)
    assert sys.getrefcount(op) == before  # 4 entries hold it, whatever came before
    del r
    assert sys.getrefcount(op) == before - 4


class _Subclass(torch.Tensor):
    pass


TENSORS = {
    "0-d": torch.tensor(3.0), "1-d": torch.zeros(5), "3-d": torch.zeros(2, 3, 4),
    "empty": torch.zeros(0, 3), "strided view": torch.zeros(4, 6)[:, :2],
    "bfloat16": torch.zeros(3, dtype=torch.bfloat16),
    "Parameter": torch.nn.Parameter(torch.zeros(7, 2)),
    "subclass": torch.zeros(3, 2).as_subclass(_Subclass), "9 dims": torch.zeros([1] * 9),
}


def _recorded_shapes():
    r = rec(capacity=16)
    out = {}
    for name, t in TENSORS.items():
        nbytes = r.start("allreduce", t, t.dtype)
        e = r.entry(r.current)
        out[name] = (tuple(e[SHAPE]), e[NBYTES], nbytes)
    return out


def test_entries_hold_torchs_shape_and_bytes_for_every_kind_of_tensor():
    assert _recorded_shapes() == {k: (tuple(t.shape), t.nbytes, t.nbytes)
                                  for k, t in TENSORS.items()}


def test_this_install_reads_tensors_from_cpp_and_another_torchs_reader_is_never_used(
        monkeypatch):
    """`make install` builds the C++ tensor reader against this torch and the rings use it; a
    reader built for another torch is left alone, and shapes then come from torch's getters."""
    from soapstone.comm import communicator
    from soapstone.comm.observe import _tensor_reader

    assert communicator.TENSOR_READING.startswith("torch's C++ tensor")
    monkeypatch.setattr(_tensor_reader, "built_for", "1.0.0")
    try:
        how = communicator._connect_tensor_reading()
        assert "built for torch 1.0.0" in how and "reinstall soapstone" in how
        test_entries_hold_torchs_shape_and_bytes_for_every_kind_of_tensor()
    finally:
        monkeypatch.undo()
        assert communicator._connect_tensor_reading() == communicator.TENSOR_READING


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_the_byte_counter_counts_accountings_bus_bytes_whether_or_not_it_records(size):
    """The rings count every op as it passes, with accounting's formula (which explain uses to
    predict the counters), and number it, with entries kept or not."""
    from soapstone.comm.accounting import bus_bytes

    for capacity in (4, 0):
        r = rec(capacity=capacity, size=size)
        want: dict[str, list[int]] = {}
        t = torch.ones(3, 5)  # 60 bytes: not a multiple of most sizes, so rounding shows
        for op, times in (("allreduce", 1), ("allreduce", 1), ("allgather", size),
                          ("reduce_scatter", 1), ("alltoall", 1), ("broadcast", 1)):
            r.run(op, t, t.dtype, -1, False, times, False, lambda: None, ())
            row = want.setdefault(op, [0, 0])
            row[0], row[1] = row[0] + 1, row[1] + bus_bytes(op, 60 * times, size)
        r.run("barrier", t, t.dtype, -1, False, 0, False, lambda: None, ())  # numbered only
        r.count("alltoallv", 7)
        want["alltoallv"] = [1, bus_bytes("alltoallv", 7, size)]
        if size > 1:
            r.run("isend", t, t.dtype, 1, True, 1, True, lambda: None, ())
            r.run("recv", t, t.dtype, 1, False, 1, False, lambda: None, ())
            want["send"], want["recv"] = [1, 60], [1, 0]
        assert r.stats() == {k: tuple(v) for k, v in want.items()}
        assert (r.seq, r.p2p_seq) == (7, 2 if size > 1 else 0) == r.counts()
        assert len(r.entries()) == min(capacity, 7) + min(capacity, r.p2p_seq)
        r.reset_stats()
        assert r.stats() == {} and r.seq == 7


def test_an_op_the_counter_has_no_row_for_is_refused_before_anything_changes():
    r = rec()
    t = torch.ones(2)
    with pytest.raises(KeyError, match="no row for 'allsum'"):
        r.run("allsum", t, t.dtype, -1, False, 1, False, lambda: None, ())
    assert (r.seq, r.entries(), r.stats()) == (0, [], {})


def test_keep_turns_recording_on_and_off_and_numbering_goes_on():
    r = rec(capacity=0)
    t = torch.ones(2)

    def call():
        r.run("allreduce", t, t.dtype, -1, False, 1, False, lambda: None, ())

    call()
    assert not r.recording and r.entries() == [] and r.current == 0
    r.keep(3)  # rounded up to 4
    assert r.recording and r.capacity == 4
    for _ in range(6):
        call()
    assert [e[0] for e in r.entries()] == [4, 5, 6, 7]
    r.keep(0)
    call()
    assert not r.recording and r.entries() == [] and r.seq == 8
    assert r.stats()["allreduce"][0] == 8


def test_handles_from_before_keep_name_nothing_and_their_wait_still_runs():
    """`keep` drops the entries kept so far: an op in flight across it (the backend call that
    resized the rings, or an async op posted before) finishes without an entry."""
    r = rec(capacity=4)
    t = torch.ones(2)
    h = r.collective("allreduce", t, posted=True)
    assert r.run("allreduce", t, t.dtype, -1, False, 1, False, lambda: r.keep(8) or "ok",
                 ()) == "ok"
    assert r.entry(h) is None and r.entries() == [] and r.capacity == 8
    r.wait_begin(h)
    r.wait_end(h)
    assert r.active == 0 and r.entries() == []
