"""The cost model's overlap (shard/plan/analysis/cost.py): traffic that overlaps compute on one
link adds up before compute hides any of it, links run side by side, and nothing exposed is
negative or hidden twice. Every figure against a hand computation; no timings."""

from __future__ import annotations

import pytest

from soapstone.shard.plan.analysis.cost import LinkLoad, Work, exposed_on_link, step_time
from soapstone.shard.plan.analysis.explain import Estimate, Traffic
from soapstone.shard.plan.analysis.hardware import Link, Profile

GB = 1e9


def profile() -> Profile:
    """Round numbers: 1 TFLOP/s matmuls, links of 1 GB/s (inter) and 10 GB/s (intra) with no
    latency, no per-op cost, 8 devices a node."""
    return Profile("hand", "by hand", 80 * 2**30, 1.0, 8, {"fp32": 1e12, "bf16": 2e12}, 1.0,
                   1e12, Link(10 * GB, 0.0), Link(1 * GB, 0.0))


def est(mesh: dict[str, int], zero: int, traffic: list[Traffic], m: int = 1) -> Estimate:
    return Estimate("m", "p", 16, mesh, zero, "adamw", 0, 0, 0, 0, traffic, microbatches=m)


def test_gathers_and_reductions_that_fit_their_windows_are_hidden():
    # 1 s of forward gathers in 4 s of forward, 2 s of backward gathers + 3 s of reduction
    # in 8 s of backward: the link is busy 5 s of 8: all hidden but the last of 4 buckets
    assert exposed_on_link(LinkLoad(1.0, 2.0, 3.0), 4.0, 8.0, 8.0, 4) == \
        pytest.approx((0.0, 0.75))


def test_overlapped_traffic_on_one_link_adds_up_before_compute_hides_it():
    # forward gathers 6 s against 4 s of forward: 2 s exposed; backward gathers 6 s take
    # 6/8 of the backward's link, so the 4 s reduction hides in the 2 s left: 2 s exposed
    assert exposed_on_link(LinkLoad(6.0, 6.0, 4.0), 4.0, 8.0, 8.0, 4) == \
        pytest.approx((2.0, 2.0))
    # gathers fill the backward: the reduction hides nowhere (once, not twice)
    assert exposed_on_link(LinkLoad(0.0, 10.0, 2.0), 4.0, 8.0, 8.0, 4) == \
        pytest.approx((2.0, 2.0))


def test_the_70b_example_exposes_what_the_link_carries_beyond_compute():
    """The issue's 70B case: 20.3 s of inter-node ZeRO-3 traffic (6 + 6 s of gathers, 8.3 s of
    reduce-scatters) against 13.6 s of compute was reported as ~0 s exposed. Now: forward
    13.6/3 s hides 4.533 s of the forward gathers (1.467 s exposed); the backward gathers take
    6 of the backward's 9.067 s, leaving 3.067 s for 8.3 s of reduction (5.233 s exposed):
    6.7 s = 20.3 - 13.6, all the link carries beyond compute."""
    f, b = 13.6 / 3, 13.6 * 2 / 3
    g, r = exposed_on_link(LinkLoad(6.0, 6.0, 8.3), f, b, b, 100)
    assert g == pytest.approx(6.0 - f)
    assert r == pytest.approx(8.3 - (b - 6.0))
    assert g + r == pytest.approx(20.3 - 13.6)


def test_nothing_exposed_is_negative():
    assert exposed_on_link(LinkLoad(), 1.0, 2.0, 2.0, 1) == (0.0, 0.0)
    assert exposed_on_link(LinkLoad(0.0, 0.0, 1.0), 0.0, 0.0, 0.0, 1) == (0.0, 1.0)
    # without ZeRO >= 2 the reduction hides only in the last microbatch's backward (2 of 8 s)
    assert exposed_on_link(LinkLoad(0.0, 0.0, 3.0), 4.0, 8.0, 2.0, 3) == \
        pytest.approx((0.0, 1.0))


