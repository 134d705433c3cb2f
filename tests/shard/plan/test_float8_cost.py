"""The cost model under `--precision float8` (shard/plan/analysis/cost.py): the weight matmuls
at the fp8 peak, the rest at bf16's, and the casts' memory traffic; every figure against a
hand computation; no timings."""

from __future__ import annotations

import attrs
import pytest

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.cost import Work, float8_casts, program_work
from soapstone.shard.plan.analysis.hardware import Link, Profile, ProfileError
from soapstone.shard.plan.analysis.precision import program_as_run
from soapstone.shard.plan.analysis.score import peak_of

GB = 1e9


def profile(fp8: bool = True) -> Profile:
    """Round numbers: bf16 2 TFLOP/s, fp8 4 TFLOP/s, at efficiency 1; 1 TB/s of memory; no
    per-op cost."""
    peaks = {"fp32": 1e12, "bf16": 2e12} | ({"fp8": 4e12} if fp8 else {})
    return Profile("hand", "by hand", 80 * 2**30, 1.0, 8, peaks, 1.0, 1e12,
                   Link(10 * GB, 0.0), Link(1 * GB, 0.0))


def test_one_matmuls_casts_by_hand():
    # x 128 x 32, w 32 x 64, y 128 x 64 in bf16 (2 bytes): a cast moves 2 + 2 + 1 = 5 bytes
    # an element. Forward: x and w cast (5 x (4096 + 2048)), w copied column-major (2 x
    # 2048). Backward: g, x, w cast (5 x (8192 + 4096 + 2048)), x^T and g copied (2 x
    # (4096 + 8192)).
    assert float8_casts(4096, 2048, 8192, 2) == (5 * 6144 + 2 * 2048,
                                                 5 * 14336 + 2 * 12288)
    # x cast by the matmul before (k and v after q): forward casts only w
    assert float8_casts(4096, 2048, 8192, 2, shared=True) == (5 * 2048 + 2 * 2048,
                                                              5 * 14336 + 2 * 12288)


def test_float8_runs_its_matmuls_at_the_fp8_peak_and_pays_its_casts():
    # 4 TFLOP of matmuls, 3 of them float8, 1 of them activation x activation (bound by FLOPs
    # here: 1 GB at 1 TB/s is 1 ms); casts 1 GB forward, 2 GB backward
    w = Work(matmul_flops=4e12, act_flops=1e12, act_bytes=1e9, f8_flops=2e12,
             f8_forward_bytes=1e9, f8_backward_bytes=2e9)
    # bf16: all 4 TFLOP at 2 TFLOP/s, x3 for backward; no casts
    assert w.seconds(profile(), "bf16") == pytest.approx(3 * 2.0)
    # float8: 1 TFLOP weight (bf16) at 2, 2 TFLOP at 4 (fp8), 1 activation TFLOP at 2:
    # 0.5 + 0.5 + 0.5 = 1.5 s forward, x3; casts 3 GB at 1 TB/s = 3 ms
    assert w.matmul_seconds(profile(), "float8") == pytest.approx(1.5)
    assert w.seconds(profile(), "float8") == pytest.approx(3 * 1.5 + 0.003)
    # recompute runs the forward again, its forward casts with it (1 ms)
    again = Work(matmul_flops=2e12, f8_flops=2e12, f8_forward_bytes=1e9,
                 f8_backward_bytes=2e9)
    r = Work(again=again) + again
    assert r.seconds(profile(), "float8") == pytest.approx(3 * 0.5 + 0.003 + 0.5 + 0.001)


def test_a_rings_matmuls_hide_its_sends_at_their_own_rates():
    """Under float8 a ring's float8 steps run at the fp8 peak, its `float8 = false` ones at
    bf16's: 3 TFLOP of ring matmuls, 2 of them float8: 2/4 + 1/2 = 1 s (all at the fp8
    rate, as before: 0.75 s); under bf16 all at 2 TFLOP/s: 1.5 s."""
    w = Work(matmul_flops=4e12, f8_flops=3e12, ring_flops=3e12, ring_f8_flops=2e12)
    assert w.ring_seconds(profile(), "float8") == pytest.approx(1.0)
    assert w.ring_seconds(profile(), "bf16") == pytest.approx(1.5)
    assert (w + w).ring_seconds(profile(), "float8") == pytest.approx(2.0)


def test_a_profile_without_an_fp8_peak_refuses_float8():
    with pytest.raises(ProfileError, match="'fp8'"):
        Work(matmul_flops=1.0, f8_flops=1.0).seconds(profile(fp8=False), "float8")
    with pytest.raises(ProfileError, match="--precision float8"):
        peak_of(profile(fp8=False), "float8")
    assert peak_of(profile(), "float8") == 2e12  # MFU over bf16's peak


