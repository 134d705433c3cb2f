"""The fused attention kernel computes what the primitive chain computes, wherever it fuses."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.model import ir
from soapstone.shard.data.tasks import random_inputs
from soapstone.shard.runtime.fusion import find_attention, find_linear
from soapstone.shard.runtime.sharded_model import ShardedModel

ROOT = Path(__file__).resolve().parents[3]
GPT = dsl.load(ROOT / "tests/specs/gpt_layouts.par")


@pytest.mark.parametrize("layout", ["tp2", "sp2", "cp2", "cp2tp2", "dp2sp2"])
def test_every_attention_fuses_under_every_layout(layout):
    prog = lower(GPT.model(), GPT.parallel(layout))
    fused = find_attention(prog)
    assert len(fused) == len(GPT.model().blocks)
    assert all(f.causal and len(f.covered) == 3 for f in fused.values())


def test_a_chain_whose_probabilities_are_needed_elsewhere_is_left_alone():
    model = GPT.model()
    # make layer 0's attention probabilities a model output: they must exist, so no fusion
    model = attrs.evolve(model, outputs=(*model.outputs,
                                         ir.Output("p", "layer.0.attention0.probs", False)))
    fused = find_attention(lower(model, GPT.parallel("tp2")))
    assert len(fused) == len(model.blocks) - 1
    assert all(not f.out.startswith("layer.0.") for f in fused.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_and_unfused_runs_agree(dtype):
    prog = lower(GPT.model(), None)
    batch = random_inputs(prog, 0)
    runs = []
    for fuse in (True, False):
        m = ShardedModel(prog, None, seed=1, dtype=dtype, fuse=fuse)
        loss = m(batch)["loss"]
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.params.items()}))
    (l1, g1), (l2, g2) = runs
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(l1, l2, rtol=rtol)
    for n in g1:
        scale = float(g2[n].abs().max())
        assert torch.allclose(g1[n], g2[n], rtol=rtol, atol=rtol * scale + 1e-30), n


def test_linear_plus_bias_fuses_where_the_contraction_is_local():
    # one rank: attention's output projection, both MLP linears and the head, per layer
    layers = len(GPT.model().blocks)
    assert len(find_linear(lower(GPT.model(), None))) == 3 * layers + 1
    # tensor parallel: row-parallel outputs are partial and reduced before their bias, so only
    # the column-parallel linears (MLP up projection, head) still fuse
    fused = find_linear(lower(GPT.model(), GPT.parallel("tp2")))
    assert len(fused) == layers + 1
    assert all(f.out.endswith(("mlp0.linear0", "logits")) for f in fused.values())
