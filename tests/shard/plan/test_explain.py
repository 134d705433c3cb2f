"""`soapstone explain`: the estimates agree with a real step (cases in
tests/shard/train/run_cases.py: communication bytes equal the comm layer's counters per axis and
collective; param/grad/optimizer memory within 10% of the measured tensors), and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mpirun import case_names, case_params, run_mpi

from soapstone.shard.plan.schedules import build

ROOT = Path(__file__).resolve().parents[3]
CASES = "tests/shard/train/run_cases.py"
CLI = ["-m", "soapstone.dsl.cli", "explain"]


# the explain cases of the run cases (test_golden.py takes the rest): one launch per size for both
EXPLAIN = [c for c in case_names(CASES) if c.startswith("case_explain_")]


@pytest.mark.parametrize("case,n", case_params(CASES, EXPLAIN))
def test_explain_matches_a_real_step(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_bubble_formula():
    assert build("1f1b", 1, 8).theory_bubble() == 0.0
    assert build("gpipe", 2, 4).theory_bubble() == pytest.approx(1 / 5)
    assert build("1f1b", 4, 8).theory_bubble() == pytest.approx(3 / 11)


def test_explain_table_and_json():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "dp2tp2"], check=True)
    for needle in ("params", "optimizer", "activations", "grad sync  allreduce       [data]",
                   "total", "bubble 0.000"):
        assert needle in r.stdout, r.stdout
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "tp2", "--json"], check=True)
    data = json.loads(r.stdout)
    assert data["optimizer_bytes"] == 2 * data["grad_bytes"]  # AdamW: 2 x fp32 per param
    assert data["bubble"] == 0.0 and data["imbalance"] == 1.0
    assert data["comm_bytes_per_axis"]["model"] > 0


def test_explain_pipeline_layout_per_stage():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "gpt8", "--json"], check=True)
    data = json.loads(r.stdout)
    assert data["stages"] == 2 and data["bubble"] == pytest.approx(1 / 5)
    ranks = data["pipe_ranks"]
    assert [r["pipe_rank"] for r in ranks] == [0, 1]
    # 1F1B: pipe rank s holds p - s microbatches' activations
    assert ranks[0]["microbatches_in_flight"] == {"0": 2}
    assert ranks[1]["microbatches_in_flight"] == {"1": 1}
    assert ranks[0]["activation_bytes"] == 2 * ranks[0]["activation_bytes_per_microbatch"]["0"]
    # one edge, [1, 8, 32] f32 = 1 KiB per microbatch, 4 microbatches, both directions
    assert data["edges"] == [{"src": 0, "dst": 1, "src_rank": 0, "dst_rank": 1,
                              "activation_bytes": 4096, "gradient_bytes": 4096}]
    assert data["comm_bytes_per_axis"]["pipe"] == 4096 + 8 + 8  # p2p + norm + loss
    r = run_mpi(1, [*CLI, "tests/specs/pipe_layouts.par", "--parallel", "pp2inter"],
                check=True)
    assert "bubble 0.111 = (p-1)/(v*m+p-1)" in r.stdout, r.stdout
    assert "edge 2 -> 3  p2p per step" in r.stdout and "in flight" in r.stdout


def test_explain_unknown_layout_exit_2():
    r = run_mpi(1, [*CLI, "examples/gpt.par", "--parallel", "tp3"])
    assert r.returncode == 2 and "no parallel block named 'tp3'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_pipeline_memory_is_what_the_executor_keeps_by_hand():
    """A pipe rank's activations and working set, computed by hand from its stages' own
    estimates and the edge's bytes, at a fixed microbatch size (gpt.par cut in two, 2 rows a
    microbatch): 1F1B holds p - s microbatches, each its saved bytes and (stage 0) the
    outputs it sends, stored for its B; the transient is the stage's working set plus the one
    message received ahead. The same at every m under 1F1B; m microbatches under GPipe."""
    import sys
    from pathlib import Path

    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.shard.plan.analysis.explain import estimate, estimate_pipeline

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from bench_pipe_memory import DIMS, layout

    for kind in ("1f1b", "gpipe"):
        for m in (4, 16, 64):
            model = dsl.load("examples/gpt.par", dims=DIMS | {"batch": 2 * m}).model()
            graph = lower_pipeline(model, layout(model, kind, m))
            (edge,) = graph.edges
            saved, work = zip(*[(e.activation_bytes, e.transient_bytes) for e in
                                (estimate(st.program) for st in graph.stages)], strict=True)
            flight = (2, 1) if kind == "1f1b" else (m, m)
            want = [(flight[0] * (saved[0] + edge.nbytes), work[0] + edge.nbytes),
                    (flight[1] * saved[1], work[1] + edge.nbytes)]
            ranks = estimate_pipeline(graph).pipe_ranks
            assert [(r["activation_bytes"], r["transient_bytes"]) for r in ranks] == want, \
                (kind, m)


def test_in_flight_walks_the_schedules_action_lists():
    """in_flight by hand: zb1p keeps the saved bytes (100) until W, the stored outputs (10)
    until B and the gradients B keeps for W (50) from B to W; pipe 3, rank 1 runs F0 F1 B0
    F2 B1 W0 F3 B2 W1 B3 W2 W3: after F2 two microbatches await B and one W (2 x 110 + 150),
    at W0 one awaits B and two W (110 + 2 x 150, the peak; without the kept gradients
    it is after F2: 3 x 100 + 2 x 10). Interleaved pipe 2, 2 chunks,
    m 4, rank 0: its warm-up runs F0 F1 of stage 0 and F0 F1 of stage 2, then F2 of stage 0
    before the first B: 3 x stage 0 + 2 x stage 2 is its peak; stage 0 alone reaches 4 after
    F3@0, when stage 2 holds 1 (4 x 101 + 1010 is less)."""
    from soapstone.shard.plan.analysis.in_flight import Peak, in_flight

    zb = build("zb1p", 3, 4)
    assert [str(a) for a in zb.ranks[1]][:6] == ["F0@1", "F1@1", "B0@1", "F2@1", "B1@1",
                                                 "W0@1"]
    assert in_flight(zb, 1, {1: 100}, {1: 10}, {1: 50}) == Peak(410, 0, {1: 3})
    assert in_flight(zb, 1, {1: 100}, {1: 10}) == Peak(320, 0, {1: 3})
    assert in_flight(build("1f1b", 3, 4), 1, {1: 100}, {1: 10}) == Peak(220, 0, {1: 2})
    inter = build("interleaved", 2, 4, 2)
    assert [str(a) for a in inter.ranks[0]][:6] == ["F0@0", "F1@0", "F0@2", "F1@2", "F2@0",
                                                    "B0@2"]
    assert in_flight(inter, 0, {0: 100, 2: 1000}, {0: 1, 2: 10}) == Peak(3 * 101 + 2 * 1010, 0,
                                                                         {0: 4, 2: 2})


def test_in_flight_adds_each_actions_own_working_set():
    """The peak per action, by hand: interleaved pipe 2, 2 chunks, m 4, rank 1 runs F0@1 F1@1
    F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1. Stage 1 keeps 100
    and sends 10 per microbatch, works with 5 in forward and 20 in backward; stage 3 (the
    loss) keeps 50 and works with 300 in forward, 400 in backward (its logits). At B0@3 it
    holds 2 x 110 + 50 = 270, + 400 = 670, the peak (at B1@3, B2@3 and B3@3 too); the most
    held, 3 x 110 = 330 after F2@1, comes with stage 1's working set (+ 5; before B0@1,
    + 20 = 350). The old bound, the most held plus the largest working set, was
    330 + 400 = 730. A split backward (zb1p, pipe 3, m 4, rank 1: F0 F1 B0 F2 B1 W0 F3 B2 W1
    B3 W2 W3, keeping 50 from B to W): at W0 one microbatch awaits B and two W,
    110 + 2 x 150 = 410, with W's working set (the backward's 30, none of its own given);
    after F2 (2 x 110 + 150 = 370) forward's 0 adds nothing."""
    from soapstone.shard.plan.analysis.in_flight import Peak, in_flight

    inter = build("interleaved", 2, 4, 2)
    assert [str(a) for a in inter.ranks[1]] == [
        "F0@1", "F1@1", "F0@3", "B0@3", "F1@3", "B1@3", "F2@1", "B0@1", "F3@1", "B1@1",
        "F2@3", "B2@3", "F3@3", "B3@3", "B2@1", "B3@1"]
    work = {1: (5, 20), 3: (300, 400)}
    assert in_flight(inter, 1, {1: 100, 3: 50}, {1: 10}, None, work) == \
        Peak(2 * 110 + 50, 400, {1: 3, 3: 1})
    # stage 1's backward working set large instead: at B0@1, 3 x 110 + 1000
    assert in_flight(inter, 1, {1: 100, 3: 50}, {1: 10}, None, {1: (5, 1000), 3: (0, 400)}) \
        == Peak(3 * 110, 1000, {1: 3, 3: 1})
    zb = build("zb1p", 3, 4)
    assert in_flight(zb, 1, {1: 100}, {1: 10}, {1: 50}, {1: (0, 30)}) == Peak(410, 30, {1: 3})


