"""Runtime cases under mpiexec (tests/shard/train/test_run.py, tests/shard/plan/test_explain.py,
tests/shard/train/test_golden.py).

- explain vs a real step: for each example layout of this world size (pipelines too, plus
  pipeline layouts of tests/specs/pipe_layouts.par at 2 and 4 ranks), the bytes the
  communicators' `stats` counters record during one training step (forward, backward,
  optimizer step, loss report) equal `soapstone explain`'s figures per mesh axis and
  collective (calls and bytes; for pipelines bytes), ZeRO 2/3 layouts of
  tests/specs/zero_layouts.par included, and its param/grad/optimizer memory is within 10% of
  the measured tensors. Under `run --precision bf16` (case_explain_matches_counters_bf16, 1
  and 2 ranks) the same against `explain --precision bf16`.
- the expected sequence (shard/plan/verify/sequence.py, what the static verifier proves): in the
  same step, every communicator's flight recorder holds exactly the collectives and p2p messages
  (op, shape, dtype) the plan lists for this rank, in its order.
- golden: every example layout of this world size, pipelines included, reproduces its record
  (tests/golden/runs/<spec>.npz) through `soapstone.dsl.testing.assert_matches_golden`.
"""

from __future__ import annotations

from pathlib import Path

from measure import PLUGIN, W, assert_live_as_explained, load_spec, measure, measure_pipeline
from mpirun import ranks

from soapstone.dsl.compile.lower import lower
from soapstone.dsl.testing import assert_matches_golden
from soapstone.shard.parallel.ring_plan import find_rings

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = tuple(p.stem for p in sorted((ROOT / "examples").glob("*.par")))


def layouts(name: str, pipelines: bool = False) -> list[str]:
    """The example's layouts of this world size (pipeline layouts only if `pipelines`)."""
    s = load_spec(name)
    return [p.name for p in s.parallels.values()
            if p.world_size == W.size and (pipelines or not p.operator)]


PIPE_SPEC = ROOT / "tests/specs/pipe_layouts.par"
PIPE_LAYOUTS = {2: ("pp2f1b", "pp2inter"), 4: ("pp2dp2",)}
# branches: broadcasts and owned ops (br2 and dp2br2 are examples/towers.par's, measured above)
BRANCH_SPEC = "tests/specs/branch_layouts.par"
BRANCH_LAYOUTS = {2: ("gated_br2",), 4: ("br2tp2",)}
ZERO_SPEC = "tests/specs/zero_layouts.par"  # ZeRO 1-3: per-bucket scatters and gathers
ZERO_LAYOUTS = {2: ("dp2z1", "dp2z2", "dp2z3", "cp2z3"), 4: ("dp2tp2z3", "dp2sp2asyncz3")}
# every distributed form (layernorm, rmsnorm, softmax, cross-entropy split over the dim they
# reduce): the statistics allreduces shard/ops/kernels.py runs are the ones program.DIST_STATS lists
OPS_SPEC = "tests/specs/ops_layouts.par"
OPS_LAYOUTS = {2: ("hid2", "cls2"), 4: ("dp2hid2",)}
# gradient accumulation: a one-stage graph's microbatches (ZeRO 2 scatters each one)
ACC_SPEC = ROOT / "tests/specs/accumulate_layouts.par"
ACC_LAYOUTS = {2: ("dp2acc2", "tp2acc2")}
# attention's head_dim other than hidden / heads: activations and collectives of heads x 16
HEAD_DIM_SPEC = "tests/specs/head_dim_layouts.par"
HEAD_DIM_LAYOUTS = {2: ("tp2", "sp2", "cp2")}


def _explain_all(optimizer: str) -> None:
    ran = [(spec, layout) for spec in EXAMPLES for layout in layouts(spec, pipelines=True)]
    pipes = PIPE_LAYOUTS.get(W.size, ())
    assert ran or pipes, f"no layout of {W.size} ranks to measure (@ranks)"
    for spec, layout in ran:
        if load_spec(spec).parallel(layout).operator:
            measure_pipeline(ROOT / f"examples/{spec}.par", layout, optimizer)
        else:
            measure(spec, layout, optimizer)
    for layout in pipes:
        measure_pipeline(PIPE_SPEC, layout, optimizer)
    for layout in BRANCH_LAYOUTS.get(W.size, ()):
        measure(BRANCH_SPEC, layout, optimizer)
    for layout in ZERO_LAYOUTS.get(W.size, ()):
        measure(ZERO_SPEC, layout, optimizer)
    for layout in OPS_LAYOUTS.get(W.size, ()):
        measure(OPS_SPEC, layout, optimizer)
    for layout in ACC_LAYOUTS.get(W.size, ()):
        measure_pipeline(ACC_SPEC, layout, optimizer)
    for layout in HEAD_DIM_LAYOUTS.get(W.size, ()):
        measure(HEAD_DIM_SPEC, layout, optimizer)