@pytest.mark.parametrize("axis,attention", [("data", 0), ("cp", 1)])
def test_a_zero3_step_on_one_link_is_bound_by_the_link(axis, attention):
    """data = 16 over 8-device nodes: inter-node. Compute 12 s (4 forward, 8 backward: 4e12
    FLOPs at 1 TFLOP/s, x3); gathers 6 + 6 GB, reduce-scatter 4 GB in 4 buckets, at 1 GB/s.
    Exposed: gathers 2 s, reduction 2 s: the step is 16 s, the link's 16 s of traffic (the
    old model hid the gathers behind all 12 s of compute and the scatters behind the 8 s of
    backward: 13 s). ZeRO over cp alone (d1 c16 z3) the same: zero.py prefetches its
    buckets alike; context parallelism's own allgather of keys and values on cp (1 GB: 1 s)
    is waited for: 17 s (with its gathers costed as blocking, the reduction had the link
    to itself: 12 + 13 + 1 = 26 s)."""
    rows = [Traffic("forward", "allgather", axis, 1, int(6 * GB), prefetched=True),
            Traffic("backward", "allgather", axis, 1, int(6 * GB), prefetched=True),
            Traffic("forward", "allgather", axis, 1, int(attention * GB)),
            Traffic("grad sync", "reduce_scatter", axis, 4, int(4 * GB))]
    t = step_time(est({axis: 16}, 3, rows), [Work(matmul_flops=4e12)], profile())
    assert t.compute == pytest.approx(12.0)
    assert t.param_gathers == pytest.approx(2.0)
    assert t.blocking_comm == pytest.approx(attention)
    assert t.grad_sync == pytest.approx(2.0)
    assert t.total == pytest.approx(16.0 + attention)


def test_links_run_side_by_side_and_blocking_traffic_is_paid_in_full():
    """mesh data 8 x model 2 over 8-device nodes: model (span 2) is intra-node, data (span 16)
    inter-node. Tensor-parallel allreduces (20 GB at 10 GB/s: 2 s) block; the data link's
    ZeRO-2 reduction (12 GB: 12 s, 4 buckets) hides in the 8 s of backward: 4 s exposed
    (more than its last bucket's 3 s); an intra-node
    reduction on the model axis (10 GB: 1 s) runs beside it on its own link and adds
    nothing. Step: 12 + 2 + 4 = 18 s."""
    rows = [Traffic("forward", "allreduce", "model", 1, int(10 * GB)),
            Traffic("backward", "allreduce", "model", 1, int(10 * GB)),
            Traffic("grad sync", "reduce_scatter", "data", 4, int(12 * GB)),
            Traffic("grad sync", "allreduce", "model", 4, int(10 * GB))]
    t = step_time(est({"data": 8, "model": 2}, 2, rows), [Work(matmul_flops=4e12)],
                  profile())
    assert t.blocking_comm == pytest.approx(2.0)
    assert t.grad_sync == pytest.approx(4.0)
    assert t.param_gathers == 0.0
    assert t.total == pytest.approx(18.0)


@pytest.mark.parametrize("ring_flops,blocking", [(1e12, 4.0 - 1.0 + 6.0 - 2.0),
                                                  (4e12, 0.0 + 0.0)])
def test_collective_matmul_rings_hide_behind_their_matmuls(ring_flops, blocking):
    """`overlap tensor` on mesh model 2 (intra-node, 10 GB/s): the rings send 40 GB forward
    (4 s) and 60 GB backward (6 s). Their matmuls of 1 TFLOP forward run 1 s (backward 2 s):
    exposed 3 + 4 = 7 s; of 4 TFLOP (4 s, backward 8 s): nothing exposed. A blocking allgather
    beside them on the same axis stays paid in full (1 s)."""
    rows = [Traffic("forward", "send", "model", 4, int(40 * GB)),
            Traffic("backward", "send", "model", 4, int(60 * GB)),
            Traffic("forward", "allgather", "model", 1, int(10 * GB))]
    t = step_time(est({"model": 2}, 0, rows),
                  [Work(matmul_flops=4e12, ring_flops=ring_flops)], profile())
    assert t.blocking_comm == pytest.approx(blocking + 1.0)
    assert t.total == pytest.approx(12.0 + blocking + 1.0)