SPLIT_TINY = """
model tiny {
  dim batch = 2, hidden = 8, ffn = 16, classes = 4, vocab = 16
  input tokens : i64[batch]
  input targets : i64[batch]
  x = embedding(tokens, vocab -> hidden)
  repeat 2 as layer {
    x = x + linear(gelu(linear(x, hidden -> ffn)), ffn -> hidden)
  }
  logits = linear(x, hidden -> classes)
  output loss = cross_entropy(logits, targets)
}
parallel pp2 for tiny on mesh(pipe = 2) {
  operator layer[0] -> pipe 0, layer[1] -> pipe 1
  schedule zb1p, microbatches = 2
}
"""


def test_split_backward_working_sets_by_hand():
    """A split backward's B and W, each with what it keeps alive, by hand (bytes, fp32, one
    row a microbatch). Stage 1 of SPLIT_TINY: x [8] received, L0 = x.W0+b0 [16], g = gelu(L0)
    [16], L1 = g.W1+b1 [8], x1 = x + L1, logits = x1.Wh+bh [4], loss. Saved: x 32, L0 64
    (gelu's input), g 64, x1 32, logits 16 = 208. B (nothing saved let go) runs all of it
    from the input; the three linears are its joints, whose output gradients it keeps for W:
    L0 64 + L1 32 + logits 16 = 112. B's peak is at gelu: gradients x 32 + g 64 + L0 64
    beside the kept L1 and logits 48, 208 above the saved. W runs the three linears' weight
    halves beside saved + kept (320): at L1's, its weight gradient 512 (the head's 128 came
    with x1 still saved: 320 + 128; then x1 goes, 288 + 512 = 800), 480 above both. A whole
    backward's peak is at L1: saved 160 left + gradients 96 (the add hands x1's gradient to
    x and L1 as one tensor, 32, + g 64) + 512 = 768, 560 above the saved: in the last (here
    the only) block. Its head (the steps after the last block's: the output linear and the
    loss, which backward runs first) peaks at the output linear: x1's gradient 32 + Wh's 128
    beside the saved (the logits' gradient is written over the saved logits), 160; no other
    block, and no step before it (the rest and the tail: -208, nothing).

    Forward's working set, 24, is the loss's: one chunk of log-probabilities 16 and a float
    per token 4 (cross_entropy_scratch) beside the loss 4.

    zb1p, pipe 2, m 2, rank 1 runs F0 B0 F1 B1 W0 W1: F0 208 + forward's 24; B0 208 + 208;
    F1 320 (microbatch 0: saved + kept) + 208 + 24; B1 528 + 208 = 736; W0 2 x 320 + 480 =
    1120, the peak (whole-backward working sets: 640 + 560 = 1200)."""
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_pipeline
    from soapstone.shard.plan.analysis.activations import Phases, phase_figures
    from soapstone.shard.plan.analysis.explain import estimate_pipeline
    from soapstone.shard.plan.analysis.in_flight import Peak, in_flight

    spec = dsl.load(SPLIT_TINY)
    graph = lower_pipeline(spec.model(), spec.parallel("pp2"))
    ph = phase_figures(graph.stages[1].program)
    assert ph == Phases(saved=208, forward=24, backward=560, input_grad=208, weight_grad=480,
                        kept=112, head=160, last=560, rest=-208, tail=-208), ph
    sched = build("zb1p", 2, 2)
    assert [str(a) for a in sched.ranks[1]] == ["F0@1", "B0@1", "F1@1", "B1@1", "W0@1",
                                                "W1@1"]
    assert in_flight(sched, 1, {1: 208}, {}, {1: 112}, {1: ph.working}) == \
        Peak(640, 480, {1: 2})
    assert in_flight(sched, 1, {1: 208}, {}, {1: 112}, {1: (20, 592)}) == \
        Peak(640, 592, {1: 2})
    # explain's rank 1: the same, + the one 32-byte message received ahead
    row = estimate_pipeline(graph).pipe_ranks[1]
    assert (row["activation_bytes"], row["transient_bytes"]) == (640, 480 + 32), row