@ranks(2, 4, 8)
def case_explain_matches_counters_adamw():
    _explain_all("adamw")


@ranks(2, 4, 8)
def case_explain_matches_counters_sgd():
    _explain_all("sgd")


# bf16 (`run --precision bf16`): one layout of each kind, against explain --precision bf16
BF16_LAYOUTS = {1: (("gpt", "single"),),
                2: (("gpt", "tp2"), ("gpt", "sp2"), ("gpt", "cp2"), ("gpt", "dp2"),
                    (ZERO_SPEC, "dp2z1"), (ZERO_SPEC, "dp2z3"))}
BF16_PIPES = {2: ((PIPE_SPEC, "pp2f1b"), (ACC_SPEC, "tp2acc2"))}


@ranks(1, 2)
def case_explain_matches_counters_bf16():
    """bf16 activations, collectives, gathers and p2p; fp32 masters, gradients and state.
    And float8 under sequence parallelism: its gathers' amax allreduce and e4m3 bytes, and
    with `overlap tensor` its rings' (e4m3 chunks forward, e5m2 chunks in a scatter ring's
    backward, each after its amax's allreduce)."""
    for spec, layout in BF16_LAYOUTS[W.size]:
        measure(spec, layout, "adamw", "bf16")
    if W.size == 2:
        measure("gpt", "sp2", "adamw", "float8")
        measure("gpt", "sp2async", "adamw", "float8")
    for path, layout in BF16_PIPES.get(W.size, ()):
        measure_pipeline(path, layout, "adamw", "bf16")


@ranks(1, 2, 4, 8)
def case_golden_examples():
    """Every runnable example layout of this size reproduces its single-rank record."""
    ran = 0
    for spec in EXAMPLES:
        record = ROOT / f"tests/golden/runs/{spec}.npz"
        for layout in layouts(spec, pipelines=True):
            assert_matches_golden(str(ROOT / f"examples/{spec}.par"), layout, str(record),
                                  plugins=(PLUGIN,))
            ran += 1
    assert ran, f"no example layout of {W.size} ranks (@ranks)"


@ranks(4)
def case_sequence_inside_context_parallel_holds_what_explain_says():
    """llama.par under cp2sp2_rc (tests/specs/sp_residual.par: the sequence over cp, each cp
    piece over model, `recompute layer`) reproduces the single-rank record, and a bf16 step's
    tensors alive (bench/bench_memory.py) are explain's within 6%; so are cp2bsp2's (the
    same, balanced). With `overlap tensor` beside balanced cp (cp2bsp2async) the model
    axis's collectives run as rings, the cp pieces moving as they lie: the run reproduces the
    record, its calls and bytes are explain's, its tensors alive within 6%."""
    spec = str(ROOT / "tests/specs/sp_residual.par")
    assert_matches_golden(spec, "cp2sp2_rc", str(ROOT / "tests/golden/runs/llama.npz"))
    dims = {"batch": 8, "seq": 128, "hidden": 128, "ffn": 256, "vocab": 256}
    assert_live_as_explained(spec, dims, "cp2sp2_rc")
    # balanced (zigzag) cp with sequence parallel inside: its run is checked against the
    # record with every example layout (case_examples_match_their_records)
    assert_live_as_explained(str(ROOT / "examples/llama.par"), dims, "cp2bsp2")
    loaded = load_spec(spec)
    rings = find_rings(lower(loaded.model(), loaded.parallel("cp2bsp2async")))
    assert {r.axis for r in rings.values()} == {"model"} and len(rings) >= 6, rings
    assert_matches_golden(spec, "cp2bsp2async", str(ROOT / "tests/golden/runs/llama.npz"))
    measure(spec, "cp2bsp2async", "adamw")
    assert_live_as_explained(spec, dims, "cp2bsp2async")
