"""Selective recompute (`recompute selective` in a parallel block): the compiler drops the
values that are cheap to rebuild per byte kept (shard/parallel/selective_plan.py), the runtime frees
them after forward and rebuilds them for backward (shard/parallel/selective.py). It trains exactly
as without it (golden records, dropout masks), keeps less (explain's figure against a measured
step), and makes no collective more. mpiexec cases: tests/shard/parallel/selective_cases.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest
from mpirun import case_names, case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.cost import program_work
from soapstone.shard.plan.analysis.explain import estimate
from soapstone.shard.plan.program_text import format_program

CASES = "tests/shard/parallel/selective_cases.py"
SPEC = "tests/specs/selective_layouts.par"


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_selective_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def _program(layout: str, dims: dict | None = None):
    spec = dsl.load(SPEC, dims=dims)
    par = spec.parallel(layout)
    return lower_graph(spec.model(par.model), par).program


def test_the_rule_drops_cheap_outputs_a_matmul_keeps():
    """The norms' and gelu's outputs go (each read by a matmul that keeps it); no matmul
    output, residual sum (what rebuilds it is not kept) or view does."""
    p = _program("sel_single")
    kinds = {s.out: s.kind for s in p.steps}
    assert {kinds[n] for n in p.dropped} == {"layernorm", "gelu"}
    assert len(p.dropped) == 4 * 3 + 1  # two norms and an activation a block, the final norm
    # ZeRO-3 frees parameters between uses: a norm (which reads gamma, beta) is kept
    z3 = _program("sel_zero3")
    assert {kinds[n] for n in z3.dropped} == {"gelu"}
    # sequence parallel: the norm's output is gathered before the matmul, which keeps the
    # gathered copy (a collective's output, never dropped)
    assert {kinds[n] for n in _program("sel_sp2").dropped} == {"gelu"}
    plain = lower_graph(dsl.load(SPEC).model("gpt"), None).program
    assert plain.dropped == () and "recompute selective" not in format_program(plain)
    assert format_program(p).count("# recompute selective:") == len(p.dropped)
    # a misspelt `selective` is a located error: tests/bad_specs/recompute_selective_misspelt.par
    # the rule is one of the compiler's two, checked where a Program is made
    assert p.drop_rule == "selective" and plain.drop_rule is None
    with pytest.raises(ValueError, match="drop_rule"):
        attrs.evolve(p, drop_rule="selectve")


def test_a_dropped_value_is_rebuilt_through_unsaved_intermediates():
    """dropout(gelu(h)): the mask-applied output is what the next matmul keeps; gelu's output
    is kept by no one, so rebuilding runs gelu then dropout again from the kept h."""
    from soapstone.shard.parallel.selective_plan import rebuild_steps

    p = _program("dropsel_acc2_sel")
    kinds = {s.out: s.kind for s in p.steps}
    assert {kinds[n] for n in p.dropped} == {"layernorm", "dropout"}
    h = next(n for n in p.dropped if kinds[n] == "dropout")
    assert [p.steps[i].kind for i in rebuild_steps(p, h)] == ["gelu", "dropout"]


def test_explain_shows_activations_with_and_without_and_the_flops():
    p = _program("sel_single")
    est = estimate(p)
    saved, _ = est.without_recompute
    plain = estimate(lower_graph(dsl.load(SPEC).model("gpt"), dsl.load(SPEC).parallel(
        "single")).program)
    assert saved == plain.activation_bytes and est.activation_bytes < 0.75 * saved
    assert est.recompute_flops > 0
    # the cost model runs the rebuilding steps again: memory-bound ops, no matmul
    again = program_work(p).again
    assert again is not None and again.other_bytes > 0 and again.matmul_flops == 0


def test_explain_peak_matches_a_measured_step(tmp_path):
    """bench/bench_memory.py's measured peak of one step is within 15% of explain's
    activations + working set under selective recompute, and below what explain gives without
    it (which tests/shard/parallel/test_recompute.py holds to the measured peak of `single`)."""
    dims = ["--dim", "batch=8", "--dim", "seq=128", "--dim", "hidden=128", "--dim", "ffn=512",
            "--dim", "vocab=256"]
    out = tmp_path / "sel.json"
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--spec", SPEC,
                        "--parallel", "sel_single", *dims, "--json", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())[0]
    assert abs(row["peak_error"]) < 0.15, row
    est = estimate(_program("sel_single", {"batch": 8, "seq": 128, "hidden": 128, "ffn": 512,
                                           "vocab": 256}))
    plain = sum(est.without_recompute) - row["input_bytes"]
    assert row["peak_step_bytes"] < 0.85 * plain, (row, plain)
