"""Gradient accumulation is microbatching without stages: a layout whose schedule has
microbatches but no `operator` statement runs them on the same ranks, one after another, by the
same executor as a pipeline, and reproduces the single-rank run (tests/specs/accumulate_layouts.par
against the record of examples/mlp.par)."""

from __future__ import annotations

import pytest
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph

SPEC = "tests/specs/accumulate_layouts.par"
RECORD = "tests/golden/runs/mlp.npz"


@pytest.mark.parametrize("layout,ranks", [("acc4", 1), ("dp2acc2", 2), ("tp2acc2", 2)])
def test_accumulation_reproduces_the_single_rank_run(layout, ranks):
    r = run_mpi(ranks, ["-m", "soapstone.dsl.cli", "golden", "check", SPEC, RECORD,
                        "--parallel", layout, "--quiet"])
    assert r.ok, r.report()
    assert f"ok: {layout} reproduces" in r.stdout


def test_accumulation_compiles_one_microbatch():
    """The one stage's Program sees one microbatch of the batch; the graph keeps the whole."""
    spec = dsl.load(SPEC)
    graph = lower_graph(spec.model("mlp"), spec.parallel("dp2acc2"))
    assert graph.axis is None and graph.microbatches == 2 and graph.schedule == "gpipe"
    assert graph.batch_dim == "batch" and graph.batch == 8
    assert dict(graph.program.dims)["batch"] == 4
    assert graph.program.value("x").local_shape == (2, 32)  # and split over data
