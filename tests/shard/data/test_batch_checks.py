"""A batch handed to the Python API is checked whole before any of it runs
(shard/data/batch_check.py's check_batch, called by Executor.microbatches and, for every
batch of a list, by train_step): a missing or extra input, a wrong dtype, a numpy array, a
wrong shape, an empty list or a later batch of a list that does not fit are a DataError naming
the input, with nothing computed or accumulated; under mpiexec a bad batch on one rank alone
ends the job with exit 2 and its one line, not a traceback or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.batch_check import check_batch
from soapstone.shard.data.errors import DataError
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.train.errors import SettingError

ROOT = Path(__file__).resolve().parents[3]
SPEC = dsl.load(ROOT / "examples/gpt.par")
GRAPH = lower_graph(SPEC.model(), None)
GOOD = SyntheticTask(GRAPH.program, seed=0).batch(0)


def executor() -> Executor:
    """examples/gpt.par on one rank, with an optimizer."""
    ex = Executor(GRAPH, None, seed=0)
    ex.use_optimizer(name="adamw", lr=1e-2)
    return ex


BAD = [
    ({"tokens": GOOD["tokens"]}, "batch: missing targets; the model's inputs are tokens, "
                                 "targets"),
    ({**GOOD, "target": GOOD["targets"]}, "batch: no input named target"),
    ({**GOOD, "tokens": GOOD["tokens"].float()},
     "batch: input tokens is torch.float32, the spec declares i64; pass it as torch.int64"),
    ({**GOOD, "targets": GOOD["targets"].bool()},
     "batch: input targets is torch.bool, the spec declares i64"),
    ({**GOOD, "tokens": GOOD["tokens"].numpy()},
     "batch: input tokens is of type ndarray; pass a torch.Tensor of i64[batch=8, seq=16]"),
    ({**GOOD, "targets": GOOD["targets"][:, :8]},
     r"batch: input targets has shape [8, 8], the layout takes the full global batch "
     r"[batch=8, seq=16]"),
    (GOOD["tokens"], "batch is of type Tensor; pass a dict"),
    ([], r"train_step([]): give a batch, or a non-empty list of batches"),
    ([GOOD, {k: v[:4] for k, v in GOOD.items()}],
     "batch 1 of 2: input tokens has shape [4, 16], the layout takes the full global batch"),
]


@pytest.mark.parametrize("batch,said", BAD, ids=["missing", "extra", "float ids",
                                                 "bool targets", "numpy", "short seq",
                                                 "not a dict", "empty list", "unequal list"])
def test_a_bad_batch_is_a_data_error_naming_the_input_and_nothing_runs(batch, said):
    """Refused before any forward: the step after it trains exactly as a fresh executor's
    (a list's good first batch accumulated nothing)."""
    ex = executor()
    with pytest.raises(DataError) as e:
        ex.train_step(batch, step=0)
    assert str(e.value).startswith(said), str(e.value)
    fresh = executor()
    assert ex.train_step(GOOD, step=0) == fresh.train_step(GOOD, step=0)
    after, want = ex.full_state_dict(), fresh.full_state_dict()
    assert all(torch.equal(after[k], want[k]) for k in want)


def test_integer_inputs_of_any_width_train_as_int64():
    """Ids are indexes: an int32 or uint8 batch (a file's width, a spec's i32) trains exactly
    as its int64 copy (torch's embedding and cross-entropy index with int64 only)."""
    want = executor().train_step(GOOD, step=0)
    for dtype in (torch.int32, torch.uint8):
        narrow = {k: v.to(dtype) for k, v in GOOD.items()}
        assert executor().train_step(narrow, step=0) == want, dtype


def test_an_input_the_model_declares_and_no_stage_reads_may_come_along():
    """A pipeline's stages take only the inputs their ops read; the task is built from the
    whole model, so it carries one declared and unread: taken, while a misspelt key is not."""
    text = (ROOT / "examples/gpt.par").read_text().replace(
        "  input targets : i64[batch, seq]\n",
        "  input targets : i64[batch, seq]\n  input extra : f32[batch, seq]\n")
    text += ("\nparallel pipe2 for gpt on mesh(pipe = 1) {\n"
             "  operator  layer[0..1] -> pipe 0, layer[2..3] -> pipe 0\n"
             "  schedule  1f1b, microbatches = 2\n}\n")
    spec = dsl.load(text, filename="gpt_extra.par")
    graph = lower_graph(spec.model(), spec.parallel("pipe2"))
    assert graph.unread == ("extra",)
    batch = SyntheticTask(lower_graph(spec.model(), None).program, seed=0).batch(0)
    assert "extra" in batch
    check_batch(graph, batch)
    with pytest.raises(DataError, match="no input named extr; the model's inputs are tokens, "
                                        "targets, extra"):
        check_batch(graph, {**batch, "extr": batch["extra"]})


def test_infer_refuses_a_bad_batch_and_an_unknown_output_to_gather():
    ex = executor()
    with pytest.raises(DataError, match="batch: missing targets"):
        ex.infer({"tokens": GOOD["tokens"]})
    for gather in (("logits",), "loss"):  # a string would be its letters
        with pytest.raises(DataError, match=r"infer\(gather=.*\): give a tuple of the last "
                                            "stage's output names: loss"):
            ex.infer(GOOD, gather=gather)
    loss, full = ex.infer(GOOD, gather=("loss",))
    assert float(full["loss"]) == pytest.approx(loss)


def test_a_step_that_is_no_int_is_a_setting_error():
    with pytest.raises(SettingError, match=r"train_step\(step='3'\): step is an int"):
        executor().train_step(GOOD, step="3")


# tp2 on 2 ranks; rank 1 alone drops an input: the other is in a collective by then
ONE_RANK = """
import torch
from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.runtime.executor import Executor
w = init("mpi")
spec = dsl.load("examples/gpt.par")
par = spec.parallel("tp2")
ex = Executor(lower_graph(spec.model(), par), Mesh(w, **dict(par.mesh)), seed=0)
batch = SyntheticTask(lower_graph(spec.model(), None).program, seed=0).batch(0)
if w.rank == 1:
    del batch["targets"]
ex.train_step(batch)
print("unreachable", flush=True)
"""


def test_a_batch_missing_an_input_on_one_rank_ends_the_job_with_one_line():
    res = run_mpi(2, ["-c", ONE_RANK], timeout=120)
    text = res.stdout + res.stderr
    assert not res.timed_out and res.returncode == 2, res.report()
    assert text.count("error: batch: missing targets; the model's inputs are tokens, "
                      "targets") == 1, res.report()
    assert "Traceback" not in text and "unreachable" not in text, res.report()
