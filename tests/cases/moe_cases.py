"""MoE layouts under mpiexec (tests/test_moe_dispatch.py): each reproduces the single-rank run
of its model, recorded here on every rank, with drops (examples/moe.par, capacity 0.75: 16
of 64 choices dropped) and without (tests/specs/moe_layouts.par, capacity 4.0): experts
split (ep2, ep4), experts over the data axis with the all-to-all dispatch (dpep, dpep4), and
tokens over data with experts over another axis (dp2ep2). The drop counts are the batch's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.stages import lower_graph
from soapstone.dsl.testing import assert_matches_golden, record_golden
from soapstone.shard.data import SyntheticTask
from soapstone.shard.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
SPECS = {str(ROOT / "examples/moe.par"): True, str(ROOT / "tests/specs/moe_layouts.par"): False}
W = init("mpi")


def _layouts(spec: str) -> list[str]:
    return [p.name for p in dsl.load(spec).parallels.values() if p.world_size == W.size]


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
def case_moe_layouts_reproduce_the_single_rank_run():
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS:
            record = str(Path(tmp) / f"single.{W.rank}.npz")
            record_golden(spec, record, steps=3)
            layouts = _layouts(spec)
            assert layouts, f"{spec}: no layout of {W.size} ranks"
            single = _drops(spec, None)
            assert (sum(single) > 0) == SPECS[spec], f"{spec}: drops {single}"
            for layout in layouts:
                assert_matches_golden(spec, layout, record)
                assert _drops(spec, layout) == single, f"{spec}/{layout}: drops differ"
