"""explain and plan under `--precision bf16` (shard/plan/analysis/precision.py): by hand, what
the runtime keeps and moves in bf16 (activations, working set, tensor-parallel collectives,
ZeRO-3 gathers, ZeRO-1/2 publishes, p2p, the loss) is half its fp32 figure; what it keeps in
fp32 (gradient buffers and their reduction, optimizer state) is unchanged; the parameters are
a bf16 model copy plus fp32 masters (ZeRO >= 1: a shard of them; ZeRO-3: the master shard
only). tests/shard/train/run_cases.py checks the same against a real bf16 step."""

from __future__ import annotations

import json
import math

from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.cost import program_work
from soapstone.shard.plan.analysis.explain import estimate, estimate_pipeline
from soapstone.shard.plan.analysis.precision import graph_as_run, program_as_run

ZERO = "tests/specs/zero_layouts.par"


def both(spec: str, layout: str):
    """(fp32 estimate, bf16 estimate, local float parameter elements) of one layout."""
    s = dsl.load(spec)
    par = s.parallel(layout)
    graph = lower_graph(s.model(par.model), par)
    elems = sum(math.prod(p.local_shape) for p in graph.stages[0].program.params)
    return (estimate_pipeline(graph, par.zero), estimate_pipeline(graph_as_run(graph, "bf16"),
                                                                  par.zero), elems)


def rows(e) -> dict:
    return {(t.phase, t.kind, t.axis): t.bytes for t in e.traffic}


def test_tensor_parallel_moves_and_keeps_half_beside_fp32_masters():
    f, b, n = both("examples/gpt.par", "tp2")
    assert rows(b)[("forward", "allreduce", "model")] * 2 == \
        rows(f)[("forward", "allreduce", "model")]
    assert rows(b)[("backward", "allreduce", "model")] * 2 == \
        rows(f)[("backward", "allreduce", "model")]
    assert rows(b)[("grad norm", "allreduce", "model")] == 8  # float64 either way
    # halved but the fused attention's log-sum-exp, fp32 in both: 4 bytes x (batch 8, 2
    # heads a rank, seq 16) x 4 layers
    assert b.activation_bytes * 2 - f.activation_bytes == 4 * 8 * 2 * 16 * 4
    assert b.transient_bytes * 2 == f.transient_bytes
    assert f.param_bytes == 4 * n and f.master_bytes == 0
    assert b.param_bytes == 2 * n + 4 * n and b.master_bytes == 4 * n  # bf16 copy + masters
    assert (b.grad_bytes, b.optimizer_bytes) == (f.grad_bytes, f.optimizer_bytes) == \
        (4 * n, 8 * n)


def test_zero1_reduces_fp32_gradients_and_publishes_bf16_parameters():
    f, b, n = both(ZERO, "dp2z1")
    key = ("grad sync", "reduce_scatter", "data")
    assert rows(b)[key] == rows(f)[key] == 4 * n // 2  # fp32 buffers: (n-1)/n of 4n bytes
    key = ("grad sync", "allgather", "data")
    assert rows(b)[key] * 2 == rows(f)[key] == 4 * n // 2
    assert rows(b)[("loss", "allreduce", "data")] == 2  # the bf16 loss, (n-1)/n x 2 bytes x 2
    assert b.param_bytes == 2 * n + 4 * n // 2  # the bf16 copy, half the masters
    # the fp32 log-sum-exp: batch 4 a rank, 4 heads, seq 16, 4 layers
    assert b.activation_bytes * 2 - f.activation_bytes == 4 * 4 * 4 * 16 * 4


