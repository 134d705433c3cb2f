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
                  {"keys": [1024], "vs_matmul": [0.5, 1.0]}):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(load_profile("a100-40gb").to_data() | {"attention": curve}))
        with pytest.raises(ProfileError, match="attention"):
            load_profile(str(path))
