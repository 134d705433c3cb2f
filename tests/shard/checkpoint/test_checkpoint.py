"""Checkpoints (shard/checkpoint/): the box algebra, single-process save/resume/export, and the
mpiexec cases of tests/shard/checkpoint/ckpt_cases.py (bit-exact resume per layout, reshard)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_calls import cli
from mpirun import case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.checkpoint import CheckpointError, load_params, resume, save
from soapstone.shard.checkpoint.boxes import Box, flat_boxes
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 6, 1)])
def test_flat_boxes_cover_each_flat_range_in_order(shape):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    box = Box((7,) * len(shape), shape)  # an offset box: the boxes are in global coordinates
    n = full.numel()
    for a, b in itertools.combinations(range(n + 1), 2):
        boxes = flat_boxes(box, a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        got = torch.cat([full[x.within(box)].reshape(-1) for x in boxes])
        assert torch.equal(got, torch.arange(a, b)), (a, b, boxes)


def test_box_intersection():
    a, b = Box((0, 4), (4, 4)), Box((2, 6), (4, 4))
    assert a.intersect(b) == Box((2, 6), (2, 2))
    assert a.intersect(Box((4, 0), (2, 2))) is None


def trainer(precision="fp32", optimizer="adamw", spec="examples/gpt.par", model="gpt",
            draw=True):
    """A one-rank Trainer of a spec's model on the synthetic task (draw=False: its weights
    left empty, for a load to fill)."""
    spec = dsl.load(ROOT / spec)
    graph = lower_graph(spec.model(model), None)
    return Trainer(graph, None, task=SyntheticTask(graph.program, seed=0), precision=precision,
                   optimizer=optimizer, lr=1e-2, draw=draw)


@pytest.mark.parametrize("precision,optimizer,spec,model", [
    ("bf16", "sgd", "examples/gpt.par", "gpt"),
    ("fp32", "adamw", "tests/specs/ops_layouts.par", "ops")])  # dropout: masks from (seed, step)
def test_resume_on_one_rank_is_bitwise(tmp_path, precision, optimizer, spec, model):
    """bf16 compute over fp32 masters with SGD momentum; a model with dropout, whose masks
    follow from (seed, step) alone (the mpiexec cases do AdamW layouts)."""
    straight = trainer(precision, optimizer, spec, model)
    want = [m.loss for m in straight.run(4)]
    first = trainer(precision, optimizer, spec, model)
    list(first.run(2))
    d = save(first.executor, tmp_path, 2, 0, {"accumulate": 1})
    again = trainer(precision, optimizer, spec, model, draw=False)  # resume fills every byte
    index = resume(again.executor, tmp_path)
    assert index["dir"] == str(d) and index["optimizer"]["steps"] == 2
    assert [m.loss for m in again.run(2, 2)] == want[2:]
    a, b = straight.full_state_dict(), again.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_params_from_a_full_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    src = trainer()
    list(src.run(2))
    full = src.full_state_dict()
    save_file(full, str(tmp_path / "w.safetensors"))
    dst = trainer(draw=False)
    assert "parameters" in load_params(dst.executor, tmp_path / "w.safetensors")
    got = dst.full_state_dict()
    assert all(torch.equal(full[k], got[k]) for k in full)
    bad = dict(full)
    bad["linear0.bias"] = torch.zeros(3)
    bad["stray"] = torch.zeros(1)
    bad.pop("embedding0.table", None)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_params(dst.executor, tmp_path / "bad.safetensors")
    text = str(e.value)
    assert "linear0.bias" in text and "stray" in text, text


@pytest.mark.parametrize("args,said", [
    ({"keep": 0}, "save: keep=0; give at least 1"),
    ({"step": -1}, "save: step=-1; give an int >= 0"),
    ({"step": "2"}, "save: step='2'; give an int >= 0"),
    ({"settings": None}, "save: settings=None; give a dict of JSON values"),
    ({"settings": {"lr": object()}}, "save: settings={'lr': <object"),
])
def test_save_arguments_that_cannot_work_are_refused_before_a_byte(tmp_path, args, said):
    """keep=0 pruned the checkpoint just written (save returned a directory that was gone),
    step -1 wrote step--0000001, and settings that are no JSON object failed on rank 0 alone
    in the middle of the save; AsyncSaver refuses them alike."""
    from soapstone.shard.checkpoint.async_save import AsyncSaver

    ex = trainer().executor
    kw = {"step": 2, "seed": 0, "settings": {"accumulate": 1}, "keep": None, **args}
    with pytest.raises(CheckpointError) as e:
        save(ex, tmp_path / "ckpt", kw["step"], kw["seed"], kw["settings"], kw["keep"])
    assert str(e.value).startswith(said), str(e.value)
    with pytest.raises(CheckpointError, match=rf"^{said[:12]}"):
        AsyncSaver(ex, tmp_path / "async", kw["keep"]).start(kw["step"], kw["seed"],
                                                             kw["settings"])
    assert not (tmp_path / "ckpt").exists() and not list((tmp_path / "async").glob("step-*"))
    d = save(ex, tmp_path / "ckpt", np.int64(2), np.int64(0), {"accumulate": 1}, keep=1)
    assert (d / "index.json").is_file()  # numpy's integers are integers (saved as ints)


def test_weights_of_integers_or_not_finite_are_refused_at_load(tmp_path):
    """A full safetensors file (from elsewhere, no checksums) whose float parameter is stored
    as int32 would be cast and trained on; one holding NaN or infinity would train until the
    loss went non-finite: both are a CheckpointError naming the tensor, at load."""
    from safetensors.torch import save_file

    full = trainer().full_state_dict()
    for name, bad, needle in (
            ("ints", full["linear0.weight"].round().to(torch.int32), "is int32"),
            ("nan", full["linear0.weight"].clone().fill_(float("nan")), "holds NaN"),
            ("inf", full["linear0.bias"].clone().fill_(float("inf")), "holds NaN")):
        key = "linear0.bias" if name == "inf" else "linear0.weight"
        save_file({**full, key: bad}, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(CheckpointError, match=f"{name}.safetensors: param/{key} {needle}"):
            load_params(trainer(draw=False).executor, tmp_path / f"{name}.safetensors")


def test_index_is_plain_json_naming_layout_shape_dtype(tmp_path):
    t = trainer()
    list(t.run(1))
    d = save(t.executor, tmp_path, 1, 0, {"accumulate": 1})
    index = json.loads((d / "index.json").read_text())
    entry = index["tensors"]["param/linear0.bias"]
    assert entry["dtype"] == "float32" and entry["kind"] == "param"
    assert entry["pieces"][0]["file"] == "rank00000.safetensors"
    assert {"exp_avg/linear0.bias", "exp_avg_sq/linear0.bias"} <= set(index["tensors"])
    # the checkpoint is its rank files and the index: the ranks' parts go once merged
    assert sorted(f.name for f in d.iterdir()) == ["index.json", "rank00000.safetensors"]


CASES = "tests/shard/checkpoint/ckpt_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_checkpoint_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


# --- the command line: one process runs every command in turn (tests/support/cli_calls.py)


def _damaged(src: Path, dst: Path, how) -> str:
    import shutil

    shutil.copytree(src, dst)
    how(dst)
    return str(dst)


def _edit_index(d: Path, change) -> None:
    index = json.loads((d / "index.json").read_text())
    change(index["tensors"]["param/linear0.bias"])
    (d / "index.json").write_text(json.dumps(index))


def _reshape(t: dict) -> None:
    t["shape"] = [32]
    t["pieces"][0]["shape"] = [32]


def test_cli_save_inspect_export_init_and_bad_input(tmp_path):
    """run --save/--save-every/--keep, ckpt inspect/export, run --init; then every bad
    checkpoint input exits 2 with a message naming the problem and no traceback."""
    d, f, good = tmp_path / "ck", tmp_path / "model.safetensors", tmp_path / "good"
    t = trainer()
    list(t.run(2))
    step = save(t.executor, good, 2, 0, {"accumulate": 1})
    (tmp_path / "empty").mkdir()
    partial = tmp_path / "partial"
    missing = _damaged(step, tmp_path / "missing",
                       lambda d: (d / "rank00000.safetensors").unlink())
    truncated = _damaged(step, tmp_path / "truncated", lambda d: (
        d / "rank00000.safetensors").write_bytes((d / "rank00000.safetensors").read_bytes()[:999]))
    shaped = _damaged(step, tmp_path / "shape", lambda d: _edit_index(d, _reshape))
    typed = _damaged(step, tmp_path / "dtype", lambda d: _edit_index(
        d, lambda t: t.update(dtype="bfloat16")))
    _damaged(step, partial / "step-00000004", lambda d: (d / "index.json").unlink())
    gpt = ["run", "examples/gpt.par", "--quiet", "--steps", "3"]
    bad = [
        ([*gpt, "--resume", str(tmp_path / "empty")], "no complete checkpoint in it (nothing)"),
        ([*gpt, "--resume", missing], "rank00000.safetensors: missing"),
        ([*gpt, "--resume", truncated], "inside its 16720-byte header: a truncated file"),
        ([*gpt, "--resume", shaped], "holds F32 [64], the index says F32 [32] for "
                                     "param/linear0.bias"),
        ([*gpt, "--resume", typed], "holds F32 [64], the index says BF16 [64]"),
        ([*gpt, "--resume", str(good), "--dim", "hidden=16"],
         "dims that differ: head_dim (checkpoint 8, model 4), hidden (checkpoint 32, model 16)"),
        ([*gpt, "--resume", str(good), "--optimizer", "sgd"], "saved with optimizer adamw"),
        ([*gpt[:-1], "2", "--resume", str(good)], "give more steps"),
        ([*gpt, "--init", str(tmp_path / "nothing.safetensors")], "no such file or directory"),
        (["ckpt", "inspect", str(partial)], "only unfinished saves (step-00000004)"),
        ([*gpt, "--save", str(f)], "exists and is not a directory"),
        ([*gpt, "--save-every", "2"], "--save-every/--keep need --save DIR"),
        ([*gpt, "--resume", str(good), "--init", str(f)], "--resume and --init together"),
    ]
    half = tmp_path / "bf16.safetensors"
    saved, inspected, exported, halved, init, resumed, *rest = cli(
        [*gpt, "--save", str(d), "--save-every", "1", "--keep", "2"],
        ["ckpt", "inspect", str(d)], ["ckpt", "export", str(d), "-o", str(f)],
        ["ckpt", "export", str(d / "step-00000002"), "-o", str(half), "--dtype", "bfloat16"],
        [*gpt[:-1], "1", "--init", str(f)],
        [*gpt[:-1], "4", "--resume", str(d), "--lr", "1e-3", "--seed", "7"],
        *[a for a, _ in bad])
    assert resumed["rc"] == 0 and "at step 3, seed 0" in resumed["text"], resumed["text"]
    assert "note: lr is 0.001 now, 0.01 when saved" in resumed["text"]
    # --seed is not taken (the saved seed is, as "seed 0" above says), but not silently
    assert "note: seed is 7 now, 0 when saved; the run continues with the saved seed 0" \
        in resumed["text"], resumed["text"]
    assert saved["rc"] == 0, saved["text"]
    assert sorted(p.name for p in d.iterdir()) == ["step-00000002", "step-00000003"]
    assert inspected["rc"] == 0 and "step 3  seed 0  optimizer adamw" in inspected["text"]
    assert "param/linear0.weight" in inspected["text"]
    assert exported["rc"] == 0 and f.is_file(), exported["text"]
    from safetensors.torch import load_file

    assert set(load_file(str(f))) == {p.name for p in t.graph.program.params}
    assert halved["rc"] == 0 and "at step 2" in halved["text"], halved["text"]
    assert {v.dtype for v in load_file(str(half)).values()} == {torch.bfloat16}
    assert init["rc"] == 0 and f"init: {f}: 57 parameters" in init["text"], init["text"]
    for (argv, text), got in zip(bad, rest, strict=True):
        assert got["rc"] == 2 and text in got["text"], (argv, got)
        assert "Traceback" not in got["text"], got["text"]


# --- crash safety and signals under real mpiexec ---------------------------------------------
def launch(n: int, argv: list[str], env: dict | None = None):
    import os
    import subprocess
    import sys

    from mpirun import mpiexec

    return subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, "-m", "soapstone.dsl.cli",
                             *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def wait_for(check, proc, what: str, timeout: float = 120) -> None:
    import time

    end = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{what}: never happened (exit {proc.returncode})\n{out}\n{err}")
        time.sleep(0.1)


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def kill_rank_1_mid_save(args: list[str], pids: Path, env: dict | None = None) -> None:
    """Launch dp2 `run` slowed in its save of step 4; SIGKILL rank 1 once both ranks write."""
    import os
    import signal

    proc = launch(2, args, {"SOAPSTONE_CKPT_TEST_SLOW": f"4:30:{pids}", **(env or {})})
    wait_for(lambda: pids.is_file() and len(pids.read_text().splitlines()) == 2, proc,
              "both ranks inside the slowed save of step 4")
    victim = dict(line.split() for line in pids.read_text().splitlines())["1"]
    os.kill(int(victim), signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    pids.unlink()


def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A rank killed (SIGKILL) while writing the step-4 checkpoint: step 2 still resumes (the
    unfinished save is reported and ignored), steps 3-4 repeat the first run's losses bitwise,
    and the next save of step 4 is whole. Then a resume from step 2 into the same DIR killed
    while re-saving step 4: the step-4 checkpoint already there is untouched, and a resume
    takes it."""
    from soapstone.shard.checkpoint import read
    from soapstone.shard.checkpoint.verify import verify_data

    d, pids = tmp_path / "ck", tmp_path / "pids"
    args = ["run", "examples/gpt.par", "--parallel", "dp2", "--quiet", "--steps", "4",
            "--save", str(d), "--save-every", "2"]
    kill_rank_1_mid_save([*args, "--metrics", str(tmp_path / "a.jsonl")], pids)
    assert (d / "step-00000002" / "index.json").is_file()
    assert not (d / "step-00000004").exists()
    (tmp,) = d.glob("step-00000004.tmp-*")
    again = launch(2, [*args, "--resume", str(d), "--metrics", str(tmp_path / "b.jsonl")])
    out, err = again.communicate(timeout=180)
    assert again.returncode == 0, out + err
    assert f"ignoring {tmp}: an unfinished save of step 4" in err, err
    assert "resumed from" in err and "at step 2" in err
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(b) == [2, 3] and all(a[i] == b[i] for i in b), (a, b)
    assert read(d / "step-00000004").step == 4 and not tmp.exists()  # the save cleared it
    before = (d / "step-00000004" / "rank00001.safetensors").read_bytes()
    kill_rank_1_mid_save([*args, "--resume", str(d / "step-00000002")], pids)
    problems: list[str] = []
    verify_data(d / "step-00000004", read(d / "step-00000004"), problems)
    assert not problems and (d / "step-00000004" / "rank00001.safetensors").read_bytes() \
        == before, problems
    (tmp,) = d.glob("step-00000004.tmp-*")
    (resumed,) = cli(["run", "examples/gpt.par", "--quiet", "--steps", "5", "--resume", str(d)])
    assert resumed["rc"] == 0 and "at step 4" in resumed["text"], resumed["text"]
    assert f"ignoring {tmp}: an unfinished save of step 4" in resumed["text"]


