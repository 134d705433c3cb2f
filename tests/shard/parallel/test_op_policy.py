"""Recompute by op policy (`recompute ops`, shard/parallel/op_policy_plan.py): torchtitan's
selective activation checkpointing over each repeat block's ops. It trains exactly as without
it (one rank here; ZeRO-3 and tensor parallel at 2 ranks in tests/shard/parallel/
selective_cases.py, with ZeRO-3's gathers counted), keeps what the hand count says, and
explain's peak follows a measured step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.activations import activation_figures
from soapstone.shard.plan.analysis.cost import program_work
from soapstone.shard.plan.program_text import format_program

SPEC = "tests/specs/op_policy_layouts.par"
# Llama 3.1 8B's widths (torchtitan/models/llama/__init__.py); 2 layers, 16 tokens
WIDE = {"batch": 1, "seq": 16, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
        "vocab": 64}


def _program(layout: str, dims: dict | None = None):
    spec = dsl.load(SPEC, dims=dims)
    par = spec.parallel(layout)
    return lower_graph(spec.model(par.model), par).program


def test_every_other_weight_matmul_and_attention_are_held():
    """In each block wq, wv, w1 (and w2) keep their outputs, wk, wo, w3 are run again: the
    values their outputs reach (k_rep, the residual after attention, the up half) are dropped
    with the norms', rope's and the activations', and q and v are held for the rebuilds."""
    p = _program("ops_single")
    kind = {s.out: s.kind for s in p.steps}
    chains = format_program(p)
    assert len(p.dropped) == 2 * 9 and len(p.held) == 2 * 2
    assert sorted(kind[n] for n in p.dropped[:9]) == [
        "add", "einsum", "mul", "repeat_dim", "repeat_dim", "rmsnorm", "rmsnorm", "rope", "silu"]
    assert {kind[n] for n in p.held} == {"einsum"}
    # each rebuilt weight matmul: wk (k_rep), wo (the residual), w3 (the up half)
    assert chains.count("einsum -> rope -> rename -> repeat_dim again") == 2
    assert chains.count("(einsum -> add again)") == 2 and chains.count("(einsum again)") == 2
    assert chains.count("# recompute ops: held for backward") == 4
    # the block's output and what lies outside the blocks (final norm, head) stay
    assert p.steps[-1].out not in p.dropped and all(
        not n.startswith("rmsnorm") for n in p.dropped)


def test_kept_elements_per_token_per_layer_by_hand():
    """A LLaMA block keeps its input (4096), q (4096), v (1024), attention's output (4096)
    and its log-sum-exp (fp32, one per head: 32), and w1's output (14336): 27,648 elements
    and 32 fp32 lse per token, 27,712 in bf16 units (torchtitan's policy keeps 31,808: w2's
    output too, 4096, which its backward never reads). Without recompute it keeps the
    norms' outputs, q_rot, the repeated k and v, the residual and the four ffn values too:
    90,112 + the lse. The outside of the blocks is alike, so the difference is the blocks'."""
    h, kv, ffn, heads = WIDE["hidden"], WIDE["hidden"] // 4, WIDE["ffn"], WIDE["heads"]
    ops = h + h + kv + h + ffn
    assert ops == 27_648 and ops + 2 * heads == 27_712 and ops + 2 * heads + h == 31_808
    plain = 8 * h + 4 * ffn
    assert plain == 90_112
    tokens, layers, item = WIDE["batch"] * WIDE["seq"], 2, 4  # fp32 here
    got = activation_figures(_program("single", WIDE))[0] - \
        activation_figures(_program("ops_single", WIDE))[0]
    assert got == (plain - ops) * tokens * layers * item
    # and backward runs wk, wo and w3 again: 2 x tokens x hidden x (kv + hidden + ffn) each
    again = program_work(_program("ops_single", WIDE)).again
    assert again.matmul_flops == 2 * tokens * h * (kv + h + ffn) * layers


def test_one_rank_trains_bitwise_as_without_it():
    from soapstone.shard.data.source import make_task
    from soapstone.shard.runtime.executor import Executor

    spec = dsl.load(SPEC)
    model = spec.model("llama")
    task = make_task(lower_graph(model, None).program, 0)
    runs = []
    for layout in ("single", "ops_single"):
        ex = Executor(lower_graph(model, spec.parallel(layout)), None, seed=3)
        ex.use_optimizer(name="adamw", lr=1e-2)
        runs.append(([ex.train_step(task.batch(k), step=k) for k in range(2)],
                     ex.full_state_dict()))
    (want, want_params), (got, got_params) = runs
    assert got == want
    assert all(got_params[n].equal(t) for n, t in want_params.items())


def test_explain_peak_matches_a_measured_step(tmp_path):
    """bench/bench_memory.py's measured peak of one step is within 6% of explain's under
    `recompute ops` (held values, and rebuilds that bring their dropped inputs back with
    them, counted), and below the one without it."""
    dims = {"batch": 8, "seq": 128, "hidden": 128, "ffn": 384, "heads": 4, "kv_heads": 2,
            "vocab": 256}
    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--spec", SPEC,
                        "--parallel", "ops_single",
                        *(a for k, v in dims.items() for a in ("--dim", f"{k}={v}")),
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())[0]
    assert abs(row["peak_error"]) < 0.06, row
    plain = activation_figures(_program("single", dims))
    assert row["peak_step_bytes"] < 0.8 * math.fsum(plain), (row, plain)
