"""Activation recompute (`recompute R` in a parallel block): each block of repeat R keeps only
its inputs for backward and runs its forward again there. It trains exactly as without it
(golden records, dropout masks), keeps less (explain's figure against a measured step), and
explain counts the collectives backward runs again. mpiexec cases:
tests/shard/parallel/recompute_cases.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mpirun import case_names, case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.explain import estimate
from soapstone.shard.plan.program import Compute
from soapstone.shard.plan.program_text import format_program

CASES = "tests/shard/parallel/recompute_cases.py"
SPEC = "tests/specs/recompute_layouts.par"


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_recompute_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_dropout_masks_are_redrawn_identically_under_accumulation():
    """gpipe order: every microbatch's forward runs before any backward, so the second forward
    of microbatch 0 must restore its own window of the batch."""
    sys.path.insert(0, "tests/shard/parallel")
    try:
        import torch

        from soapstone.comm import init

        init("mpi")
        from recompute_cases import train_twice
    finally:
        sys.path.remove("tests/shard/parallel")
    want, got = train_twice("drop_acc2"), train_twice("drop_acc2_rc")
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())


def test_compiler_marks_each_block_of_the_repeat():
    spec = dsl.load(SPEC)
    par = spec.parallel("rc_tp2")
    p = lower_graph(spec.model("gpt"), par).program
    assert len(p.recompute) == 4
    for k, (a, b) in enumerate(p.recompute):  # the block's ops and what their reads need
        assert p.steps[b - 1].out == f"layer.{k}.x.1"
        assert all(s.out.startswith(f"layer.{k}.") for s in p.steps[a:b] if isinstance(s, Compute))
    est = estimate(p)
    saved, _ = est.without_recompute
    assert est.activation_bytes < saved / 3 and est.recompute_flops > 0
    assert format_program(p).count("# recompute: steps") == 4  # show prints each range
    plain = lower_graph(spec.model("gpt"), spec.parallel("tp2")).program
    assert "# recompute" not in format_program(plain)
    assert plain.recompute == () and estimate(plain).without_recompute is None
    assert saved == estimate(plain).activation_bytes


def test_a_bias_free_block_keeps_its_input_split_by_the_sequence():
    """llama.par's blocks end in partial sums (no biases): under sequence parallelism the
    compiler reduce-scatters each branch's output before the residual add, so `recompute
    layer` keeps 2sbh/t bytes per block in bf16 (explain: 2 blocks less 1); under plain tensor
    parallelism it keeps the partial residual whole, 2sbh. Per block, one reduce_scatter and
    one allgather per norm either way. Inside context parallel c (the sequence over cp, each
    cp piece over model: a dim over two axes) the block keeps 2sbh/(ct), with the same
    collectives on the model axis."""
    from pathlib import Path

    from soapstone.dsl.compile.layout_proof import prove_layout
    from soapstone.shard.plan.analysis.activations import activation_figures
    from soapstone.shard.plan.analysis.precision import program_as_run
    from soapstone.shard.plan.layout import RedistributeKind as K
    from soapstone.shard.plan.program import Redistribute

    model = Path("examples/llama.par").read_text().split("parallel single")[0]
    layouts = Path("tests/specs/sp_residual.par").read_text().split(".par\"\n")[1]
    s, b, h, t, c = 16, 8, 32, 2, 2
    for layout, want in (("sp2_rc", 2 * s * b * h // t), ("tp2_rc", 2 * s * b * h),
                         ("cp2sp2_rc", 2 * s * b * h // (c * t))):
        kept, kinds = [], []
        for blocks in (1, 2):
            spec = dsl.load(model.replace("repeat 2", f"repeat {blocks}") + layouts)
            graph = lower_graph(spec.model("llama"), spec.parallel(layout))
            prove_layout(spec.model("llama"), graph)
            p = graph.program
            kept.append(activation_figures(program_as_run(p, "bf16"))[0])
            kinds.append([s.kind for s in p.steps
                          if isinstance(s, Redistribute) and s.axis == "model"])
        assert kept[1] - kept[0] == want, layout
        more = {k: kinds[1].count(k) - kinds[0].count(k) for k in K}
        assert more[K.ALLREDUCE if layout == "tp2_rc" else K.REDUCE_SCATTER] == 2, more
        assert more[K.ALLGATHER] == (0 if layout == "tp2_rc" else 2), more


def test_a_collectives_temporaries_and_the_second_run_by_hand():
    """llama.par under sp2_rc, bf16, s b h = 16 8 32 (2sbh = 8 KiB), t = 2. The runtime's
    reduce_scatter along seq (not the leading dim: batch is before it) copies its whole
    input chunk-major first; its backward's allgather receives into an [n, *shard] buffer
    before concatenating: 2sbh each way; so does a norm's allgather (backward: reduce_scatter
    of its partial gradient). Token ids gather flat, no gradient: 0. With batch 1 the chunks
    are already contiguous: no temporary (collective_scratch.py).

    `recompute layer`'s second run starts at the block's last step that keeps a tensor (the
    mlp's down projection: the add and the reduce_scatter after it keep none), so the mlp's
    gradient 2sbh and the residual's 2sbh/t are in flight; the run's peak is at the mlp's
    reduce_scatter, above the block's saves: the partial 2sbh, its copy 2sbh, the shard
    2sbh/t (batch 1: no copy)."""
    from pathlib import Path

    from soapstone.shard.plan.analysis import activations
    from soapstone.shard.plan.analysis.collective_scratch import collective_scratch
    from soapstone.shard.plan.analysis.precision import program_as_run
    from soapstone.shard.plan.layout import RedistributeKind as K
    from soapstone.shard.plan.program import Redistribute

    model = Path("examples/llama.par").read_text().split("parallel single")[0]
    layouts = Path("tests/specs/sp_residual.par").read_text().split(".par\"\n")[1]
    s, h, t = 16, 32, 2
    for b in (8, 1):
        spec = dsl.load(model + layouts, dims={"batch": b})
        p = program_as_run(lower_graph(spec.model("llama"), spec.parallel("sp2_rc")).program,
                           "bf16")
        full = 2 * s * b * h if b > 1 else 0
        for step in p.steps:
            if isinstance(step, Redistribute):
                want = (0, 0) if not p.value(step.src).is_float else {
                    K.REDUCE_SCATTER: (full, full), K.ALLGATHER: (full, full)}[step.kind]
                assert collective_scratch(step, p) == want, (step.out, b)
        sv = activations._saves_of(p)
        at = max(sv.again)
        assert p.steps[at].out == "layer.1.mlp0", p.steps[at]
        assert sv.rerun[at] - sv.again[at][1] == 2 * s * b * h + full + 2 * s * b * h // t


def test_explain_peak_matches_a_measured_step(tmp_path):
    """bench/bench_memory.py's measured peak (resident memory over one step) is within 15% of
    explain's activations + working set, with recompute and without; recompute lowers it."""
    rows = {}
    dims = ["--dim", "batch=8", "--dim", "seq=128", "--dim", "hidden=128", "--dim", "ffn=512",
            "--dim", "vocab=256"]
    for layout in ("single", "rc_single"):
        out = tmp_path / f"{layout}.json"
        r = subprocess.run([sys.executable, "bench/bench_memory.py", "--spec", SPEC,
                            "--parallel", layout, *dims, "--json", str(out)],
                           capture_output=True, text=True, timeout=600,
                           env={"OMP_NUM_THREADS": "1", "PATH": ""})
        assert r.returncode == 0, r.stderr
        rows[layout] = json.loads(out.read_text())[0]
        assert abs(rows[layout]["peak_error"]) < 0.15, r.stdout
    assert rows["rc_single"]["peak_step_bytes"] < 0.6 * rows["single"]["peak_step_bytes"]


def test_recompute_of_an_unknown_repeat_is_a_located_error(tmp_path):
    bad = tmp_path / "bad.par"
    bad.write_text(open("examples/gpt.par").read().replace(
        "parallel dp2 for gpt on mesh(data = 2) {", "parallel dp2 for gpt on mesh(data = 2) {\n"
        "  recompute layers"))
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "check", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{bad}:" in r.stderr and "recompute layers: model gpt has no repeat 'layers'" \
        in r.stderr and "layer" in r.stderr.split("hint:")[1]