def test_sigterm_with_save_saves_then_stops(tmp_path):
    """SIGTERM to mpiexec during `run --save`: every rank finishes its step, they save, exit;
    the run resumes from that step."""
    import signal

    d, m = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ["run", "examples/gpt.par", "--parallel", "tp2", "--quiet", "--save", str(d)]
    proc = launch(2, [*args, "--steps", "100000", "--metrics", str(m)])
    wait_for(lambda: m.is_file() and len(m.read_text().splitlines()) >= 2, proc,
              "two steps of training")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert "stopping after this step" in err, out + err
    assert "(stopping: SIGTERM)" in err and "Traceback" not in err, err
    from soapstone.shard.checkpoint import find, read

    step = read(find(d)[0][0]).step
    assert step >= 2 and step == len(m.read_text().splitlines())


def test_explain_reports_checkpoint_bytes_per_rank():
    """explain's figure (checked against the files ranks write in ckpt_cases.py): every
    element once, fp32 master + two AdamW moments, spread over dp2 x tp2's four ranks."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "explain", "examples/gpt.par",
                        "--parallel", "dp2tp2", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    per_rank = json.loads(p.stdout)["checkpoint_bytes_per_rank"]
    graph = lower_graph(dsl.load(ROOT / "examples/gpt.par").model("gpt"), None)
    params = sum(torch.Size(q.shape).numel() for q in graph.program.params)
    assert len(per_rank) == 4 and all(per_rank) and sum(per_rank) == params * 12
