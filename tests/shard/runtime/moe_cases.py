"""MoE layouts under mpiexec (tests/shard/parallel/test_moe_dispatch.py), with drops
(examples/moe.par, capacity 0.75) and without (tests/specs/moe_layouts.par, capacity 4.0): experts
split (ep2, ep4), experts over the data axis with the all-to-all dispatch (dpep, dpep4), tokens over
data with experts over another axis (dp2ep2), tokens over both axes with the exchange along one
(dp4ep2), and the exchange with tensor parallel inside each expert (dpeptp2).

- every layout drops exactly the choices the single-rank run drops (none for the wide model);
- the wide model's layouts reproduce its single-rank run, recorded here on every rank (the
  example's layouts are checked against tests/golden/runs/moe.npz by run_cases.py);
- dpeptp2's counters equal explain's and its flight recorder the planned sequence, as
  run_cases.py checks for the example's layouts;
- under `recompute` (tests/specs/moe_recompute.par) backward routes and exchanges again: the
  run reproduces one rank's, the counters and the recorded order are the plan's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.testing import assert_matches_golden, record_golden
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from measure import measure  # noqa: E402  (the explain cases' step measurement)

ROOT = Path(__file__).resolve().parents[3]
DROPS = str(ROOT / "examples/moe.par")
WIDE = str(ROOT / "tests/specs/moe_layouts.par")
RECOMPUTE = str(ROOT / "tests/specs/moe_recompute.par")
W = init("mpi")


def _layouts(spec: str) -> list[str]:
    names = [p.name for p in dsl.load(spec).parallels.values() if p.world_size == W.size]
    assert names, f"{spec}: no layout of {W.size} ranks"
    return names


def _drops(spec: str, layout: str | None) -> list[int]:
    """Each moe op's dropped choices in one training step of `layout` (None: one rank)."""
    s = dsl.load(spec)
    par = s.parallel(layout) if layout else None
    graph = lower_graph(s.model(), par)
    mesh = Mesh(W, **dict(par.mesh)) if par else None
    t = Trainer(graph, mesh, task=SyntheticTask(graph.program, 1), seed=1)
    t.step(0)
    return [v["dropped"] for v in t.executor.models[0].ctx.moe.values()]


@ranks(2, 4)
def case_moe_layouts_drop_what_one_rank_drops():
    for spec, some in ((DROPS, True), (WIDE, False)):
        single = _drops(spec, None)
        assert (sum(single) > 0) == some, f"{spec}: drops {single}"
        for layout in _layouts(spec):
            assert _drops(spec, layout) == single, f"{spec}/{layout}: drops differ"


@ranks(2, 4)
def case_moe_layouts_without_drops_reproduce_the_single_rank_run():
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / f"single.{W.rank}.npz")
        record_golden(WIDE, record, steps=3)
        for layout in _layouts(WIDE):
            assert_matches_golden(WIDE, layout, record)


@ranks(4)
def case_moe_exchange_with_tensor_parallel_matches_explain():
    measure(WIDE, "dpeptp2", "sgd")


@ranks(2)
def case_moe_recompute_routes_again_as_planned():
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / f"single.{W.rank}.npz")
        record_golden(RECOMPUTE, record, steps=2)
        assert_matches_golden(RECOMPUTE, "dpeprc", record)
    measure(RECOMPUTE, "dpeprc", "sgd")
