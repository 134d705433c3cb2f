"""What a custom layer's function returns is checked where it returns, before any collective
reads it (shard/ops/custom.py `checked_result`): a tensor of the dtype its float inputs have,
else a UserError naming the layer, what it returned and what it must (exit 2, one line, on
every rank of a job whichever rank met it). And a SystemExit raised by one rank mid-run ends
the whole job at once naming the rank and the code (comm/launch/failure.py `end_on_exit`)
instead of leaving the other ranks waiting in a collective. Real mpiexec runs."""

from __future__ import annotations

import attrs
import pytest
import torch
from mpirun import run_mpi

from soapstone.comm.errors import UserError
from soapstone.shard.ops.custom import LayerResultError, checked_result, wrong_shape
from soapstone.shard.runtime.sharded_model import OpShapeError

CLI = ["-m", "soapstone.dsl.cli"]
RUN = ["run", "examples/swiglu.par", "--plugin", "tests/shard/ops/result_plugin.py", "--quiet"]


@attrs.frozen
class Step:
    """The two fields of a Program Compute step the check reads."""

    kind: str = "custom:swiglu"
    source: str = "layer.0.swiglu0"


X = torch.ones(2, 3)
W = torch.ones(3, 3)


def test_a_tensor_of_the_inputs_dtype_passes_as_is():
    y = X @ W
    assert checked_result(Step(), [X, W], y) is y
    ids = torch.zeros(2, dtype=torch.int64)  # no float input: any tensor
    assert checked_result(Step(), [ids], ids) is ids


@pytest.mark.parametrize("result,said", [
    (torch.ones(2, 3, dtype=torch.int64), "returned a tensor of dtype torch.int64"),
    (torch.ones(2, 3, dtype=torch.float64), "returned a tensor of dtype torch.float64"),
    (None, "returned None"),
    ((X,), "returned a tuple of 1 (Tensor)"),
    (3.0, "returned float 3.0"),
])
def test_anything_else_is_refused_naming_the_layer_and_the_fix(result, said):
    with pytest.raises(LayerResultError) as e:
        checked_result(Step(), [X, W], result)
    assert isinstance(e.value, UserError)
    text = str(e.value)
    assert text.startswith(f"custom layer 'swiglu' computing layer.0.swiglu0 {said}; "), text
    assert "it must return a torch.Tensor of dtype torch.float32" in text, text
    assert ("cast it, e.g. `.to(torch.float32)`" in text) == isinstance(result, torch.Tensor)


def test_a_wrong_local_shape_is_the_layers_error_and_a_built_in_ops_is_soapstones():
    """A custom layer's wrong shape is its plugin's bug: a UserError naming the layer, exit 2.
    A built-in op's is soapstone's: not bad input, so mid-run it keeps its traceback."""
    e = wrong_shape(Step(), [2, 2], [2, 3], ("batch", "hidden"))
    assert isinstance(e, LayerResultError) and isinstance(e, UserError)
    assert str(e).startswith("custom layer 'swiglu' computing layer.0.swiglu0 returned a tensor "
                             "of local shape [2, 2]; it must return the compiled local shape "
                             "[2, 3] (dims batch, hidden)"), str(e)
    assert not issubclass(OpShapeError, UserError)


def ended(r, code: int) -> str:
    """The job's output, after asserting it ended with `code`, on its own, with no traceback."""
    assert r.returncode == code and not r.timed_out, r.report()
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "Message truncated" not in out, r.report()
    return out


def test_an_int64_result_stops_a_single_rank_run_with_exit_2():
    r = run_mpi(1, [*CLI, *RUN, "--steps", "3"], timeout=180,
                env={"SOAPSTONE_TEST_RESULT": "-1:long"})
    out = ended(r, 2)
    assert "error: custom layer 'swiglu' computing layer.0.swiglu0 returned a tensor of dtype " \
           "torch.int64; it must return a torch.Tensor of dtype torch.float32" in out, out


@pytest.mark.parametrize("mode,said", [("double", "returned a tensor of dtype torch.float64"),
                                       ("short", "returned a tensor of local shape [")])
def test_a_wrong_result_on_one_rank_ends_the_job_with_one_line(mode, said):
    """Without the checks, rank 1's float64 partial sum meets rank 0's float32 one in the
    allreduce (MPI's `Message truncated`, no soapstone message), and a short result is a
    shape error met mid-step."""
    r = run_mpi(2, [*CLI, *RUN, "--parallel", "tp2", "--steps", "3"], timeout=180,
                env={"SOAPSTONE_TEST_RESULT": f"1:{mode}"})
    out = ended(r, 2)
    assert out.count("error: custom layer 'swiglu'") == 1, out
    assert said in out, out


def test_a_system_exit_on_one_rank_ends_the_job_naming_rank_and_code():
    """Without end_on_exit, rank 0 waits in the layer's allreduce for the collective timeout
    (600 s): past this launch's own timeout."""
    r = run_mpi(2, [*CLI, *RUN, "--parallel", "tp2", "--steps", "3"], timeout=180,
                env={"SOAPSTONE_TEST_RESULT": "1:exit"})
    out = ended(r, 3)
    assert "soapstone: rank 1 raised SystemExit(3) in the middle of `soapstone run`; the other " \
           "ranks would wait for it, so the job ends with exit 3" in out, out


def test_a_system_exit_of_a_single_rank_is_left_as_python_exits():
    r = run_mpi(1, [*CLI, *RUN, "--steps", "3"], timeout=180,
                env={"SOAPSTONE_TEST_RESULT": "-1:exit"})
    out = ended(r, 3)
    assert "SystemExit" not in out, out
