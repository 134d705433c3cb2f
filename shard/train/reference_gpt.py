"""A plain-torch GPT (and LLaMA-style variant) equal to examples/gpt.par and swiglu.par.

Written with torch's own building blocks, independently of soapstone: the reference the
single-rank soapstone run is tested against (tests/shard/train/test_reference.py) and the peer model
the benchmarks run under PyTorch's own parallelism (DTensor, DDP, FSDP2). `transformer_map` maps
soapstone parameter names onto it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        b, s, _ = x.shape
        a = self.norm1(x)
        q, k, v = (p(a).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
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


def load_from_soapstone(model: nn.Module, params: dict[str, torch.Tensor], swiglu=False) -> None:
    """Copy full soapstone parameters (name -> tensor) into the plain-torch model."""
    with torch.no_grad():
        for name, (ref, convert) in transformer_map(model, swiglu).items():
            ref.copy_(convert(params[name]))
