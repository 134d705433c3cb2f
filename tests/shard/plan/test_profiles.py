"""Hardware profiles (shard/plan/analysis/hardware.py): the presets, profile files and their
errors."""

from __future__ import annotations

import json

import pytest

from soapstone.comm.errors import UserError
from soapstone.shard.plan.analysis.hardware import (
    ProfileError,
    load_profile,
    presets,
    save_profile,
)


def test_presets_cover_the_issue_and_read_in_si_units():
    known = presets()
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu-2core"):
        assert name in known
    a100 = known["a100-40gb"]
    assert a100.memory_bytes == 40 * 2**30 and a100.devices_per_node == 8
    assert a100.peak_flops["bf16"] == pytest.approx(312e12)
    assert a100.intra_node.bandwidth > a100.inter_node.bandwidth
    assert a100.inter_node.time(2, 20e9) == pytest.approx(2 * 10e-6 + 1.0)


def test_a_profile_file_round_trips(tmp_path):
    path = tmp_path / "mine.json"
    save_profile(load_profile("h100-80gb"), str(path))
    again = load_profile(str(path))
    assert again.peak_flops == pytest.approx(load_profile("h100-80gb").peak_flops)
    assert again.memory_bytes == load_profile("h100-80gb").memory_bytes
    assert again.attention == load_profile("h100-80gb").attention != ()
    assert again.memory_bound_rate == load_profile("h100-80gb").memory_bound_rate == 1089e9
    assert again.ring_overlap == load_profile("h100-80gb").ring_overlap == 0.19
    assert "ring_overlap" not in load_profile("a100-40gb").to_data()  # the ideal, 1


@pytest.mark.parametrize("drop, field", [
    (("memory_gib",), "memory_gib"),
    (("inter_node", "latency_us"), "inter_node.latency_us"),
    (("peak_tflops",), "peak_tflops"),
])
def test_a_missing_field_names_the_file_and_the_field(tmp_path, drop, field):
    data = load_profile("a100-40gb").to_data()
    node = data
    for key in drop[:-1]:
        node = node[key]
    del node[drop[-1]]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    assert isinstance(e.value, UserError)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)


def test_bad_values_and_unknown_names_are_user_errors(tmp_path):
    data = load_profile("a100-40gb").to_data() | {"usable_fraction": 1.5}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="usable_fraction"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="unknown profile 'a100-41gb'.*a100-40gb"):
        load_profile("a100-41gb")
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(path))
    for bad in ({"gbs": 0}, {"source": "x"}, 1089):
        path.write_text(json.dumps(load_profile("a100-40gb").to_data() | {"memory_bound": bad}))
        with pytest.raises(ProfileError, match="memory_bound"):
            load_profile(str(path))
    for bad in ({"fraction": 1.5}, {"fraction": -0.1}, {"fraction": True}, {"source": "x"}, 0.5):
        path.write_text(json.dumps(load_profile("a100-40gb").to_data() | {"ring_overlap": bad}))
        with pytest.raises(ProfileError, match="ring_overlap.*from 0 to 1"):
            load_profile(str(path))


def test_attentions_rate_is_a_curve_by_keys_attended(tmp_path):
    """A curve (1024: 0.5, 4096: 1.0) is linear in log2(keys): 2048 keys lie halfway, 0.75;
    flat beyond its ends; no curve is the weight matmuls' rate (1). A curve whose keys do not
    ascend, or whose lists differ in length, is bad input naming the field."""
    import attrs

    prof = attrs.evolve(load_profile("a100-40gb"), attention=((1024, 0.5), (4096, 1.0)))
    assert [prof.attention_ratio(k) for k in (512, 1024, 2048, 4096, 65536)] == \
        pytest.approx([0.5, 0.5, 0.75, 1.0, 1.0])
    assert prof.attention_flops("bf16", 2048) == pytest.approx(0.75 * prof.matmul_flops("bf16"))
    assert load_profile("a100-40gb").attention_ratio(2048) == 1.0
    for curve in ({"keys": [4096, 1024], "vs_matmul": [1.0, 0.5]},
                  {"keys": [1024], "vs_matmul": [0.5, 1.0]},
                  {"keys": [1024], "vs_matmul": [1.6]}):  # past the peak at 0.64 efficiency
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(load_profile("a100-40gb").to_data() | {"attention": curve}))
        with pytest.raises(ProfileError, match="attention"):
            load_profile(str(path))


