"""The single-rank soapstone run equals an independent plain-torch model
(shard/train/reference_gpt.py).

Each reference uses torch's own building blocks (nn.Embedding, nn.LayerNorm, nn.RMSNorm,
nn.Linear, scaled_dot_product_attention, F.cross_entropy), takes soapstone's initial
parameters through a name map, and must give the same loss and gradients (rtol 1e-5, fp32).
The sharded layouts are checked against the single-rank run in test_numerics.py, so together
they tie every layout to plain torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.runtime.sharded_model import ShardedModel
from soapstone.shard.train.reference_gpt import GPT, transformer_map

ROOT = Path(__file__).resolve().parents[3]


def compare(spec_path: str, reference: nn.Module, mapping: dict, inputs: dict) -> None:
    # at use time: other tests unregister the custom layer when they finish with it
    dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))
    spec = dsl.load(ROOT / spec_path)
    ours = ShardedModel(lower(spec.model(), None), None, seed=11,
                        custom={"swiglu": dsl.custom.get("swiglu").fn})
    assert set(mapping) == set(ours.params), set(mapping) ^ set(ours.params)
    with torch.no_grad():
        for name, (ref, convert) in mapping.items():
            ref.copy_(convert(ours.params[name].detach()))
    loss = ours(inputs)["loss"]
    loss.backward()
    want = reference(*inputs.values())
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-5), (float(loss), float(want))
    for name, (ref, convert) in mapping.items():
        got = convert(ours.params[name].grad)
        scale = float(ref.grad.abs().max())
        assert torch.allclose(got, ref.grad, rtol=1e-5, atol=1e-5 * scale + 1e-12), name


def tokens(batch, seq, vocab):
    g = torch.Generator().manual_seed(3)
    return {"tokens": torch.randint(0, vocab, (batch, seq), generator=g),
            "targets": torch.randint(0, vocab, (batch, seq), generator=g)}


@pytest.mark.parametrize("swiglu", [False, True], ids=["gpt", "llama-custom-swiglu"])
def test_transformer_matches_plain_torch(swiglu):
    ref = GPT(vocab=64, hidden=32, heads=4, ffn=64, layers=2 if swiglu else 4, swiglu=swiglu)
    path = "examples/swiglu.par" if swiglu else "examples/gpt.par"
    compare(path, ref, transformer_map(ref, swiglu), tokens(8, 16, 64))


def test_mlp_matches_plain_torch():
    up, down = nn.Linear(32, 64), nn.Linear(64, 8)
    ref = lambda x, y: F.cross_entropy(down(F.relu(up(x))), y)  # noqa: E731
    flat_t = lambda w: w.T  # noqa: E731
    mapping = {"linear0.weight": (up.weight, flat_t), "linear0.bias": (up.bias, lambda w: w),
               "linear1.weight": (down.weight, flat_t), "linear1.bias": (down.bias, lambda w: w)}
    g = torch.Generator().manual_seed(4)
    inputs = {"x": torch.randn(8, 32, generator=g),
              "labels": torch.randint(0, 8, (8,), generator=g)}
    compare("examples/mlp.par", ref, mapping, inputs)


def test_attention_scale_is_one_over_sqrt_head_dim():
    spec = dsl.load(ROOT / "examples/gpt.par")
    scores = next(op for op in spec.model().ops if op.out.endswith("attention0.scores"))
    assert math.isclose(scores.attr("scale"), 1 / math.sqrt(8), rel_tol=1e-6)
