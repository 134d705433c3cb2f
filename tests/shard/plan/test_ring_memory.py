"""explain's working sets of `overlap tensor`'s rings (shard/plan/analysis/ring_memory.py) and
of float8 gathers (precision.float8_kept, float8_last_cast), each against a hand count from
the dims. Measured steps: tests/shard/parallel/recompute_cases.py
(case_rings_and_float8_gathers_hold_what_explain_says)."""

from __future__ import annotations

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.analysis.precision import (
    float8_kept,
    float8_last_cast,
    program_as_run,
)
from soapstone.shard.plan.analysis.ring_memory import ring_work

DIMS = {"batch": 2, "seq": 256, "hidden": 256, "ffn": 1024, "vocab": 128}  # heads 4, kv 2


def program(spec: str, layout: str, precision: str, dims: dict):
    s = dsl.load(spec, dims=dims)
    par = s.parallel(layout)
    return program_as_run(lower_graph(s.model(par.model), par).program, precision)


def at(p, out: str) -> int:
    return next(i for i, s in enumerate(p.steps) if s.out == out)


def test_ring_working_sets_by_hand():
    """llama sp2async, bf16, t = 2: c = the shard a gather ring sends, b s/t h x 2 bytes."""
    p = program("examples/llama.par", "sp2async", "bf16", DIMS)
    w = ring_work(p)
    c = 2 * 128 * 256 * 2
    # attention's gather ring: q [b, s, 2, 64], k and v [b, s, 1, 64]; wq 256 x 128, wk and
    # wv 256 x 64; the output chunks are copied (batch 2 comes before seq)
    o, ws = 2 * 256 * 256 * 2, 256 * 256 * 2
    g = at(p, "layer.0.rmsnorm0@model:R")
    assert w.forward[g] == 2 * o - c
    assert w.backward[at(p, "layer.0.attention0.v")] == max(
        5 * c + 2 * ws, 4 * c + 2 * 128 * 128 * 2 + 2 * ws, 3 * c + 3 * ws) == 917504
    # the mlp's: two readers of [b, s, 512], weights 256 x 512
    o, ws = 2 * (2 * 256 * 512 * 2), 2 * 256 * 512 * 2
    assert w.forward[at(p, "layer.0.rmsnorm1@model:R")] == 2 * o - c
    assert w.backward[at(p, "layer.0.mlp0.linear1")] == max(
        5 * c + 2 * ws, 4 * c + 2 * 128 * 512 * 2 + 2 * ws, 3 * c + 3 * ws) == 3 * c + 3 * ws
    # the head's: one reader [b, s, 64], w 256 x 64
    o, ws = 2 * 256 * 64 * 2, 256 * 64 * 2
    assert w.forward[at(p, "rmsnorm0@model:R")] == 2 * o - c == 0
    assert w.backward[at(p, "logits")] == 3 * c + o // 2 + 2 * ws
    # the mlp's scatter ring: x = the gate [b, s, 512] (copied in chunks), chunk [b, s/2, 256]
    x, chunk, wb = 2 * 256 * 512 * 2, 2 * 128 * 256 * 2, 512 * 256 * 2
    rs = at(p, "layer.0.mlp0@model:seq")
    assert w.keeps[rs] == ((), x) and w.keeps[at(p, "layer.0.mlp0")] == ((), 0)
    assert w.reads[rs] == ("layer.0.mlp0.gate",)
    assert w.forward[rs] == chunk
    assert w.backward[rs] == max(chunk + 3 * wb, x + wb) == 917504
    # no gradient of a gathered value or of a partial product; readers run at their gather
    assert {"layer.0.rmsnorm0@model:R", "layer.0.mlp0"} <= w.ungraded
    order = list(w.order)
    i = order.index(at(p, "layer.0.rmsnorm1@model:R"))
    assert order[i:i + 4] == [at(p, "layer.0.rmsnorm1@model:R"), at(p, "layer.0.mlp0.linear0"),
                              at(p, "layer.0.mlp0.linear1"), at(p, "layer.0.mlp0.act")]


def test_a_leading_ring_dim_copies_nothing():
    """batch 1: the sequence leads, so chunks are views: the scatter ring keeps x itself and
    a gather ring's output-gradient chunks are not copied."""
    p = program("examples/llama.par", "sp2async", "bf16", DIMS | {"batch": 1})
    w = ring_work(p)
    c, ws = 128 * 256 * 2, 256 * 64 * 2
    assert w.backward[at(p, "logits")] == max(3 * c + 2 * ws, 3 * c + 3 * ws) == 3 * c + 3 * ws
    rs = at(p, "layer.0.mlp0@model:seq")
    assert w.keeps[rs] == (("layer.0.mlp0.gate",), 0)