def test_gpt_work_by_hand():
    """examples/gpt.par (batch 8 x seq 16 = 128 tokens, hidden 32, 4 heads x 8, ffn 64,
    vocab 64), retyped to bf16: its 25 weight matmuls (q, k, v, o, mlp up and down in 4 blocks,
    the output) are float8's, attention's products are not; k and v share q's cast of x."""
    program = program_as_run(lower_graph(dsl.load("examples/gpt.par").model(), None).program,
                             "float8")
    w = program_work(program)
    t = 128
    qkvo, up, down = (t * 32, 32 * 32, t * 32), (t * 32, 32 * 64, t * 64), \
        (t * 64, 64 * 32, t * 32)
    flops = 2 * t * (4 * (4 * 32 * 32 + 2 * 32 * 64) + 32 * 64)
    assert w.f8_flops == flops == 8_912_896
    assert w.matmul_flops - w.act_flops == flops  # every weight matmul is float8's
    casts = [float8_casts(*qkvo, 2)] * 8 + [float8_casts(*qkvo, 2, shared=True)] * 8 + \
        [float8_casts(*up, 2)] * 5 + [float8_casts(*down, 2)] * 4
    # by hand, per block: q and o 5 x (4096 + 1024) + 2 x 1024, k and v 5 x 1024 + 2 x 1024,
    # up 5 x (4096 + 2048) + 2 x 2048, down 5 x (8192 + 2048) + 2 x 2048; the output as up
    assert w.f8_forward_bytes == sum(f for f, _ in casts) == \
        4 * (2 * 27648 + 2 * 7168 + 34816 + 55296) + 34816 == 673_792
    assert w.f8_backward_bytes == sum(b for _, b in casts) == 1_865_728


def test_a_float8_matmul_holds_its_casts_while_it_runs():
    """The working set of a float8 step beyond what the walk counts at it (its output 2Y;
    in backward the gradients of g, x and w: 2Y, 2X, 2W), by hand in elements X, W, Y: a
    cast holds 8 bytes an element (two fp32 copies), a float8 copy 1. q of gpt.par (x 128
    x 32, w 32 x 32: X = Y = 4096, W = 1024): forward max(8X - 2Y, X + 8W - 2Y, X + 2W) =
    24576 (x's cast); backward max(8Y - 2X - 2W, Y + 8W - 2X - 2W, Y + W + 8X - 2W,
    2Y + W + 2X) = 35840 (x's cast again, g's and w's copies beside it); none under bf16.
    A biased linear adds its bias apart: the product beside the sum and x's copy, X + 2Y (mlp's
    first, x 64 x 16, w 16 x 64: 9216 against 3072 without); what is saved is bf16's."""
    from soapstone.shard.ops.einsum import float8_scratch, float8_steps
    from soapstone.shard.ops.registry import record_of
    from soapstone.shard.plan.analysis.activations import activation_figures

    program = lower_graph(dsl.load("examples/gpt.par").model(), None).program
    bf16, f8 = program_as_run(program, "bf16"), program_as_run(program, "float8")
    i = next(k for k, s in enumerate(program.steps) if s.out == "layer.0.attention0.q")
    rec = record_of("einsum")
    assert (rec.scratch(f8.steps[i], f8), rec.backward_scratch(f8.steps[i], f8)) == \
        (24576, 35840)
    assert rec.scratch(bf16.steps[i], bf16) == rec.backward_scratch(bf16.steps[i], bf16) == 0
    mlp = dsl.load("examples/mlp.par", dims={"batch": 64, "features": 16, "ffn": 64,
                                             "classes": 16}).model()
    prog = program_as_run(lower_graph(mlp, None).program, "float8")
    first = prog.steps[min(float8_steps(prog))]
    assert float8_scratch(first, prog, biased=True) == (9216, 28672)
    assert float8_scratch(first, prog)[0] == 3072
    assert activation_figures(f8)[0] == activation_figures(bf16)[0]


def test_a_float8_gathers_casts_and_traffic_by_hand():
    # x gathered over 8 ranks in float8: forward casts this rank's eighth (512 of 4096) before
    # the gather; backward keeps the gathered float8 x (no cast of x), casting the shard again
    # only where it regathers
    cast = 2 * 2 + 1
    assert float8_casts(4096, 2048, 8192, 2, gathered=8) == (
        cast * (512 + 2048) + 2 * 2048, cast * (8192 + 2048) + 2 * (4096 + 8192))
    assert float8_casts(4096, 2048, 8192, 2, gathered=8, regathered=True)[1] == \
        cast * (8192 + 2048 + 512) + 2 * (4096 + 8192)
    assert float8_casts(4096, 2048, 8192, 2, shared=True, gathered=8)[0] == \
        cast * 2048 + 2 * 2048