def test_zero3_over_context_parallel_halves_the_state_by_hand():
    """gpt.par's cp2 under ZeRO-3: the cp ranks hold the parameters whole, so ZeRO shards them
    (and gradients, optimizer state) over cp. With E float elements (4 bytes each, Adam's two
    moments): 4E parameter, 4E gradient and 8E state bytes at ZeRO 0 become 2E, 2E and 4E; the
    gradient allreduce over cp (2 (n-1)/n 4E = 4E bus bytes) becomes a reduce-scatter (2E) and
    allgathers in forward and backward (2E each), beside the attention's own gathers: rows of
    their own, prefetched (the cost model hides them behind compute, as zero.py runs them),
    where the attention's are waited for."""
    import math

    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.plan.analysis.explain import estimate

    spec = dsl.load("tests/specs/zero_layouts.par")
    model = spec.model()
    dims = dict(model.dims)
    e = sum(math.prod(dims[d] for d in p.type.dims) for p in model.params)
    prog = lower(model, spec.parallel("cp2z3"))

    def rows(est, prefetched=False):
        return {(t.phase, t.kind, t.axis): t.bytes for t in est.traffic
                if t.prefetched == prefetched}

    plain, sharded = estimate(prog, 0), estimate(prog, 3)
    assert (plain.param_bytes, plain.grad_bytes, plain.optimizer_bytes) == (4 * e, 4 * e, 8 * e)
    assert (sharded.param_bytes, sharded.grad_bytes, sharded.optimizer_bytes) == \
        (2 * e, 2 * e, 4 * e)
    before, after = rows(plain), rows(sharded)
    assert before[("grad sync", "allreduce", "cp")] == 4 * e
    assert ("grad sync", "allreduce", "cp") not in after
    assert after[("grad sync", "reduce_scatter", "cp")] == 2 * e
    assert after[("forward", "allgather", "cp")] == before[("forward", "allgather", "cp")]
    assert rows(sharded, prefetched=True) == {("forward", "allgather", "cp"): 2 * e,
                                              ("backward", "allgather", "cp"): 2 * e}
    assert not rows(plain, prefetched=True)


