"""attention(..., head_dim = D): each head's width apart from hidden / heads (Qwen3's real
sizes). The params, the model FLOPs and explain's activations follow heads x D, not hidden;
the fused attention chain is found (one rank, tp2, sp2); a head_dim that is the input's or the
heads' dim is a located error. Each layout equals one rank: numerics_cases.py
(case_head_dim_*); explain equals the counters: tests/shard/train/run_cases.py; against
transformers (Qwen3, LLaMA): tests/dsl/interop/test_hf_fields.py and
tests/dsl/interop/hf_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.lang.errors import SpecError
from soapstone.shard.plan.analysis.score import model_flops
from soapstone.shard.runtime.fusion_plan import find_attention

ROOT = Path(__file__).resolve().parents[3]
SPEC = dsl.load(ROOT / "tests/specs/head_dim_layouts.par")
B, S, HID, H, KV, D, FFN, V = 4, 16, 32, 4, 2, 16, 64, 64


def test_params_are_heads_by_head_dim():
    dims = {p.name.split(".")[-1]: p.type.dims for p in SPEC.model().params
            if p.name.startswith("layer.0.attention0.")}
    assert dims["wq"] == ("hidden", "heads", "head_dim")
    assert dims["wk"] == ("hidden", "kv_heads", "head_dim")
    assert dims["wo"] == ("heads", "head_dim", "hidden")
    assert dims["q_norm"] == ("head_dim",)


def test_model_flops_count_heads_by_head_dim():
    attention = 2 * B * S * HID * D * (H + 2 * KV) + 2 * 2 * B * H * S * S * D \
        + 2 * B * S * H * D * HID
    mlp = 3 * 2 * B * S * HID * FFN
    head = 2 * B * S * HID * V
    assert model_flops(lower(SPEC.model(), None)) == 3 * (2 * (attention + mlp) + head)


# (cp2 at these toy sizes moves the probs, as many bytes as v's keys: a collective inside the
# chain, which then runs unfused; numerics_cases.py checks it equals one rank)
@pytest.mark.parametrize("layout", ["single", "tp2", "sp2"])
def test_fused_attention_in_every_layout(layout):
    assert len(find_attention(lower(SPEC.model(), SPEC.parallel(layout)))) == 2


def test_explain_activations_grow_with_head_dim():
    """explain's kept activations follow D: twice the head width keeps more per layer."""
    from soapstone.shard.plan.analysis.explain import estimate

    def kept(d: int) -> int:
        s = dsl.load(ROOT / "tests/specs/head_dim_layouts.par", dims={"head_dim": d})
        return estimate(lower(s.model(), s.parallel("tp2")), optimizer="adamw").activation_bytes

    assert kept(32) > kept(16) > kept(8)


@pytest.mark.parametrize("arg,says", [("head_dim = heads", "head_dim heads is already"),
                                      ("head_dim = hidden", "head_dim hidden is already")])
def test_head_dim_clashing_with_a_dim_is_located(arg, says):
    text = (ROOT / "tests/specs/head_dim_layouts.par").read_text().replace(
        "head_dim = head_dim", arg)
    with pytest.raises(SpecError, match=says) as e:
        dsl.load(text, filename="wide.par")
    assert "wide.par:15:" in str(e.value)
