"""Out-of-range ids and targets under mpiexec (tests/shard/data/test_batch_ranges.py), on
examples/gpt.par: every rank gets the same full batch with an id above the vocab, or a
negative target, and every rank refuses it with the same DataError before any compute, on one
rank (where torch would raise a raw IndexError) and under the layouts that split the vocab
(tp2, sp2: each shard would mask the ids outside its rows and train on zeros silently)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests/support"))

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.stages import lower_graph  # noqa: E402
from soapstone.shard.data.errors import DataError  # noqa: E402
from soapstone.shard.data.tasks import SyntheticTask  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402

W = init("mpi")
SPEC = dsl.load(ROOT / "examples/gpt.par")
TASK = SyntheticTask(lower_graph(SPEC.model(), None).program, seed=0)


def _refuses(layout: str) -> None:
    """Both bad batches raise on every rank, naming input, value and range; nothing is
    updated, so the good batch after them trains as the first step."""
    par = SPEC.parallel(layout)
    ex = Executor(lower_graph(SPEC.model(par.model), par), Mesh(W, **dict(par.mesh)), seed=0)
    ex.use_optimizer(name="adamw", lr=1e-2)
    before = [p.detach().clone() for p in ex.parameters()]
    for name, shift in (("tokens", 1000), ("targets", -1000)):
        b = TASK.batch(0)
        b[name] = b[name] + shift
        value = int(b[name].flatten()[0])
        try:
            ex.train_step(b, step=0)
        except DataError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{layout}: {name} out of range trained")
        assert msg.startswith(f"input {name}: value {value} at [0, 0] "), msg
        assert "valid range 0..63" in msg, msg
    assert all(p.equal(q) for p, q in zip(before, ex.parameters(), strict=True)), layout
    assert math.isfinite(ex.train_step(TASK.batch(0), step=0)), layout


@ranks(1)
def case_single_refuses_out_of_range_ids_and_targets():
    _refuses("single")


@ranks(2)
def case_split_vocab_refuses_out_of_range_ids_and_targets():
    _refuses("tp2")
    _refuses("sp2")
