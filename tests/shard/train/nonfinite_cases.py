"""Non-finite steps under mpiexec (tests/shard/train/test_nonfinite.py), on examples/mlp.par.

- poisoned data: every rank gets the same full batch with NaN features in rows only one
  rank reads (data parallel: world rank 1's share); every rank raises NonFinite naming the
  same step and place, nothing is updated (parameters, master values, optimizer state and
  step count bitwise as before), and the next clean step gives exactly what a run that
  never saw the poisoned batch gives (the update dropped, as torch's GradScaler does);
- a save of a state one rank holds non-finite is refused on every rank (a flag reduced over
  the world), before any file is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests/support"))

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.stages import lower_graph  # noqa: E402
from soapstone.shard.checkpoint import save  # noqa: E402
from soapstone.shard.checkpoint.holdings import holdings  # noqa: E402
from soapstone.shard.data.tasks import SyntheticTask  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402
from soapstone.shard.train.nonfinite import NonFinite  # noqa: E402

W = init("mpi")
SPEC = dsl.load(ROOT / "examples/mlp.par")
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp")  # the launch's shared dir
TASK = SyntheticTask(lower_graph(SPEC.model("mlp"), None).program, seed=0)


def executor(layout: str, zero: int | None = None) -> Executor:
    par = SPEC.parallel(layout)
    graph = lower_graph(SPEC.model("mlp"), par)
    mesh = Mesh(W, **dict(par.mesh)) if W.size > 1 else None
    ex = Executor(graph, mesh, seed=0)
    ex.use_optimizer(name="adamw", lr=1e-2, zero=zero)
    return ex


def state(ex: Executor) -> list[torch.Tensor]:
    """Everything an update changes: parameters, master values, optimizer state."""
    out = [p.detach().clone() for p in ex.parameters()]
    for h in holdings(ex):
        out += [v.clone() for v in h.views.values()]
    return out


def poisoned(step: int) -> dict[str, torch.Tensor]:
    """Batch `step` with NaN features in the rows of the last data rank's share only."""
    batch = TASK.batch(step)
    x = batch["x"].clone()
    x[x.shape[0] - x.shape[0] // W.size:] = float("nan")
    return {**batch, "x": x}


def _poisoned_step_changes_nothing(layout: str, zero: int | None = None) -> None:
    ex, clean = executor(layout, zero), executor(layout, zero)
    before = state(ex)
    try:
        ex.train_step(poisoned(0), step=0)
    except NonFinite as e:
        got = e
    else:
        raise AssertionError("a NaN batch trained without NonFinite")
    assert got.step == 0 and got.where is not None and got.where[0] == "linear0.weight", got
    assert "step 1: the loss is nan and the gradient norm is nan" in got.message(), got
    assert all(torch.equal(a, b) for a, b in zip(before, state(ex), strict=True)), layout
    assert {o.steps for o in ex.optimizers.values()} == {0}
    # the next step is the first update, exactly as if the poisoned batch never came
    assert ex.train_step(TASK.batch(1), step=1) == clean.train_step(TASK.batch(1), step=1)
    for a, b in zip(state(ex), state(clean), strict=True):
        assert torch.equal(a, b), layout


@ranks(1, 2)
def case_poisoned_rows_stop_every_rank_and_update_nothing():
    _poisoned_step_changes_nothing("dp2" if W.size == 2 else "single")


@ranks(2)
def case_poisoned_rows_under_zero_and_tensor_parallel():
    _poisoned_step_changes_nothing("dp2", zero=2)
    _poisoned_step_changes_nothing("tp2")


@ranks(2)
def case_save_refuses_a_state_one_rank_holds_non_finite():
    ex = executor("tp2")  # each rank holds its own half of linear0.weight
    ex.train_step(TASK.batch(0), step=0)
    if W.rank == 1:
        with torch.no_grad():
            dict(ex.models[0].named_parameters())["linear1.weight"].view(-1)[0] = float("inf")
    root = OUT / "refused"
    try:
        save(ex, root, 1, 0, {})
    except NonFinite as e:
        assert e.where == ("linear1.weight", 1), e
        assert "after step 1: a non-finite parameter or optimizer state: linear1.weight on " \
               "rank 1; the checkpoint is not written" in e.message(), e.message()
    else:
        raise AssertionError("a non-finite state was saved")
    W.barrier()
    assert not root.exists(), list(root.rglob("*"))
