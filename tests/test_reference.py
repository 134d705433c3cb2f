"""The single-rank soapstone run equals an independent plain-torch model written here.

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
from soapstone.dsl.lower import lower
from soapstone.shard.runtime import ShardedModel

ROOT = Path(__file__).resolve().parents[1]
dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))


class Block(nn.Module):
    """One pre-norm transformer block; `swiglu` picks LLaMA's feed-forward and RMSNorm."""

    def __init__(self, hidden, heads, ffn, swiglu):
        super().__init__()
        norm = (lambda: nn.RMSNorm(hidden, eps=1e-6)) if swiglu else (lambda: nn.LayerNorm(hidden))
        self.heads, self.swiglu = heads, swiglu
        self.norm1, self.norm2 = norm(), norm()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        if swiglu:
            self.w1, self.w3 = (nn.Linear(hidden, ffn, bias=False) for _ in range(2))
            self.w2 = nn.Linear(ffn, hidden, bias=False)
        else:
            self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        b, s, h = x.shape
        a = self.norm1(x)
        q, k, v = (p(a).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        m = self.norm2(x)
        if self.swiglu:
            return x + self.w2(F.silu(self.w1(m)) * self.w3(m))
        return x + self.down(F.gelu(self.up(m)))


class GPT(nn.Module):
    def __init__(self, vocab, hidden, heads, ffn, layers, swiglu=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, swiglu) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6) if swiglu else nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=not swiglu)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def transformer_map(model: GPT, swiglu: bool) -> dict[str, tuple[torch.Tensor, callable]]:
    """soapstone name -> (reference tensor, soapstone layout -> reference layout)."""
    norm = "rmsnorm" if swiglu else "layernorm"
    flat_t = lambda w: w.reshape(w.shape[0], -1).T  # noqa: E731  [in, ...] -> Linear [out, in]
    last_t = lambda w: w.reshape(-1, w.shape[-1]).T  # noqa: E731  [..., out] -> Linear [out, in]
    same = lambda w: w  # noqa: E731
    m = {"embedding0.table": (model.emb.weight, same), f"{norm}0.gamma": (model.norm.weight, same),
         "linear0.weight": (model.head.weight, flat_t)}
    if not swiglu:
        m["layernorm0.beta"] = (model.norm.bias, same)
        m["linear0.bias"] = (model.head.bias, same)
    for i, blk in enumerate(model.blocks):
        p = f"layer.{i}."
        m[p + f"{norm}0.gamma"] = (blk.norm1.weight, same)
        m[p + f"{norm}1.gamma"] = (blk.norm2.weight, same)
        if not swiglu:
            m[p + "layernorm0.beta"] = (blk.norm1.bias, same)
            m[p + "layernorm1.beta"] = (blk.norm2.bias, same)
            m[p + "mlp0.linear0.weight"] = (blk.up.weight, flat_t)
            m[p + "mlp0.linear0.bias"] = (blk.up.bias, same)
            m[p + "mlp0.linear1.weight"] = (blk.down.weight, flat_t)
            m[p + "mlp0.linear1.bias"] = (blk.down.bias, same)
        else:
            m[p + "swiglu0.w1"] = (blk.w1.weight, flat_t)
            m[p + "swiglu0.w3"] = (blk.w3.weight, flat_t)
            m[p + "swiglu0.w2"] = (blk.w2.weight, flat_t)
        for name, lin in (("wq", blk.q), ("wk", blk.k), ("wv", blk.v)):
            m[p + f"attention0.{name}"] = (lin.weight, flat_t)
        m[p + "attention0.wo"] = (blk.o.weight, last_t)
        m[p + "attention0.bo"] = (blk.o.bias, same)
    return m


def compare(spec_path: str, reference: nn.Module, mapping: dict, inputs: dict) -> None:
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