def test_sequence_parallel_gathers_move_float8_bytes_in_explain_and_show():
    from soapstone.dsl.app.show_text import render
    from soapstone.shard.plan.analysis.explain import estimate

    spec = dsl.load(open("examples/gpt.par").read())
    program = lower_graph(spec.model(), spec.parallel("sp2")).program
    rows = {}
    for precision in ("bf16", "float8"):
        est = estimate(program_as_run(program, precision))
        rows[precision] = {(t.phase, t.kind): (t.calls, t.bytes) for t in est.traffic}
    bf16, f8 = rows["bf16"], rows["float8"]
    # 9 gathers (4 blocks' attention and mlp inputs, the output projection's), each a
    # [batch 8, seq 16, hidden 32] slab, in forward and again for backward (regathered): 2 ->
    # 1 byte an element, half of it sent by each of 2 ranks; plus a 4-byte amax allreduce each
    saved = 9 * 8 * 16 * 32 // 2
    for phase in ("forward", "backward"):
        assert bf16[phase, "allgather"][1] - f8[phase, "allgather"][1] == saved
        calls, nbytes = f8[phase, "allreduce"]
        was = bf16.get((phase, "allreduce"), (0, 0))
        assert (calls - was[0], nbytes - was[1]) == (9, 9 * 4)  # ring: 2(n-1)/n = 1 of it
    # the gradients' reduce-scatters stay in bf16
    assert bf16["backward", "reduce_scatter"] == f8["backward", "reduce_scatter"]
    # q reads its gathered input uncast (its float8 copy is the gather's, kept for backward):
    # X = 8 x 16 x 32 = 4096, W = 32 x 16 = 512 (its heads split), Y = 2048 elements; forward
    # max(X + 8W - 2Y, X + 2W) = 5120, backward max(8Y - 2X - 2W, Y + W - 2W, 2Y + W + X)
    # = 8704 (x's transposed copy only), where a cast of x would hold 8X - 2Y = 28672 and
    # Y + W + 8X - 2W = 34304
    from soapstone.shard.ops.einsum import float8_scratch

    f8_program = program_as_run(program, "float8")
    q = next(s for s in f8_program.steps if s.out == "layer.0.attention0.q")
    assert float8_scratch(q, f8_program) == (5120, 8704)
    unmarked = attrs.evolve(q, attrs=tuple(a for a in q.attrs if a[0] != "float8_gathered"))
    assert float8_scratch(unmarked, f8_program) == (28672, 34304)
    text = render(spec, None, "sp2", precision="float8")
    assert text.count("then the gather moves e4m3, 4.0 KiB") == 9
    assert "e4m3" not in render(spec, None, "sp2", precision="bf16")


def test_float8_rings_move_float8_chunks_in_explain_and_show():
    """`overlap tensor` under float8 (ring_plan.float8_rings): gpt sp2async's 12 rings (4
    blocks' attention-input gather ring and two reduce-scatter rings) each send one
    [batch 8, seq 8, hidden 32] chunk a direction; a gather ring's forward chunks and a
    scatter ring's backward ones move 1 byte an element instead of 2, each after a 4-byte amax
    allreduce; the partial sums stay bf16. Beside them 5 float8 gathers (the biased mlp
    inputs, whose fused linear no ring runs, and the output projection's), regathered."""
    from soapstone.dsl.app.show_text import render
    from soapstone.shard.parallel.ring_plan import float8_ring_refusal
    from soapstone.shard.plan.analysis.explain import estimate

    spec = dsl.load(open("examples/gpt.par").read())
    program = lower_graph(spec.model(), spec.parallel("sp2async")).program
    assert float8_ring_refusal(program) == ""  # was: refused beside `overlap tensor`
    rows = {}
    for precision in ("bf16", "float8"):
        est = estimate(program_as_run(program, precision))
        rows[precision] = {(t.phase, t.kind): (t.calls, t.bytes) for t in est.traffic}
    bf16, f8 = rows["bf16"], rows["float8"]
    chunk = 8 * 8 * 32  # elements: 2 bytes in bf16, 1 as e4m3 / e5m2
    assert bf16["forward", "send"] == (12, 12 * 2 * chunk)
    assert f8["forward", "send"] == (12, 4 * chunk + 8 * 2 * chunk)
    assert f8["backward", "send"] == (12, 4 * 2 * chunk + 8 * chunk)
    for phase, rings in (("forward", 4), ("backward", 8)):
        was = bf16.get((phase, "allreduce"), (0, 0))
        assert f8[phase, "allreduce"] == (was[0] + 5 + rings, was[1] + 4 * (5 + rings))
    # a gather ring's readers take its e4m3 x as a float8 gather's do (cast as shards,
    # cost.float8_casts' `gathered`), and backward keeps it: the 4 ringed gathers' regather
    # casts of sp2 (a [8, 8, 32] shard each, 2 x 2 + 1 bytes an element) are not paid
    sp2 = program_work(program_as_run(
        lower_graph(spec.model(), spec.parallel("sp2")).program, "float8"))
    ring = program_work(program_as_run(program, "float8"))
    assert ring.f8_forward_bytes == sp2.f8_forward_bytes
    assert sp2.f8_backward_bytes - ring.f8_backward_bytes == 4 * chunk * (2 * 2 + 1)
    text = render(spec, None, "sp2async", precision="float8")
    assert text.count("carrying the e4m3 chunks (2.0 KiB each, after the amax's 4 B") == 4
    assert text.count("carrying the e5m2 chunks (2.0 KiB each, after the amax's 4 B") == 8
    assert "float8" not in render(spec, None, "sp2async", precision="bf16")