def test_full_grad_peak_walks_the_buckets_by_hand():
    """ZeRO-2/3's gradient buffers (bucket_plan.full_grad_peak), one reduction in flight:
    A (a1, a2), B (b1), C (c1, c2) transient, D deferred; full bytes 8, 4, 8, 2, outputs 4, 2,
    4. a1 makes A (8); a2 launches A (+4: 12); b1 makes B (16), launches it (18) and waits A (6);
    c1 makes C (14); d1 makes D (16); c2, the last gradient, launches C (20) and waits B (14);
    the end of backward waits C: D's 2 are left."""
    from soapstone.shard.parallel.bucket_plan import (
        REDUCTIONS_IN_FLIGHT,
        BucketPlan,
        GradBuffers,
        full_grad_peak,
    )

    assert REDUCTIONS_IN_FLIGHT == 1

    def plan(*names, deferred=False):
        return BucketPlan(names, len(names), ("data",), ("data",), (), None, deferred)

    plans = [plan("a1", "a2"), plan("b1"), plan("c1", "c2"), plan("d1", deferred=True)]
    got = full_grad_peak(plans, ["a1", "a2", "b1", "c1", "d1", "c2"], [8, 4, 8, 2],
                         [4, 2, 4, 0], [True, True, True, False])
    assert got == GradBuffers(at_make=16, at_launch=18, at_end=20, left=2)