def test_zero3_gathers_bf16_and_keeps_only_the_fp32_master_shard():
    f, b, n = both(ZERO, "dp2z3")
    for phase in ("forward", "backward"):
        key = (phase, "allgather", "data")
        assert rows(b)[key] * 2 == rows(f)[key] == 4 * n // 2
    key = ("grad sync", "reduce_scatter", "data")
    assert rows(b)[key] == rows(f)[key]
    assert b.param_bytes == f.param_bytes == 4 * n // 2 == b.master_bytes
    # beside forward's working set (zero_memory.py): the gathered buckets (bf16: half fp32's)
    # and, in bf16 only, the bf16 copy of the master shard the gathers send, cached all step
    from soapstone.shard.plan.analysis.zero_memory import zero_beside

    s = dsl.load(ZERO)
    program = lower_graph(s.model(), s.parallel("dp2z3")).program
    fz, bz = zero_beside(program, 3), zero_beside(program_as_run(program, "bf16"), 3)
    assert bz.forward * 2 - fz.forward == 2 * (2 * n // 2)
    # the gradient buffers are fp32 in both: at backward's end only they (and the copy) are held
    assert bz.end - fz.end == 2 * n // 2


def test_pipeline_boundaries_travel_in_bf16():
    f, b, _ = both("tests/specs/pipe_layouts.par", "pp2f1b")
    assert rows(b)[("p2p", "send", "pipe")] * 2 == rows(f)[("p2p", "send", "pipe")]
    # the fp32 log-sum-exp of the first stage's 2 microbatches in flight (batch 1, 4 heads,
    # seq 16, 2 layers)
    assert b.activation_bytes * 2 - f.activation_bytes == 2 * 4 * 1 * 4 * 16 * 2
    assert [e["activation_bytes"] * 2 for e in b.edges] == \
        [e["activation_bytes"] for e in f.edges]


def test_the_cost_models_memory_bound_bytes_are_the_compute_dtypes():
    program = lower_graph(dsl.load("examples/gpt.par").model(), None).program
    f, b = program_work(program), program_work(program_as_run(program, "bf16"))
    assert b.matmul_flops == f.matmul_flops and b.ops == f.ops
    assert b.other_bytes * 2 == f.other_bytes
    assert program_as_run(program, "fp32") is program


def test_explain_precision_flag():
    cli = ["-m", "soapstone.dsl.cli", "explain", "examples/gpt.par", "--parallel", "tp2"]
    r = run_mpi(1, [*cli, "--precision", "bf16", "--json"], check=True)
    data = json.loads(r.stdout)
    assert data["compute_dtype"] == "bf16" and data["master_bytes"] > 0
    r = run_mpi(1, [*cli, "--precision", "bf16"], check=True)
    assert "bf16 model copy + fp32 masters" in r.stdout, r.stdout
    r = run_mpi(1, [*cli, "--precision", "fp16"])
    assert r.returncode == 2 and "--precision" in r.stderr and "Traceback" not in r.stderr


def test_a_spec_in_bf16_keeps_its_masters_apart():
    """A spec declaring bf16 parameters (gpt's Program in bf16, as such a spec compiles) runs
    in bf16 at --precision fp32 too, its optimizer keeping fp32 masters: explain counts them."""
    program = lower_graph(dsl.load("examples/gpt.par").model(), None).program
    declared = program_as_run(program, "bf16")
    n = sum(math.prod(p.local_shape) for p in program.params)
    assert estimate(declared).param_bytes == 2 * n + 4 * n
    assert estimate(program).param_bytes == 4 * n


def test_the_watchdogs_plan_names_the_dtypes_a_bf16_run_sends():
    """run hands the watchdog the calls of the retyped graph: bf16 for tensor-parallel
    collectives, fp32 for the gradient reduction, float64 for the norm, as the recorder
    will see them (a hang report flags a call whose dtype differs from the plan's)."""
    from soapstone.dsl.compile.layout_proof import expected_calls

    s = dsl.load(ZERO)
    par = s.parallel("dp2tp2z3")
    graph = graph_as_run(lower_graph(s.model(par.model), par), "bf16")
    calls = expected_calls(graph, 0)
    dtypes = {(c["op"], c["dtype"]) for per in calls.values() for c in per.get("collective", [])}
    assert ("allreduce", "bfloat16") in dtypes  # tensor parallel
    assert ("allgather", "bfloat16") in dtypes  # ZeRO-3 gathers
    assert ("reduce_scatter", "float32") in dtypes  # fp32 gradient buffers
    assert ("allreduce", "float64") in dtypes  # the grad norm
    assert ("allreduce", "float32") not in dtypes
