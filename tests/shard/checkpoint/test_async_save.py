"""`run --save DIR --async-save` (shard/checkpoint/async_save.py), through the real command line
under mpiexec: real ranks, real files, real kill -9.

- every checkpoint an async run writes is byte for byte the synchronous run's (rank files and
  index.json), the losses are the same, and a save due while the previous one is in flight
  waits for it: every due step is there and verifies;
- a resume from an async checkpoint continues bitwise (the losses, and the next checkpoint's
  bytes: masters and moments);
- a rank killed (SIGKILL) while its background thread writes leaves the previous complete
  checkpoint as the newest; a resume takes it and repeats the first run bitwise;
- explain's `async staging` line; --async-save without --save is exit 2.
(A full disk during an async write: tests/shard/checkpoint/test_checkpoint_damage.py.)
"""

from __future__ import annotations

import filecmp
from pathlib import Path

from cli_calls import cli
from test_checkpoint import kill_rank_1_mid_save, launch, losses

DP2 = ["run", "examples/gpt.par", "--parallel", "dp2", "--quiet"]


def finished(argv: list[str], env: dict | None = None) -> str:
    """Run `argv` on 2 ranks to the end (exit 0); its stderr."""
    proc = launch(2, argv, env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err, err
    return err


def same_files(a: Path, b: Path) -> None:
    """Two checkpoint directories hold the same files with the same bytes."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()), (a, b)
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (a, b, mismatch, errors)


def test_async_checkpoints_equal_sync_ones_and_a_due_save_waits(tmp_path):
    """dp2, 3 steps, a save after each: the async run's checkpoints are the sync run's, byte for
    byte, also when the staging copy of step 2 is held back for a second by the test hook (it
    runs beside step 3's forward and backward; step 3's optimizer update waits for it at the
    fence, else step 2's files would hold step 3's values). Each save after the first is due
    while the previous one is in flight (deterministic: a save is published at the earliest
    two steps after it started, the write agreed at the next step and rank 0's publish at the
    one after), so the run says it waits, and every step has its complete checkpoint."""
    a, s = tmp_path / "async", tmp_path / "sync"
    err = finished([*DP2, "--steps", "3", "--save", str(a), "--save-every", "1", "--async-save",
                    "--metrics", str(tmp_path / "a.jsonl")],
                   {"SOAPSTONE_CKPT_TEST_SLOW_STAGE": "2:1"})
    finished([*DP2, "--steps", "3", "--save", str(s), "--save-every", "1",
              "--metrics", str(tmp_path / "s.jsonl")])
    for step in (2, 3):
        assert (f"checkpoint: step {step} is due while step {step - 1} is still being "
                "written; waiting for it") in err, err
    for step in (1, 2, 3):
        assert f"checkpoint: saved step {step} to {a / f'step-0000000{step}'}" in err, err
    assert sorted(p.name for p in a.iterdir()) == [f"step-0000000{i}" for i in (1, 2, 3)]
    for d in sorted(a.iterdir()):
        same_files(d, s / d.name)
    assert losses(tmp_path / "a.jsonl") == losses(tmp_path / "s.jsonl")
    (verified,) = cli(["ckpt", "verify", str(a)])
    assert verified["rc"] == 0 and "steps 1, 2, 3:" in verified["text"], verified["text"]


def test_resume_from_an_async_checkpoint_is_bitwise(tmp_path):
    """4 steps saving asynchronously after 2 and 4; a resume from step 2 (asynchronous again,
    into another DIR) repeats steps 3-4's losses bitwise and writes a step-4 checkpoint
    identical to the first run's to the byte: the masters and moments are the same."""
    a, b = tmp_path / "a", tmp_path / "b"
    finished([*DP2, "--steps", "4", "--save", str(a), "--save-every", "2", "--async-save",
              "--metrics", str(tmp_path / "a.jsonl")])
    err = finished([*DP2, "--steps", "4", "--save", str(b), "--async-save", "--resume",
                    str(a / "step-00000002"), "--metrics", str(tmp_path / "b.jsonl")])
    assert f"resumed from {a / 'step-00000002'} at step 2" in err, err
    first, again = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(again) == [2, 3] and all(first[i] == again[i] for i in again), (first, again)
    same_files(a / "step-00000004", b / "step-00000004")


def test_kill_9_during_an_async_write_leaves_the_previous_checkpoint(tmp_path):
    """dp2, 6 steps, saving after 2, 4 and 6 asynchronously; rank 1 is killed while its
    background thread writes step 4 (slowed by the test hook) as training goes on: step 2 is
    the newest checkpoint, step 4 only a .tmp directory; a resume passes over it, names it, and
    repeats the first run's losses bitwise; its own saves are whole."""
    from soapstone.shard.checkpoint import find, read

    d, pids = tmp_path / "ck", tmp_path / "pids"
    args = [*DP2, "--steps", "6", "--save", str(d), "--save-every", "2", "--async-save"]
    kill_rank_1_mid_save([*args, "--metrics", str(tmp_path / "a.jsonl")], pids)
    assert find(d)[0][0] == d / "step-00000002" and read(d / "step-00000002").step == 2
    assert not (d / "step-00000004").exists() and not (d / "step-00000006").exists()
    (tmp,) = d.glob("step-00000004.tmp-*")
    err = finished([*args, "--resume", str(d), "--metrics", str(tmp_path / "b.jsonl")])
    assert f"ignoring {tmp}: an unfinished save of step 4" in err, err
    assert f"resumed from {d / 'step-00000002'} at step 2" in err, err
    first, again = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(again) == [2, 3, 4, 5] and all(first[i] == again[i] for i in first
                                                 if i in again), (first, again)
    assert sorted(p.name for p in d.iterdir()) == ["step-00000002", "step-00000004",
                                                   "step-00000006"]
    (verified,) = cli(["ckpt", "verify", str(d)])
    assert verified["rc"] == 0, verified["text"]


def test_explain_names_the_staging_memory_and_async_needs_save():
    """explain prints the host memory of the staging copy (the busiest rank's checkpoint
    bytes); --async-save without --save is bad input, exit 2."""
    import json

    text, js, bad = cli(["explain", "examples/gpt.par", "--parallel", "dp2"],
                        ["explain", "examples/gpt.par", "--parallel", "dp2", "--json"],
                        ["run", "examples/gpt.par", "--quiet", "--steps", "2", "--async-save"])
    assert text["rc"] == 0 and "async staging (run --async-save): " in text["text"], text
    data = json.loads(js["text"])
    assert data["async_staging_bytes"] == max(data["checkpoint_bytes_per_rank"]) > 0
    assert bad["rc"] == 2 and "--async-save needs --save DIR" in bad["text"], bad
    assert "Traceback" not in bad["text"]