def test_zero3_working_set_counts_the_buckets_in_flight_by_hand():
    """dp2z3 with 3 MiB blocks, fp32: every layer's bucket holds f bytes of gradient (its
    reduce-scatter's output o = f / 2, its gathered parameters f too), the head's (final
    layernorm and output linear) h. Backward runs the head, the last block, the rest, and
    ZeRO holds different buffers beside each (zero_memory.py):
    - the head: its bucket gathered and the last block's prefetched (h + f), the head's
      buffer made (h): 2h + f (at its launch h + h / 2, its own bucket freed: less);
    - the last block: its bucket and the one before gathered (2f), the head's in flight
      (1.5h), its own buffer made (f): 3f + 1.5h (at its launch one bucket gathered, both
      buffers: f + 1.5h + 1.5f, less);
    - the rest: the previous bucket in flight (f + o), this one's buffer (f) and two gathered
      (2f) when its first gradient arrives; at a launch 2(f + o) and one gathered: 4.5f
      against 4f (every bucket's buffer until the step would be 4f + 2f at the last launch).
    Each beside its own part's working set, the largest is the step's."""
    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.plan.analysis.activations import phase_figures
    from soapstone.shard.plan.analysis.explain import estimate
    from soapstone.shard.plan.analysis.zero_memory import zero_beside

    dims = {"batch": 4, "seq": 32, "hidden": 256, "heads": 4, "ffn": 1024, "vocab": 512}
    spec = dsl.load(ROOT / "tests/specs/zero_layouts.par", dims=dims)
    par = spec.parallel("dp2z3")
    program = lower(spec.model(par.model), par)

    def padded(numel: int) -> int:  # fp32 bytes, padded to an even element count
        return -(-numel // 2) * 2 * 4

    f = padded(sum(math.prod(p.local_shape) for p in program.params if p.block == "layer.0"))
    o = f // 2
    last = max(i for i, p in enumerate(program.params) if p.block is not None)
    h = padded(sum(math.prod(p.local_shape) for p in program.params[last + 1:]))
    beside = zero_beside(program, 3)
    assert (beside.head, beside.last, beside.backward) == \
        (2 * h + f, 3 * f + 3 * h // 2, max(2 * f + (f + o + f), f + 2 * (f + o)))
    ph = phase_figures(program)
    est = estimate(program, 3)
    assert est.activation_bytes == ph.saved
    assert ph.backward == max(ph.head, ph.last, ph.rest, ph.tail) and ph.rest < ph.last
    assert est.transient_bytes == max(ph.head + 2 * h + f, ph.last + 3 * f + 3 * h // 2,
                                      max(ph.rest, ph.tail) + max(2 * f + (f + o + f),
                                                                  f + 2 * (f + o)),
                                      ph.forward + 2 * f)


def test_an_alltoalls_and_a_slices_copies_by_hand():
    """collective_scratch.py against the runtime's code paths, by hand (fp32). head_dim
    cp2: attention's probs [batch 4, heads 4, seq 16/2, seq_k 16] go from seq shards to
    seq_k shards by an alltoall; neither dim leads, so it copies the input chunk-major
    (8 KiB) and receives into a buffer it then concatenates (8 KiB): 16 KiB, and the same
    for the inverse alltoall in backward. mlp rowfirst: x [8, 32] sliced along features is
    free forward; backward gathers its gradient along features (batch before it) through
    an [n, *shard] buffer, 8 x 32 x 4 = 1 KiB."""
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.collective_scratch import collective_scratch
    from soapstone.shard.plan.layout import RedistributeKind as K
    from soapstone.shard.plan.program import Redistribute

    def first(spec: str, layout: str, kind: K):
        loaded = dsl.load(spec)
        p = lower_graph(loaded.model(), loaded.parallel(layout)).program
        return next(s for s in p.steps if isinstance(s, Redistribute) and s.kind is kind and
                    p.value(s.src).is_float), p

    step, p = first("tests/specs/head_dim_layouts.par", "cp2", K.ALLTOALL)
    assert p.value(step.src).local_shape == (4, 4, 8, 16)
    assert collective_scratch(step, p) == (2 * 4 * 4 * 8 * 16 * 4,) * 2
    step, p = first("tests/specs/mlp_layouts.par", "rowfirst", K.SLICE)
    assert collective_scratch(step, p) == (0, 8 * 32 * 4)
