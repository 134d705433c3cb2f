"""MoE with tensor parallel inside the experts, ZeRO and pipelines (examples in
tests/specs/moe_compose.par; mpiexec cases: tests/shard/runtime/moe_compose_cases.py). Bad input
(an ffn the tensor axis does not divide, a misspelt activation, a shared width that is no dim)
is in the bad-spec corpus, tests/bad_specs/moe_*.par."""

from __future__ import annotations

import math

import pytest
from mpirun import case_names, case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.lang.errors import BadInput
from soapstone.dsl.testing import record_golden
from soapstone.shard.plan.analysis.explain import estimate

CASES = "tests/shard/runtime/moe_compose_cases.py"
SPEC = "tests/specs/moe_compose.par"


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_moe_compose_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


@pytest.mark.parametrize("layout,experts_sharded", [("dp2ep2z3", True), ("dpepz3", False)])
def test_zero_shards_expert_weights_over_data_only_where_replicated(layout, experts_sharded):
    """dp2ep2: the experts are split over `expert` and replicated over `data`, so ZeRO-3
    halves them with the rest; dpep: they are split over `data` already, and stay whole."""
    spec = dsl.load(SPEC)
    program = lower_graph(spec.model(), spec.parallel(layout)).program
    experts = sum(4 * math.prod(p.local_shape) for p in program.params
                  if p.name.rsplit(".", 1)[1] in ("w1", "w2", "w3"))
    assert experts == 4 * 2 * 3 * (2 * 8 * 16)  # per rank: 2 blocks x 3 weights x 2 experts
    whole = estimate(program, zero=0).param_bytes
    want = whole // 2 if experts_sharded else (whole - experts) // 2 + experts
    assert estimate(program, zero=3).param_bytes == want



def test_a_record_of_a_layout_over_several_ranks_is_bad_input(tmp_path):
    """golden record --parallel: only a one-rank layout (the CLI exits 2 on BadInput)."""
    with pytest.raises(BadInput, match="--parallel pp2: a record is of one rank, and this "
                       "layout needs 2"):
        record_golden(SPEC, str(tmp_path / "r.npz"), parallel="pp2")
    assert not (tmp_path / "r.npz").exists()
