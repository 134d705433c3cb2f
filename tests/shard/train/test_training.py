"""Training as people run it: LR schedules, accumulation, evaluation, memory-mapped token files,
TensorBoard event files; the distributed cases run under mpiexec
(tests/shard/train/training_cases.py)."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpirun import case_params, run_mpi

from soapstone import dsl
from soapstone.comm.errors import UserError
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.errors import DataError
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.data.token_memmap import TokenMemmap, open_tokens
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.train.errors import SettingError
from soapstone.shard.train.lr_schedule import LRSchedule

CASES = "tests/shard/train/training_cases.py"
ROOT = Path(__file__).resolve().parents[3]
CLI = ["-m", "soapstone.dsl.cli"]


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_training_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


# lr 1.0, 6 steps, 2 warmup steps, floor 0.1, by hand: warmup 1/2, 2/2; then r = 0, 1/4, 2/4,
# 3/4 of the decay. cosine: 0.1 + 0.45 (1 + cos(pi r)); linear: 0.1 + 0.9 (1 - r).
HAND = {
    "cosine": [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + 0.5 ** 0.5), 0.55, 0.1 + 0.45 * (1 - 0.5 ** 0.5)],
    "linear": [0.5, 1.0, 1.0, 0.775, 0.55, 0.325],
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0],
}


@pytest.mark.parametrize("kind", sorted(HAND))
def test_schedule_equals_hand_computed(kind):
    s = LRSchedule(1.0, steps=6, warmup=2, kind=kind, min_lr=0.1)
    assert [s.at(i) for i in range(6)] == pytest.approx(HAND[kind], abs=1e-12)


def test_schedule_reaches_the_floor_after_the_last_step():
    s = LRSchedule(3e-4, steps=100, warmup=10, kind="cosine", min_lr=3e-5)
    assert s.at(100) == pytest.approx(3e-5) and s.at(99) > 3e-5
    assert LRSchedule(1.0, steps=4, kind="linear").at(0) == 1.0  # no warmup: starts at peak


@pytest.mark.parametrize("args,needle", [
    ({"kind": "step"}, "lr schedule must be one of cosine, linear, constant, not 'step'"),
    ({"warmup": 7}, "warmup 7 must be between 0 and steps 6"),
    ({"min_lr": 2.0}, "min_lr 2.0 must be between 0 and lr 1.0"),
])
def test_a_schedule_that_cannot_work_is_a_setting_error(args, needle):
    """A UserError (exit 2 from a command), still the ValueError it was for the library."""
    with pytest.raises(SettingError, match=needle) as e:
        LRSchedule(1.0, steps=6, **args)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


def test_set_lr_is_the_rate_of_the_update():
    """An optimizer built at lr 1 and set to 0.25 (or a tensor of it) updates exactly as one
    built at 0.25."""
    s = dsl.load(ROOT / "examples/mlp.par")
    graph = lower_graph(s.model(), None)
    batch = SyntheticTask(graph.program, 0).batch(0)
    exs = []
    for built, rate in ((1.0, 0.25), (0.25, None), (1.0, None), (1.0, torch.tensor(0.25))):
        ex = Executor(graph, None, seed=0)
        ex.use_optimizer(name="sgd", lr=built, momentum=0.0)
        if rate is not None:
            ex.set_lr(rate)
        ex.train_step(batch)
        exs.append(ex.full_state_dict())
    assert all(torch.equal(exs[0][k], exs[1][k]) for k in exs[0])
    assert not all(torch.equal(exs[0][k], exs[2][k]) for k in exs[0])
    # a schedule written with torch math: its one-element tensor is the same rate
    assert all(torch.equal(exs[0][k], exs[3][k]) for k in exs[0])


@pytest.mark.parametrize("setting,value", [
    ("lr", -0.1), ("lr", float("nan")), ("lr", float("inf")), ("lr", "0.1"),
    ("weight_decay", -1.0), ("grad_clip", 0.0), ("grad_clip", -1.0), ("momentum", None)])
def test_an_optimizer_setting_that_cannot_work_is_a_setting_error(setting, value):
    """Refused where it is given (build_optimizer, set_lr), naming it: a NaN or negative rate,
    or a clip of 0 or less, would update every weight to NaN or against its gradient."""
    s = dsl.load(ROOT / "examples/mlp.par")
    graph = lower_graph(s.model(), None)
    batch = SyntheticTask(graph.program, 0).batch(0)
    ex = Executor(graph, None, seed=0)
    with pytest.raises(SettingError, match=rf"^{setting}={value!r:.4}.*: give a finite number"):
        ex.use_optimizer(name="sgd", **{"lr": 0.1, setting: value})
    ex.use_optimizer(name="sgd", lr=0.1)
    before = ex.full_state_dict()
    if setting == "lr":
        with pytest.raises(SettingError, match=r"^lr=.*: give a finite number >= 0"):
            ex.set_lr(value)
        ex.set_lr(0.0)  # a schedule's warmup may start at 0: no update, not an error
        ex.train_step(batch)
        after = ex.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_run_logs_the_schedule_and_evaluations(tmp_path):
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    r = run_mpi(1, [*CLI, "run", "examples/gpt.par", "--steps", "6", "--lr", "1e-2",
                    "--lr-schedule", "linear", "--warmup", "2", "--min-lr", "1e-3",
                    "--eval-every", "3", "--eval-steps", "2", "--accumulate", "2",
                    "--metrics", str(metrics), "--tensorboard", str(board)])
    assert r.ok, r.report()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval_loss" in row]
    want = [1e-3 + 9e-3 * x for x in (1 / 0.9 * 0.5, 1 / 0.9, 1, 0.75, 0.5, 0.25)]
    want[:2] = [5e-3, 1e-2]
    assert [row["lr"] for row in steps] == pytest.approx(want)
    assert [row["step"] for row in evals] == [2, 5] and all(e["eval_batches"] == 2 for e in evals)
    assert all(e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert r.stdout.count("eval loss") == 2 and "perplexity" in r.stdout
    # accumulate 2: twice the tokens of a gpt.par batch (8 x 16) in every step
    assert all(row["tokens_per_s"] * row["step_time_s"] == pytest.approx(256) for row in steps)
    scalars = read_event_scalars(board)
    assert [v for _, v in scalars["train/lr"]] == pytest.approx(want, rel=1e-6)
    assert [s for s, _ in scalars["eval/loss"]] == [3, 6]
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx(
        [e["eval_loss"] for e in evals], rel=1e-6)


def read_event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard event file, read as TFRecords of Event protos."""
    from tensorboardX.proto import event_pb2

    (path,) = logdir.glob("events.out.tfevents.*")
    data, out, at = path.read_bytes(), {}, 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
        at += 12 + n + 4
        for v in event.summary.value:
            out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_is_imported_only_for_the_flag():
    """`run`'s module and the progress path import no tensorboardX (only --tensorboard's
    writer does, inside the function)."""
    code = ("import sys, soapstone.dsl.commands.run as r; bar = r.progress_bar(3); bar.close(); "
            "assert 'tensorboardX' not in sys.modules and 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_memmap_formats(tmp_path):
    ids = np.arange(3000) % 50
    ids.astype("<u2").tofile(tmp_path / "a.bin")
    ids.astype("<u4").tofile(tmp_path / "b.bin")
    np.save(tmp_path / "c.npy", ids.astype(np.int32))
    (tmp_path / "d.txt").write_bytes(bytes(ids.astype(np.uint8)))
    for name, dtype in (("a.bin", None), ("b.bin", "uint32"), ("c.npy", None), ("d.txt", None)):
        arr = open_tokens(tmp_path / name, dtype)
        assert isinstance(arr, np.memmap) and np.array_equal(arr, ids), name
    program = lower(dsl.load(ROOT / "examples/gpt.par").model(), None)
    t = TokenMemmap(program, tmp_path / "a.bin", seed=0)
    assert t.train.size == 2700 and t.val.size == 300  # the last 10% held out
    b = t.batch(0)
    assert torch.equal(b["targets"][:, :-1], b["tokens"][:, 1:])
    starts = b["tokens"][:, 0].numpy()
    assert all(np.array_equal(ids[s:s + 16], row) for s, row in zip(starts, b["tokens"].numpy(),
                                                                    strict=True))
    e = t.eval_batch(0)["tokens"].numpy()
    held = ids[2700:]
    assert all(any(np.array_equal(held[i:i + 16], row) for i in range(284)) for row in e)
    (tmp_path / "e.bin").write_bytes(b"\0" * 6)
    with pytest.raises(DataError, match="6 bytes is not a whole number of uint32 ids"):
        open_tokens(tmp_path / "e.bin", "uint32")


BAD = [
    (["--data", "{odd}"], ["odd.bin: 4001 bytes is not a whole number of uint16 ids",
                           "--data-dtype"]),
    (["--data", "{big}"], ["token id 300 at token offset 7 does not fit the vocab of 64",
                           "--dim vocab=512"]),
    (["--data", "{small}", "--eval-every", "1"], ["held-out tokens, fewer than the 17",
                                                 "--val-data"]),
    (["--val-data", "{small}", "--eval-every", "1"], ["--val-data", "give --data too"]),
    (["--data", "{small}", "--val-data", "{small}"], ["--val-data", "nothing evaluates without "
                                                      "--eval-every K"]),
    (["--warmup", "9"], ["--warmup 9: give 0 to --steps (3) steps"]),
    (["--lr-schedule", "cosine", "--min-lr", "1"], ["--min-lr 1: the floor must be between"]),
    (["--accumulate", "0"], ["--accumulate 0: give at least 1"]),
    (["--eval-steps", "0"], ["--eval-steps 0: give at least 1"]),
    (["--tensorboard", "{odd}"], ["exists and is not a directory"]),
]


def test_bad_input_exit_2(tmp_path):
    """Every bad flag or file: exit 2, one line naming it, no traceback (one process runs
    them all: tests/shard/checkpoint/test_checkpoint.py's cli)."""
    from cli_calls import cli

    (tmp_path / "odd.bin").write_bytes(b"\1" * 4001)
    big = np.zeros(200, dtype="<u2")
    big[7] = 300
    big.tofile(tmp_path / "big.bin")
    (np.arange(100) % 60).astype("<u2").tofile(tmp_path / "small.bin")
    files = {k: str(tmp_path / f"{k}.bin") for k in ("odd", "big", "small")}
    runs = cli(*[["run", "examples/gpt.par", "--steps", "3", "--quiet",
                  *[a.format(**files) for a in args]] for args, _ in BAD])
    for (_, needles), r in zip(BAD, runs, strict=True):
        assert r["rc"] == 2, r
        assert "Traceback" not in r["text"] and len(r["text"].strip().splitlines()) == 1, r
        assert all(n in r["text"] for n in needles), (needles, r)