def test_the_h100_constants_are_the_measured_reports():
    """h100-80gb's matmul_efficiency is the FLOP-weighted harmonic mean of a Llama-3 8B
    block's linears (wq and wo 4096 -> 4096, wk and wv 4096 -> 1024, w1 and w3 4096 -> 14336,
    w2 14336 -> 4096) over forward, input and weight gradient as measured on the H100 SXM;
    its attention curve is the measured causal SDPA rate at each sequence, counted in the
    cost model's 128-tile squares, over that efficiency; its memory bandwidth the measured
    copy; h100-96gb carries the same curve."""
    from pathlib import Path

    from soapstone.shard.plan.analysis.cost import causal_work

    gpu = Path(__file__).resolve().parents[3] / "bench/data/gpu"
    linear = {tuple(r["shape"]): r for r in
              json.loads((gpu / "h100_linear_rates.json").read_text())["rows"]}
    block = {(8192, 4096, 4096): 2 * 4096 * 4096, (8192, 4096, 1024): 2 * 4096 * 1024,
             (8192, 4096, 14336): 2 * 4096 * 14336, (8192, 14336, 4096): 14336 * 4096}
    passes = ("fwd", "dgrad", "wgrad")
    seconds = sum(n / linear[s][p] for s, n in block.items() for p in passes)
    h100 = load_profile("h100-80gb")
    assert h100.matmul_efficiency == round(3 * sum(block.values()) / seconds, 3) == 0.731
    rates = json.loads((gpu / "h100_rates.json").read_text())["rows"]
    sdpa = [r for r in rates if r["kind"] == "attention causal"]
    assert h100.attention == tuple(
        (r["seq"], round(r["of_peak"] * causal_work(r["seq"], r["seq"]) / 0.5 / 0.731, 3))
        for r in sdpa)
    copy = next(r for r in rates if r["kind"] == "hbm copy")
    assert h100.memory_bandwidth == round(copy["gbs"]) * 1e9
    assert load_profile("h100-96gb").attention == h100.attention
    assert load_profile("a100-80gb").attention == ()


def test_the_h100_memory_bound_rate_is_the_measured_llama_mix():
    """h100-80gb's memory_bound rate: examples/llama.par at Llama-3 8B's widths, 4 x 8192
    tokens in bf16, its memory-bound steps' bytes as the cost model counts them (3 x forward's,
    program_work's other_bytes) over the sum of each step's measured forward + backward time
    (bench/data/gpu/h100_memory_bound.json, its 32768-token row of that op: rope by the heads
    it rotates). Only that profile carries one; the rest price those bytes at the bandwidth."""
    from pathlib import Path

    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.ops.record import Bound
    from soapstone.shard.ops.registry import record_of
    from soapstone.shard.plan.analysis.cost import program_work
    from soapstone.shard.plan.analysis.precision import graph_as_run
    from soapstone.shard.plan.program import Compute
    from soapstone.shard.runtime.fusion_plan import find_fusions

    root = Path(__file__).resolve().parents[3]
    report = json.loads((root / "bench/data/gpu/h100_memory_bound.json").read_text())
    ms = {r["kind"]: r["forward_backward_ms"] for r in report["rows"]
          if r.get("tokens") == 32768}
    spec = dsl.load(str(root / "examples/llama.par"),
                    {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                     "batch": 4, "seq": 8192})
    par = spec.parallel("single")
    program = graph_as_run(lower_graph(spec.model(par.model), par), "bf16").stages[0].program
    fused = {i for at, f in find_fusions(program).items() for i in (*f.covered, at)}
    kinds = [s.kind if s.kind != "rope" else
             ("rope q" if "heads" in program.value(s.args[0]).dims else "rope k")
             for i, s in enumerate(program.steps) if isinstance(s, Compute) and i not in fused
             and record_of(s.kind).bound not in (Bound.VIEW, Bound.MATMUL)]
    assert sorted(set(kinds)) == sorted(ms)  # every memory-bound op measured
    seconds = sum(ms[k] for k in kinds) / 1e3
    rate = 3 * program_work(program).other_bytes / seconds
    assert load_profile("h100-80gb").memory_bound_rate == round(rate / 1e9) * 1e9 == 1089e9
    for name in ("h100-96gb", "a100-80gb", "h200"):
        p = load_profile(name)
        assert p.memory_bound_rate == p.memory_bandwidth