@pytest.mark.parametrize("overlap,blocking", [(1.0, 0.0), (0.5, 0.5 + 1.0)])
def test_a_profile_hides_its_share_of_a_rings_traffic(overlap, blocking):
    """ring_overlap: the share of the shorter of a ring's sends and its matmuls that is
    hidden. Sends 1 s forward, 2 s backward behind 4 s / 8 s of ring matmuls: all hidden at
    1; at 0.5 half of each: 0.5 + 1 s exposed (the link held the other half)."""
    import attrs

    rows = [Traffic("forward", "send", "model", 4, int(10 * GB)),
            Traffic("backward", "send", "model", 4, int(20 * GB))]
    prof = attrs.evolve(profile(), ring_overlap=overlap)
    t = step_time(est({"model": 2}, 0, rows), [Work(matmul_flops=4e12, ring_flops=4e12)], prof)
    assert t.blocking_comm == pytest.approx(blocking)
    assert t.total == pytest.approx(12.0 + blocking)
    # explain shows the rings apart: their sends, the part hidden, the part that blocks
    assert (t.ring_sends, t.ring_hidden) == pytest.approx((3.0, 3.0 * overlap))
    from soapstone.shard.plan.analysis.score import format_time
    assert f"rings (overlap tensor): sends 3 s, {3.0 * overlap:.4g} s of it hidden" in \
        format_time(t)


@pytest.mark.parametrize("ring_gb", [0, 1])
def test_rings_and_zero3_gathers_on_one_link_share_it(ring_gb):
    """`overlap tensor` beside ZeRO-3 on mesh data 2 x model 2, one 8-device node: both axes
    on the intra-node link (10 GB/s). Compute 12 s (4 forward, 8 backward); the rings'
    matmuls 3 s forward (6 s backward) hide their sends, 2 s forward and 4 s backward, so the
    link is theirs that long. ZeRO-3's gathers (3 s forward, 3 s backward) hide in what the
    rings leave: forward 4 - 2 = 2 s, 1 s exposed; backward 8 - 4 = 4 s, none. The
    reduce-scatter (2 s, 4 buckets) hides in the backward's free 1/8 (1 s): 1 s exposed.
    Step 14 s. Without the rings' traffic: gathers hidden, the reduction in 5 s free: only
    its last bucket (0.5 s): 12.5 s."""
    rows = [Traffic("forward", "allgather", "data", 1, int(30 * GB), prefetched=True),
            Traffic("backward", "allgather", "data", 1, int(30 * GB), prefetched=True),
            Traffic("grad sync", "reduce_scatter", "data", 4, int(20 * GB)),
            Traffic("forward", "send", "model", 4, int(ring_gb * 20 * GB)),
            Traffic("backward", "send", "model", 4, int(ring_gb * 40 * GB))]
    t = step_time(est({"data": 2, "model": 2}, 3, rows),
                  [Work(matmul_flops=4e12, ring_flops=3e12)], profile())
    assert t.blocking_comm == 0.0
    assert t.param_gathers == pytest.approx(1.0 * ring_gb)
    assert t.grad_sync == pytest.approx(1.0 if ring_gb else 0.5)
    assert t.total == pytest.approx(14.0 if ring_gb else 12.5)


# ---- the matmuls' roofline and fused chains ------------------------------------------------