def test_no_rings_no_work():
    p = program("examples/llama.par", "sp2", "bf16", DIMS)
    w = ring_work(p)
    assert w.order == tuple(range(len(p.steps))) and not w.forward and not w.members


def test_float8_gathers_keep_e4m3_by_hand():
    """llama sp2 float8: each gathered linear input [8, 128, 128] kept at one byte an element;
    the gather's working set the shard's cast (8 bytes an element of [8, 64, 128], two fp32
    copies) less the result it precedes, over the e4m3 shard beside the byte buffer."""
    dims = {"seq": 128, "hidden": 128, "ffn": 512, "vocab": 256}
    p = program("examples/llama.par", "sp2", "float8", dims)
    kept, work = float8_kept(p)
    n, shard = 8 * 128 * 128, 8 * 64 * 128
    assert kept == dict.fromkeys(("layer.0.rmsnorm0@model:R", "layer.0.rmsnorm1@model:R",
                                  "layer.1.rmsnorm0@model:R", "layer.1.rmsnorm1@model:R",
                                  "rmsnorm0@model:R"), n)
    assert set(work.values()) == {max(8 * shard - n, shard + n)} == {393216}
    assert float8_kept(program("examples/llama.par", "sp2", "bf16", dims)) == ({}, {})


def test_a_recompute_ranges_last_float8_cast_by_hand():
    """sp2_rc float8: a block's last float8 matmul that casts its own input is the mlp's
    down projection, its input the gate [8, 128, 512 / 2]: one byte an element."""
    dims = {"seq": 128, "hidden": 128, "ffn": 512, "vocab": 256}
    p = program("tests/specs/sp_residual.par", "sp2_rc", "float8", dims)
    a, b = p.recompute[0]
    assert float8_last_cast(p, list(range(a, b))) == 8 * 128 * 256
    assert float8_last_cast(program("tests/specs/sp_residual.par", "sp2_rc", "bf16", dims),
                            list(range(a, b))) == 0


def test_more_than_two_ranks_hold_the_step_befores_sums_by_hand(tmp_path):
    """t = 4 (heads, ffn and vocab over 4; llama's 2 kv heads whole): the mlp's gather ring
    holds 2c more in backward, its scatter ring one more partial sum in forward."""
    spec = tmp_path / "sp4.par"
    spec.write_text(open("examples/llama.par").read() + """
parallel sp4async for llama on mesh(model = 4) {
  parameter heads, ffn, vocab -> model
  attribute seq -> model
  overlap tensor
}
""")
    p = program(str(spec), "sp4async", "bf16", DIMS)
    w = ring_work(p)
    c, o, ws = 2 * 64 * 256 * 2, 2 * 256 * 256 * 2, 256 * 256 * 2  # readers [b, s, 1024/4]
    assert w.backward[at(p, "layer.0.mlp0.linear1")] == max(
        5 * c + 4 * ws, 4 * c + o // 4 + 4 * ws, 3 * c + 6 * ws) + 2 * c == 1114112
    assert w.forward[at(p, "layer.0.mlp0@model:seq")] == 2 * (2 * 64 * 256 * 2)


def test_float8_rings_by_hand():
    """llama sp2async float8, t = 2: the mlp's gather ring keeps its gathered input whole in
    e4m3 (n = b s h elements, one byte each) and holds, forward, the outputs put together
    beside their chunks and x's e4m3 shard; backward, the second gradient's cast (8 bytes an
    element) beside the first's e5m2 copy and weight cast. Its scatter ring keeps x (bf16)
    and, backward, casts x whole beside the gathered e5m2 gradient and x's gradient pieces."""
    p = program("examples/llama.par", "sp2async", "float8", DIMS)
    w = ring_work(p)
    kept, _ = float8_kept(p)
    e, n = 2 * 128 * 256, 2 * 256 * 256  # the shard, the gathered value (elements)
    g = at(p, "layer.0.rmsnorm1@model:R")
    assert kept[p.steps[g].out] == n
    o, wt = 2 * 256 * 512, 256 * 512  # each reader's output and weight (elements)
    assert w.forward[g] == e + 2 * (2 * 2 * o) + 2 * wt == 2424832
    assert w.backward[at(p, "layer.0.mlp0.linear1")] == o + wt + 8 * o == 2490368
    # the scatter ring: x = [b, s, 512] (ex), y = [b, s, 256] the partial product (elements)
    ex, y, wb = 2 * 256 * 512, 2 * 256 * 256, 512 * 256
    rs = at(p, "layer.0.mlp0@model:seq")
    assert w.keeps[rs] == (("layer.0.mlp0.gate",), 0)
    assert w.forward[rs] == 8 * ex - 2 * y == 1835008
    assert w.backward[rs] == y + y // 2 + wb + 8 * ex == 2424832  # less x's gradient, counted
