"""MoE with expert parallelism: where the batch is split each rank routes its own tokens (one
allgather of per-expert counts keeps the slots and drops of the whole batch), and where the
experts share that axis the compiler makes the op move tokens to their experts' ranks and
back by alltoallv (rules.exchange). Golden runs under mpiexec: tests/shard/runtime/moe_cases.py;
explain vs the counters and the flight recorder: tests/shard/train/run_cases.py (every example)."""

from __future__ import annotations

import pytest
from mpirun import case_names, case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.explain import estimate
from soapstone.shard.plan.analysis.explain_text import format_estimate
from soapstone.shard.plan.layout import Layout
from soapstone.shard.plan.program import Compute, Redistribute
from soapstone.shard.plan.program_text import format_program

CASES = "tests/shard/runtime/moe_cases.py"
SPEC = "examples/moe.par"


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_moe_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def _program(layout: str):
    spec = dsl.load(SPEC)
    return lower_graph(spec.model(), spec.parallel(layout)).program


def _moe(program) -> Compute:
    return next(s for s in program.steps if isinstance(s, Compute) and s.kind == "moe")


@pytest.mark.parametrize("layout,dist,exchange,out", [
    ("dp2", ("data",), (), "batch@data"),
    ("ep2", (), (), "partial@expert"),
    ("dpep", ("data",), ("data",), "batch@data"),
    ("dpep4", ("data",), ("data",), "batch@data"),
    ("dp2ep2", ("data",), (), "batch@data, partial@expert"),
    ("dp4ep2", ("data", "expert"), ("expert",), "batch@data, seq@expert"),
])
def test_the_rule_routes_local_tokens_and_exchanges_where_experts_share_the_axis(
        layout, dist, exchange, out):
    p = _program(layout)
    step = _moe(p)
    assert (step.dist, step.exchange, str(p.value(step.out).layout)) == (dist, exchange, out)
    # split tokens are never gathered for the moe op
    if dist:
        splits = tuple((a, pl) for a, pl in p.value(step.out).layout.placements if a in dist)
        assert p.value(step.args[0]).layout == Layout(splits)
        assert not [s for s in p.steps if isinstance(s, Redistribute) and s.kind == "allgather"]


def test_show_and_explain_count_the_dispatch():
    p = _program("dpep")
    text = format_program(p)
    assert "exchange@data" in text
    assert "forward alltoallv[data] f32[?,16] tokens to their experts' ranks" in text
    assert "forward allgather[data] i64[1,2,1,4]" in text
    est = estimate(p)
    # 32 tokens x top-2 over 4 experts of 12 slots (capacity 0.75): 48 choices kept at the
    # bound, 24 a rank, half of them to the other rank: 12 rows of 16 floats per alltoallv
    rows = {(t.phase, t.kind): (t.calls, t.bytes) for t in est.traffic}
    assert rows[("forward", "alltoallv")] == (2, 2 * 12 * 16 * 4)
    assert rows[("backward", "alltoallv")] == (2, 2 * 12 * 16 * 4)
    assert rows[("forward", "allgather")] == (1, 2 * 4 * 8)  # (n-1)/n of [2, 1, 2, 1, 4] i64
    assert est.experts == [{"op": "moe0", "experts": 4, "per_rank": 2, "param_bytes": 8192,
                            "exchange": ["data"], "choices": 64, "bound": 48}]
    assert "moe0: 2 of 4 experts per rank (8.0 KiB of expert params); alltoallv bytes are " \
        "expected at the capacity bound (48 of 64" in format_estimate(est)
    ep2 = format_estimate(estimate(_program("ep2")))
    assert "moe0: 2 of 4 experts per rank (8.0 KiB of expert params)\n" in ep2


def test_tokens_split_over_two_axes_gather_counts_per_run():
    """dp4ep2: batch over data and seq over expert, so a rank's tokens are one run per local
    row; the counts gather over both axes, the exchange runs along expert only (6 rows: 48
    kept choices over 4 ranks, half of each rank's to the other expert rank)."""
    text = format_program(_program("dp4ep2"))
    assert "forward allgather[data,expert] i64[1,2,2,4]" in text
    assert "forward alltoallv[expert] f32[?,16] tokens to their experts' ranks   (384 B" in text


def test_explain_counts_what_the_moe_kernel_saves_for_backward():
    """explain's activations (a moe op: its input, the router's probabilities and indices,
    each run choice's rows and hidden, expected at the capacity bound) against the tensors
    one real forward's autograd saves (saved-tensor hooks, as bench/bench_memory.py), one
    rank: this model keeps every expert full, so the bound is what runs."""
    import torch

    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.data.source import make_task
    from soapstone.shard.runtime.sharded_model import ShardedModel

    dims = {"batch": 4, "seq": 64, "hidden": 64, "experts": 4, "ffn": 256, "vocab": 128}
    program = lower(dsl.load(SPEC, dims=dims).model(), None)
    model = ShardedModel(program, None, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(make_task(program, 0).batch(0))
    want = estimate(program).activation_bytes
    assert abs(want / sum(saved.values()) - 1) < 0.05, (want, sum(saved.values()))