MIXED = """
model m {
  dim batch = 8, seq = 16, hidden = 32, ffn = 64, vocab = 64
  input tokens  : i64[batch, seq]
  input targets : i64[batch, seq]
  x = embedding(tokens, vocab -> hidden)
  h = rmsnorm(x)
  x = x + linear(linear(h, hidden -> ffn, bias = false) * linear(h, hidden -> ffn, bias = false,
                 float8 = OPT), ffn -> hidden, bias = false)
  logits = linear(rmsnorm(x), hidden -> vocab, bias = false)
  output loss = cross_entropy(logits, targets)
}
parallel r for m on mesh(model = 2) {
  parameter ffn, vocab -> model
  attribute seq -> model
  overlap tensor
}
"""


def test_what_float8_still_refuses_beside_rings():
    """float8 runs a ring whose matmuls are all float8 (or all not); it refuses one whose
    matmuls mix them (one cast serves all its chunks) and one whose chunk of rows is no
    multiple of 16 tokens though the whole is (batch 1: 16 tokens, chunks of 8); a width no
    float8 matmul takes whole is named as without rings (einsum.float8_refusal)."""
    from soapstone.shard.parallel.ring_plan import float8_ring_refusal, float8_rings

    def refusal(opt: str, batch: int = 8, hidden: int = 32) -> str:
        text = MIXED.replace("OPT", opt).replace("batch = 8", f"batch = {batch}") \
            .replace("hidden = 32", f"hidden = {hidden}")
        program = lower_graph(dsl.load(text).model(), dsl.load(text).parallel("r")).program
        assert len(float8_rings(program)) == (3 if opt == "true" else 2)
        return float8_ring_refusal(program)

    assert refusal("true") == ""
    why = refusal("false")
    assert why.startswith("linear0, linear1: `overlap tensor` runs these as one ring") and \
        "set `float8` the same on all of them, or drop `overlap tensor`" in why, why
    why = refusal("true", batch=1)
    assert "a 1/2 chunk of rows at a time" in why and "a chunk has 8;" in why, why
    why = refusal("true", hidden=24)
    assert "runs this weight matmul with torch._scaled_mm" in why, why


def test_a_ring_of_bf16_matmuls_is_priced_at_the_bf16_rate():
    """MIXED with both readers of h `float8 = false`: their gather ring runs bf16 matmuls
    under float8 (the gathered h [8, 16, 32] times this rank's w [32, 64 / 2], twice:
    2 x 2 x 128 x 32 x 32 FLOPs), so `ring_f8_flops` leaves them out; the reduce-scatter
    ring's matmul (ffn -> hidden) and the output projection's stay float8."""
    from soapstone.shard.parallel.ring_plan import find_rings

    text = MIXED.replace("OPT", "false").replace("hidden -> ffn, bias = false)",
                                                  "hidden -> ffn, bias = false, float8 = false)")
    spec = dsl.load(text)
    program = program_as_run(lower_graph(spec.model(), spec.parallel("r")).program, "float8")
    work = program_work(program)
    assert len(find_rings(program)) == 3
    assert work.ring_flops - work.ring_f8_flops == 2 * 2 * 128 * 32 * 32
    assert work.ring_f8_flops > 0
