"""Sliding-window attention (`attention(..., window = N)`): a query sees only the last N
positions. One rank, fused and unfused, equals a plain-torch model written here; a fused
chain never drops a mask attr it does not honour; `check` refuses a window <= 0. The sharded
layouts (tp2, sp2, cp2) equal one rank under mpiexec: tests/shard/runtime/numerics_cases.py."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.data.tasks import random_inputs
from soapstone.shard.plan.program import Compute
from soapstone.shard.runtime.fusion_plan import find_attention
from soapstone.shard.runtime.sharded_model import ShardedModel

ROOT = Path(__file__).resolve().parents[3]
SPEC = dsl.load(ROOT / "tests/specs/window_layouts.par")
WINDOW = 4


def plain_loss(p: dict[str, torch.Tensor], tokens, targets, window: int) -> torch.Tensor:
    """window_layouts.par's model in plain torch: the window as a band of a square mask."""
    x = F.embedding(tokens, p["embedding0.table"])
    seq = tokens.shape[1]
    full = torch.ones(seq, seq, dtype=torch.bool)
    band = full.tril() & ~full.tril(-window)  # key <= query and query - key < window
    for layer in range(2):
        w = {n.split(".", 2)[2]: t for n, t in p.items() if n.startswith(f"layer.{layer}.")}
        h = F.layer_norm(x, x.shape[-1:], w["layernorm0.gamma"], w["layernorm0.beta"], 1e-5)
        q, k, v = (torch.einsum("bsh,hnd->bnsd", h, w[f"attention0.w{c}"]) for c in "qkv")
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores.masked_fill(~band, float("-inf")), dim=-1)
        x = x + torch.einsum("bnsd,ndh->bsh", probs @ v, w["attention0.wo"]) + \
            w["attention0.bo"]
    h = F.layer_norm(x, x.shape[-1:], p["layernorm0.gamma"], p["layernorm0.beta"], 1e-5)
    logits = h @ p["linear0.weight"] + p["linear0.bias"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("fuse", [True, False])
def test_window_attention_equals_plain_torch(fuse):
    prog = lower(SPEC.model(), None)
    m = ShardedModel(prog, None, seed=3, dtype=torch.float64, fuse=fuse)
    assert bool(m.fused) == fuse
    batch = random_inputs(prog, 0)
    loss = m(batch)["loss"]
    loss.backward()
    ref = {n: t.detach().clone().requires_grad_() for n, t in m.params.items()}
    want = plain_loss(ref, batch["tokens"], batch["targets"], WINDOW)
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-12), (float(loss), float(want))
    for n, t in m.params.items():
        assert torch.allclose(t.grad, ref[n].grad, rtol=1e-10, atol=1e-14), n
    # the window changes the result: the plain causal model differs
    causal = plain_loss(ref, batch["tokens"], batch["targets"], batch["tokens"].shape[1])
    assert not torch.allclose(causal, want, rtol=1e-6)


@pytest.mark.parametrize("layout", ["single", "tp2", "sp2", "cp2"])
def test_window_attention_fuses_with_its_window(layout):
    fused = find_attention(lower(SPEC.model(), SPEC.parallel(layout)))
    assert len(fused) == 2
    assert all(dict(f.mask_attrs)["window"] == WINDOW for f in fused.values())


def test_a_mask_attr_the_fused_kernel_does_not_honour_keeps_the_chain_unfused():
    # the mask slot's honoured attrs are the causal_mask record's: any other attr on the
    # mask (a future option) leaves the chain to the primitives' own kernels
    prog = lower(SPEC.model(), None)
    steps = tuple(attrs.evolve(s, attrs=(*s.attrs, ("sink", 2)))
                  if isinstance(s, Compute) and s.kind == "causal_mask" else s
                  for s in prog.steps)
    assert len(find_attention(prog)) == 2
    assert find_attention(attrs.evolve(prog, steps=steps)) == {}


def test_check_refuses_a_window_that_is_not_positive():
    spec = "tests/bad_specs/attention_window_not_positive.par"
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "check", spec], cwd=ROOT,
                       text=True, capture_output=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"{spec}:6:11: error: attention window = 0 must be a positive" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
