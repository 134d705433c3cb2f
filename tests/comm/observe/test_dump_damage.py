"""`soapstone debug hang DIR` on dumps that are damaged or disagree: every field the report
reads is checked first (comm/observe/dump_schema.py), so a bad dump is exit 2 naming the file
and the field, never a traceback, and no dump is silently dropped. No MPI: the dumps are
written here, in the format a 2-rank job's watchdog writes (status.status), one rank behind
on the data axis and blocked in a receive its peer has not sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from json_mutants import mutants

from soapstone.dsl.cli import main
from soapstone.dsl.commands.debug import DumpError, hang_report, load_dumps


def entry(seq: int, op: str = "allreduce", state: str = "done", **more) -> dict:
    """A flight-recorder entry as flight_recorder.describe writes it."""
    e = {"seq": seq, "kind": "p2p" if "peer" in more else "collective", "op": op,
         "shape": [4], "dtype": "float32", "bytes": 16, "state": state, "started_s_ago": 0.5}
    e.update({"duration_s": 0.001} if state == "done" else {"blocked_s": 0.4}, **more)
    return e


def snapshot(key: str, rank: int, seq: int, entries: list[dict], active=None, sent=(0, 0),
             recvd=(0, 0)) -> dict:
    """One communicator's recorder snapshot (FlightRecorder.snapshot) on world ranks 0, 1."""
    return {"key": key, "label": key.split("[")[0], "world_ranks": [0, 1], "rank": rank,
            "size": 2, "seq": seq, "p2p_seq": sum(sent) + sum(recvd), "recording": True,
            "sent": list(sent), "recvd": list(recvd), "active": active,
            "last_collective": next((e for e in reversed(entries)
                                     if e["kind"] == "collective"), None),
            "entries": entries}


def sound_dumps() -> dict[int, dict]:
    """Rank 1 waits in allreduce #3 on data; rank 0, behind, waits for a message on pipe."""
    recv = entry(1, "recv", "started", peer=1)
    waiting = entry(3, state="started")
    ranks = {
        0: ([snapshot("data[0,1]", 0, 2, [entry(1), entry(2)]),
             snapshot("pipe[0,1]", 0, 0, [recv], active=recv)], dict(recv, key="pipe[0,1]"),
            {"data[0,1]": {"collective": {"made": 1, "of": 2, "next": 2,
                                          "planned": "allreduce (4,) f32 on data[0,1]"}}}),
        1: ([snapshot("data[0,1]", 1, 3, [entry(2), waiting], active=waiting),
             snapshot("pipe[0,1]", 1, 0, [])], dict(waiting, key="data[0,1]"),
            {"data[0,1]": {"collective": {"made": 2, "of": 2, "at": 1,
                                          "planned": "allreduce (4,) f32 on data[0,1]"},
                           "p2p": {"made": 0, "of": 0}}}),
    }
    return {r: {"rank": r, "size": 2, "host": "node0", "pid": 100 + r, "reason": "SIGUSR1",
                "time": 1.7e9, "active": active, "idle_s": None, "comms": comms,
                "main_stack": ['  File "train.py", line 9, in step', "    loss.backward()"],
                "expected": expected, "stacks": "Thread 0x1 (most recent call first):\n"}
            for r, (comms, active, expected) in ranks.items()}


def write(folder: Path, dumps: dict[int, dict]) -> Path:
    """The dumps as rank<R>.json files in `folder`, as status.write_dump names them."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("rank*.json"):
        old.unlink()
    for r, d in dumps.items():
        (folder / f"rank{r}.json").write_text(json.dumps(d))
    return folder


def test_sound_dumps_are_read_and_diagnosed(tmp_path, capsys):
    assert main(["debug", "hang", str(write(tmp_path, sound_dumps()))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 of 2 ranks dumped (SIGUSR1)")
    assert "rank 0 behind on data[0,1]" in out and "recv from rank 1" in out, out


def set_field(rank: int, path: tuple, value):
    """An edit of rank `rank`'s dump: the field at `path` (keys and list indices) := value."""
    def apply(dumps: dict[int, dict]) -> None:
        d = dumps[rank]
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return apply


# the edits the command once met with a traceback or by dropping a dump, and their one line
DAMAGED = [
    ("comms-a-number", set_field(0, ("comms",), 5), "rank0.json: comms: 5"),
    ("main-stack-a-number", set_field(0, ("main_stack",), 3), "rank0.json: main_stack: 3"),
    ("active-a-number", set_field(0, ("active",), 5), "rank0.json: active: 5"),
    ("two-files-of-rank-1", set_field(0, ("rank",), 1),
     "rank0.json and {dir}/rank1.json: both are dumps of rank 1; the dumps disagree"),
    ("rank-past-the-size", set_field(1, ("rank",), 7), "rank1.json: size: 2, but the dump is "
     "of rank 7"),
    ("sizes-differ", set_field(1, ("size",), 4), "world sizes 2 and 4; the dumps disagree"),
    ("members-differ", set_field(1, ("comms", 0, "world_ranks"), [1, 0]),
     "communicator data[0,1] has members [0, 1] in one and [1, 0] in the other"),
    ("counters-short", set_field(0, ("comms", 1, "recvd"), [0]),
     "rank0.json: comms[1].recvd: [0] is a list, want a list of 2 whole numbers"),
    ("peer-outside", set_field(0, ("active", "peer"), 2),
     "rank0.json: active.peer: 2, but pipe[0,1] has 2 members"),
    ("seq-a-string", set_field(1, ("comms", 0, "seq"), "3"),
     "rank1.json: comms[0].seq: '3' is a string, want a whole number >= 0"),
    ("plan-without-its-call", set_field(1, ("expected", "data[0,1]", "collective"),
                                        {"made": 2, "of": 2}),
     "rank1.json: expected['data[0,1]'].collective.next: missing"),
    ("state-unknown", set_field(1, ("comms", 0, "entries", 0, "state"), "asleep"),
     "rank1.json: comms[0].entries[0].state: 'asleep' is a string, want one of"),
]


@pytest.mark.parametrize("name,damage,needle", DAMAGED, ids=[n for n, _, _ in DAMAGED])
def test_a_damaged_dump_is_bad_input(tmp_path, capsys, name, damage, needle):
    dumps = sound_dumps()
    damage(dumps)
    folder = write(tmp_path / "dumps", dumps)
    assert main(["debug", "hang", str(folder)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out
    assert out.err.startswith(f"error: {folder}/") and needle.format(dir=folder) in out.err, \
        out.err
    assert "dump the job again" in out.err or "read one job's dumps" in out.err, out.err


def test_any_mutated_field_is_a_dump_error_or_read(tmp_path):
    """400 dump pairs, each with one or two fields set to a value of another type or range,
    or deleted: reading them and writing the report raises DumpError or nothing."""
    base = sound_dumps()
    values = [None, -1, 0, 1, 2, 2**40, 1.5, float("nan"), "x", "", [], {}, [1], [0, 1],
              {"a": 1}, True]

    for dumps in mutants(base, values, 400, depth=2):
        folder = write(tmp_path / "fuzz", dumps)
        try:
            hang_report(load_dumps(str(folder)))
        except DumpError:
            pass