def test_activation_matmuls_are_held_to_the_roofline():
    """Profile: 1 TFLOP/s matmuls (fp32), 1 TB/s memory. 10 TFLOPs of matmuls of which 2 are
    activation x activation moving 4 TB: weights 8 s, activations max(2 s, 4 s) = 4 s; with
    only 1 TB moved they are FLOP-bound: 2 s. Backward twice the forward."""
    prof = profile()
    w = Work(matmul_flops=10e12, act_flops=2e12, act_bytes=4e12)
    assert w.matmul_seconds(prof, "fp32") == pytest.approx(8.0 + 4.0)
    assert Work(matmul_flops=10e12, act_flops=2e12, act_bytes=1e12).matmul_seconds(
        prof, "fp32") == pytest.approx(10.0)
    assert w.seconds(prof, "fp32") == pytest.approx(3 * 12.0)
    # sums keep the parts apart
    both = w + Work(matmul_flops=1e12, other_bytes=1e12)
    assert (both.matmul_flops, both.act_flops, both.act_bytes, both.other_bytes) == \
        (11e12, 2e12, 4e12, 1e12)


def test_memory_bound_ops_run_at_the_profiles_measured_rate():
    """Profile: 1 TFLOP/s matmuls, 1 TB/s memory, memory-bound ops measured at 0.25 TB/s.
    1 TFLOP of matmuls and 1 TB of memory-bound bytes: forward 1 s + 4 s, forward + backward
    3 x 5 = 15 s (on the bandwidth alone: 3 x 2 = 6 s); 1 TB of float8 casts and the update
    stay on the bandwidth."""
    import attrs

    from soapstone.shard.plan.analysis.cost import optimizer_seconds

    plain = profile()
    measured = attrs.evolve(plain, memory_bound_bandwidth=0.25e12)
    w = Work(matmul_flops=1e12, other_bytes=1e12)
    assert w.forward_seconds(measured, "fp32") == pytest.approx(1.0 + 4.0)
    assert w.seconds(measured, "fp32") == pytest.approx(15.0)
    assert w.seconds(plain, "fp32") == pytest.approx(6.0)
    casts = Work(f8_forward_bytes=1e12, f8_backward_bytes=1e12)
    assert casts.cast_seconds(measured, "float8") == casts.cast_seconds(plain, "float8") == \
        pytest.approx((1.0, 1.0))
    e = attrs.evolve(est({"data": 1}, 0, []), optimizer_bytes=8e12)  # adamw: 1e12 elements
    assert optimizer_seconds(e, measured) == optimizer_seconds(e, plain) == \
        pytest.approx(2 * 16e12 / 1e12)


