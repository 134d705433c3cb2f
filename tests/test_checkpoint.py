"""Checkpoints (shard/checkpoint/): the box algebra, single-process save/resume/export, and the
mpiexec cases of tests/cases/ckpt_cases.py (bit-exact resume per layout, reshard)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from mpirun import case_params

from soapstone import dsl
from soapstone.dsl.stages import lower_graph
from soapstone.shard.checkpoint import CheckpointError, load_params, resume, save
from soapstone.shard.checkpoint.boxes import Box, flat_boxes
from soapstone.shard.data import SyntheticTask
from soapstone.shard.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


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


def _trainer(precision="fp32", optimizer="adamw"):
    spec = dsl.load(ROOT / "examples/gpt.par")
    graph = lower_graph(spec.model("gpt"), None)
    return Trainer(graph, None, task=SyntheticTask(graph.program, seed=0), precision=precision,
                   optimizer=optimizer, lr=1e-2)


def test_resume_on_one_rank_is_bitwise(tmp_path, precision="bf16", optimizer="sgd"):
    """bf16 compute over fp32 masters, SGD momentum (the mpiexec cases do AdamW layouts)."""
    straight = _trainer(precision, optimizer)
    want = [m.loss for m in straight.run(4)]
    first = _trainer(precision, optimizer)
    list(first.run(2))
    d = save(first.executor, tmp_path, 2, 0, {"accumulate": 1})
    again = _trainer(precision, optimizer)
    index = resume(again.executor, tmp_path)
    assert index["dir"] == str(d) and index["optimizer"]["steps"] == 2
    assert [m.loss for m in again.run(2, 2)] == want[2:]
    a, b = straight.full_state_dict(), again.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_params_from_a_full_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    src = _trainer()
    list(src.run(2))
    full = src.full_state_dict()
    save_file(full, str(tmp_path / "w.safetensors"))
    dst = _trainer()
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


def test_index_is_plain_json_naming_layout_shape_dtype(tmp_path):
    t = _trainer()
    list(t.run(1))
    d = save(t.executor, tmp_path, 1, 0, {"accumulate": 1})
    index = json.loads((d / "index.json").read_text())
    entry = index["tensors"]["param/linear0.bias"]
    assert entry["dtype"] == "float32" and entry["kind"] == "param"
    assert entry["pieces"][0]["file"] == "rank00000.safetensors"
    assert {"exp_avg/linear0.bias", "exp_avg_sq/linear0.bias"} <= set(index["tensors"])


CASES = "tests/cases/ckpt_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_checkpoint_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
