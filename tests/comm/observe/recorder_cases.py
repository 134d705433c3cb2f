"""Flight-recorder cases, run on every rank by tests/support/mpirun.py (see
tests/comm/observe/test_watchdog.py): every op of a real MPICommunicator leaves one
entry, with the right fields and state."""

from __future__ import annotations

import torch
from mpirun import ranks

from soapstone.comm import Mesh, init
from soapstone.comm.observe import status as rank_status

W = init("mpi")
R, N = W.rank, W.size


def newest(comm, n=1):
    return comm.flight.snapshot()["entries"][-n:]


@ranks(2)
def case_every_collective_leaves_one_entry_with_its_fields():
    rec = W.flight
    start = rec.seq
    x = torch.ones(2 * N, 3)
    W.allreduce(x)
    W.allgather(x, dim=1)
    W.reduce_scatter(x)
    W.broadcast(x, 0)
    W.alltoall(x)
    W.alltoallv(x, [2] * N, [2] * N)
    W.barrier()
    got = newest(W, 7)
    assert [e["op"] for e in got] == ["allreduce", "allgather", "reduce_scatter", "broadcast",
                                      "alltoall", "alltoallv", "barrier"]
    assert [e["seq"] for e in got] == list(range(start + 1, start + 8))
    assert all(e["state"] == "done" and e["kind"] == "collective" for e in got)
    assert got[0]["shape"] == [2 * N, 3] and got[0]["dtype"] == "float32"
    assert got[0]["bytes"] == 2 * N * 3 * 4
    snap = rec.snapshot()
    assert snap["key"] == f"world[{','.join(map(str, range(N)))}]" and snap["active"] is None


@ranks(2)
def case_async_entry_is_posted_until_waited():
    x = torch.ones(4)
    work = W.allreduce(x, async_op=True)
    (e,) = newest(W)
    assert e["state"] == "posted" and e["op"] == "allreduce"
    work.wait()
    (e,) = newest(W)
    assert e["state"] == "done" and "waiting_s" in e


@ranks(2)
def case_p2p_entries_and_per_peer_counters():
    rec = W.flight
    peer = (R + 1) % N
    src = (R - 1) % N
    sent, recvd = rec.sent[peer], rec.recvd[src]
    buf = torch.empty(3)
    works = [W.irecv(buf, src, tag=5), W.isend(torch.full((3,), float(R)), peer, tag=5)]
    for w in works:
        w.wait()
    assert buf[0] == src
    assert rec.sent[peer] == sent + 1 and rec.recvd[src] == recvd + 1
    last = newest(W, 2)
    assert {e["op"] for e in last} == {"irecv", "isend"}
    assert all(e["kind"] == "p2p" and e["state"] == "done" for e in last)


@ranks(2)
def case_entries_carry_each_calls_own_shape_dtype_bytes_and_times():
    """What the hot path writes (the dtype the input check read; p2p and wait() recording
    written out in the communicator) is each call's own, for every dtype and kind of call."""
    peer = src = 1 - R
    W.allreduce(torch.ones(3, 2, dtype=torch.float64))
    W.allreduce(torch.ones(5, dtype=torch.int32), async_op=True).wait()
    works = [W.irecv(torch.empty(4, dtype=torch.int64), src, tag=7),
             W.isend(torch.ones(4, dtype=torch.int64), peer, tag=7)]
    for w in works:
        w.wait()
    c = torch.ones(2, 2, 2, dtype=torch.bfloat16)
    for op in ("send", "recv") if R == 0 else ("recv", "send"):
        getattr(W, op)(c, peer, tag=8)
    coll = [e for e in newest(W, 6) if e["kind"] == "collective"][-2:]
    assert [(e["shape"], e["dtype"], e["bytes"]) for e in coll] == [
        ([3, 2], "float64", 48), ([5], "int32", 20)]
    assert "waiting_s" not in coll[0] and 0 <= coll[1]["waiting_s"] <= coll[1]["duration_s"]
    p2p = sorted((e["seq"], e["op"], e["shape"], e["dtype"], e["bytes"], e["peer"])
                 for e in newest(W, 6) if e["kind"] == "p2p")[-4:]
    last = ("send", "recv") if R == 0 else ("recv", "send")
    assert [e[1:] for e in p2p] == [
        ("irecv", [4], "int64", 32, src), ("isend", [4], "int64", 32, peer),
        (last[0], [2, 2, 2], "bfloat16", 16, peer), (last[1], [2, 2, 2], "bfloat16", 16, peer)]
    assert all(e["state"] == "done" and e["duration_s"] >= 0 for e in newest(W, 6))


@ranks(2)
def case_mesh_communicators_are_named_by_their_axes():
    with Mesh(W, pipe=2, data=N // 2) as mesh:
        data = mesh.comm("data")
        assert data.label == "data" and mesh.comm("pipe", "data").label == "pipe+data"
        snap = data.flight.snapshot()
        assert snap["world_ranks"] == [mesh.rank_of(data=i) for i in range(N // 2)]
        data.allreduce(torch.ones(1))
        assert newest(data)[0]["op"] == "allreduce"


@ranks(2)
def case_status_holds_every_live_recorder_and_the_stack():
    st = rank_status.status("test")
    assert st["rank"] == R and st["size"] == N
    keys = {c["key"] for c in st["comms"]}
    assert W.flight.key in keys and st["active"] is None
    assert any("case_status_holds_every_live_recorder" in line for line in st["main_stack"])