def test_a_fused_attention_moves_its_q_k_v_and_output_once():
    """examples/gpt.par on one rank, fp32: each of 4 layers' attention (batch 8, seq 16, 4
    heads of 8) is one fused call: the scores and p.v einsums are 2 x 8 x 4 x 16 x 16 x 8
    FLOPs each, and it reads q, k, v and writes its output, 8 x 16 x 32 x 4 bytes each; its
    mask and softmax add no bytes of their own (the s x s scores never reach memory)."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.cost import program_work

    program = lower_graph(load("examples/gpt.par").model(), None).program
    w = program_work(program)
    assert w.act_flops == 4 * 2 * (2 * 8 * 4 * 16 * 16 * 8)
    assert w.act_bytes == 4 * 4 * (8 * 16 * 32 * 4)
    # the memory-bound ops left, by hand (x = 8 x 16 x 32 x 4 bytes): per layer two layernorms
    # (x in and out, gamma and beta), two residual adds (two in, one out) and gelu on the
    # 8 x 16 x 64 hidden; the biases ride their matmul's epilogue (fused); then the
    # embedding (table and out), the last layernorm and the cross entropy (logits, loss)
    x = 8 * 16 * 32 * 4
    layernorm = 2 * x + 2 * 32 * 4
    layer = 2 * layernorm + 2 * 3 * x + 2 * (8 * 16 * 64 * 4)
    top = (64 * 32 * 4 + x) + layernorm + (8 * 16 * 64 * 4 + 4)
    assert w.other_bytes == 4 * layer + top


# ---- fused attention: its backward's recomputed scores, and the causal tiles it skips ------

def test_a_fused_attentions_backward_is_five_matmuls_to_forwards_two():
    """Profile: 1 TFLOP/s matmuls. An attention of 2 TFLOPs forward (scores 1, p.v 1),
    FLOP-bound: forward 2 s; backward the scores again (1 s) then dV, dP, dQ, dK (4 s): 5 s,
    2.5 x the forward, not 2 x; a kernel that skips 0.5 TFLOPs of masked tiles runs 1.5 s
    forward and 3.75 s backward."""
    prof = profile()
    w = Work(matmul_flops=2e12, act_flops=2e12, act_bytes=1e9, rescore_flops=1e12)
    assert w.matmul_seconds(prof, "fp32") == pytest.approx(2.0)
    assert w.seconds(prof, "fp32") == pytest.approx(2.0 + 5.0)
    masked = Work(matmul_flops=2e12, act_flops=2e12, act_bytes=1e9, skipped_flops=0.5e12,
                  rescore_flops=0.75e12)
    assert masked.seconds(prof, "fp32") == pytest.approx(1.5 + 3.75)
    assert (w + masked).rescore_flops == 1.75e12 and (w + masked).skipped_flops == 0.5e12


def test_fused_attention_runs_at_the_attention_rate_for_its_keys():
    """Profile: 1 TFLOP/s matmuls, attention at 0.5 of that up to 2048 keys, 1.0 from 8192.
    10 TFLOPs of matmuls, 2 of them a fused attention over 2048 keys (1 of them its scores,
    rescored in backward): weights 8 s, attention 2 / 0.5 = 4 s, forward 12 s; forward +
    backward 3 x 12 s and the scores again, 1 / 0.5 = 2 s: 38 s. The same attention over 4096
    keys (halfway in log2: 0.75) takes 2 / 0.75 s. Sums add entries with equal keys."""
    import attrs

    prof = attrs.evolve(profile(), attention=((2048, 0.5), (8192, 1.0)))
    w = Work(matmul_flops=10e12, act_flops=2e12, act_bytes=1e9, rescore_flops=1e12,
             attention=((2048, 2e12, 1e12),))
    assert w.matmul_seconds(prof, "fp32") == pytest.approx(8.0 + 4.0)
    assert w.seconds(prof, "fp32") == pytest.approx(3 * 12.0 + 2.0)
    assert w.seconds(profile(), "fp32") == pytest.approx(3 * 10.0 + 1.0)  # no curve: as before
    longer = attrs.evolve(w, attention=((4096, 2e12, 1e12),))
    assert longer.matmul_seconds(prof, "fp32") == pytest.approx(8.0 + 2 / 0.75)
    assert (w + w + longer).attention == ((2048, 4e12, 2e12), (4096, 2e12, 1e12))


def test_a_causal_kernel_runs_the_key_tiles_up_to_each_query_tile():
    """Tiles of 128: 256 positions are 2 x 2 tiles, 3 run (3/4); 1024 are 8 x 8, 36 run
    (9/16); 200 run 128 x 128 + 72 x 200 of 200 x 200; 16 fit one tile: all of it."""
    from soapstone.shard.plan.analysis.cost import causal_work

    assert causal_work(256, 256) == pytest.approx(3 / 4)
    assert causal_work(1024, 1024) == pytest.approx(9 / 16)
    assert causal_work(200, 200) == pytest.approx((128 * 128 + 72 * 200) / (200 * 200))
    assert causal_work(16, 16) == 1.0


@pytest.mark.parametrize("layout", [None, "cp2", "cp2b"])
def test_causal_attention_work_by_hand(layout):
    """examples/gpt.par at seq 256 (4 layers, batch 8, 4 heads of 8): each attention's scores
    einsum is E = 2 x 8 x 4 x 256 x 256 x 8 FLOPs, and p.v as many. On one rank the kernel
    runs is_causal: 3/4 of the tiles (skips 2E/4 a layer) and recomputes the scores' 3E/4 in
    backward. Under cp2 the rank's 128 queries meet all 256 keys through an explicit mask,
    computed whole: nothing skipped, its half-size scores (E/2) recomputed. The model FLOPs
    (matmul_flops, MFU's) count the full square either way. Under cp2 the last rank's queries
    128..255 see every key: its prefix is all 256 keys. Under cp2b (zigzag chunks of 64) each
    rank holds chunk r and 3-r: rank 0 runs 64 queries x 64 keys and 64 x 256, 5/8 of its
    128 x 256 square (rank 1: 64 x 128 + 64 x 192, the same), skipping 3/8. The attention
    rate goes by the keys each run of queries attends (`Work.attention`): the whole square's
    256; under cp2 the rank's 256 keys; under cp2b rank 0's chunks attend 64 and 256 keys,
    1/8 and 4/8 of its square."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.cost import program_work

    spec = load("examples/gpt.par", dims={"seq": 256})
    program = lower_graph(spec.model(), spec.parallel(layout) if layout else None).program
    w = program_work(program)
    e = 2 * 8 * 4 * 256 * 256 * 8
    if layout is None:
        assert w.act_flops == 4 * 2 * e
        assert w.skipped_flops == pytest.approx(4 * 2 * e / 4)
        assert w.rescore_flops == pytest.approx(4 * 3 * e / 4)
        runs = [(256, 4 * 2 * e * 3 / 4, 4 * e * 3 / 4)]
    elif layout == "cp2":
        assert w.act_flops == 4 * 2 * (e // 2)
        assert w.skipped_flops == 0.0
        assert w.rescore_flops == 4 * e // 2
        runs = [(256, 4 * e, 4 * e / 2)]
    else:
        assert (64 * 64 + 64 * 256) == (64 * 128 + 64 * 192) == 5 * 128 * 256 // 8
        assert w.act_flops == 4 * 2 * (e // 2)
        assert w.skipped_flops == pytest.approx(4 * 2 * (e // 2) * 3 / 8)
        assert w.rescore_flops == pytest.approx(4 * (e // 2) * 5 / 8)
        runs = [(64, 4 * e / 8, 4 * e / 16), (256, 4 * e * 4 / 8, 4 * e * 4 / 16)]
    assert [k for k, _, _ in w.attention] == [k for k, _, _ in runs]
    assert [x for _, f, r in w.attention for x in (f, r)] == \
        pytest.approx([x for _, f, r in runs for x in (f, r)])
    # backward's extra: half the forward's computed attention FLOPs (2.5x, not 2x)
    assert w.rescore_flops == pytest.approx((w.act_flops - w.skipped_flops) / 2)


@pytest.mark.parametrize("layout", [None, "cp2bsp2"])
def test_gqa_attention_keys_by_hand(layout):
    """examples/llama.par at seq 256 (2 layers, batch 8, 4 query heads of 8 sharing 2 kv
    heads): the fused GQA attention goes by its keys as a plain one does. One rank: the causal
    256 x 256 square, scores S = 2 x 8 x 4 x 256 x 256 x 8 FLOPs a layer, 3/4 of its tiles run.
    cp2bsp2 (balanced cp 2, sequence parallel inside, heads split over the model axis): rank
    0's 128 queries in chunks of 64 (chunk 0 and chunk 3) for 2 of the heads, S / 4 a layer,
    attend 64 and 256 keys: 1/8 and 4/8 of its 128 x 256 square."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.cost import program_work

    spec = load("examples/llama.par", dims={"seq": 256})
    w = program_work(lower_graph(spec.model(), spec.parallel(layout) if layout else None).program)
    s = 2 * 8 * 4 * 256 * 256 * 8
    if layout is None:
        runs = [(256, 2 * 2 * s * 3 / 4, 2 * s * 3 / 4)]
    else:
        runs = [(64, 2 * 2 * (s / 4) / 8, 2 * (s / 4) / 8),
                (256, 2 * 2 * (s / 4) * 4 / 8, 2 * (s / 4) * 4 / 8)]
    assert [e[0] for e in w.attention] == [r[0] for r in runs]
    assert [x for e in w.attention for x in e[1:]] == pytest.approx(
        [x for r in runs for x in r[1:]])
