"""The `moe` layer on one rank equals a plain-torch mixture of experts written here: output
loss, gradients (the balance loss included), the balance loss and the dropped choices; the
router's conventions too (kept weights renormalised, no capacity, a sigmoid-gated shared
expert: Mixtral's and Qwen-MoE's)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.lang.errors import SpecError
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.runtime.sharded_model import ShardedModel

SPEC = """
model m {{
  dim batch = 4, seq = 6, hidden = 8, experts = {experts}, ffn = 16, classes = 5, wide = 20
  input x : f32[batch, seq, hidden]
  input y : i64[batch, seq]
  h = moe(x, experts, ffn, top_k = {top_k}, capacity = {capacity}, aux = 0.1{extra})
  output loss = cross_entropy(linear(h, hidden -> classes), y)
}}
"""


ACC2 = """
parallel acc2 for m on mesh(data = 1) {
  schedule gpipe, microbatches = 2
}
"""


def ffn(t, w1, w2, w3):
    """One FFN on tokens t: gelu MLP, or SwiGLU (silu(t w1) * (t w3)) w2 where w3 is given."""
    if w3 is None:
        return F.gelu(t @ w1) @ w2
    return (F.silu(t @ w1) * (t @ w3)) @ w2


def reference(x, y, router, w1, w2, wo, bo, top_k, capacity, w3=None, shared=None,
              normalize=False, shared_gate=None):
    """A mixture of experts with a Switch balance loss and GShard-style slot order; w3: SwiGLU
    experts; shared: (s1, s2, s3) of a dense expert every token goes through, scaled by
    sigmoid(t . shared_gate) where given; normalize: the top_k weights over their sum;
    capacity 0: no slot limit."""
    t = x.reshape(-1, x.shape[-1])
    n, e = t.shape[0], router.shape[1]
    probs = torch.softmax(t @ router, dim=-1)
    gate, pick = torch.topk(probs, top_k, dim=-1)
    if normalize:
        gate = gate / gate.sum(-1, keepdim=True)
    slots = math.ceil(capacity * n * top_k / e) if capacity else n
    used = [0] * e
    out = torch.zeros_like(t)
    dropped = 0
    for k in range(top_k):  # every token's first choice takes a slot before any second one
        for i in range(n):
            j = int(pick[i, k])
            if used[j] >= slots:
                dropped += 1
                continue
            used[j] += 1
            out[i] = out[i] + gate[i, k] * ffn(t[i], w1[j], w2[j],
                                               None if w3 is None else w3[j])
    if shared is not None:
        dense = ffn(t, *shared)
        out = out + (dense if shared_gate is None else torch.sigmoid(t @ shared_gate)[:, None]
                     * dense)
    share = torch.zeros(e)
    for j in pick.reshape(-1).tolist():
        share[j] += 1 / pick.numel()
    aux = 0.1 * e * (share * probs.mean(0)).sum()
    logits = out.reshape(*x.shape[:-1], -1) @ wo + bo
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), aux, dropped


@pytest.mark.parametrize("experts,top_k,capacity,extra", [
    (4, 1, 4.0, ""), (4, 2, 0.55, ""), (3, 2, 1.0, ""),
    (4, 2, 0.55, ", activation = swiglu"), (4, 2, 4.0, ", activation = swiglu, shared = ffn"),
    (4, 1, 0.55, ", shared = 12"), (4, 2, 0.55, ", activation = swiglu, shared = wide"),
    (4, 2, 0.0, ", activation = swiglu, normalize = true"),
    (3, 2, 0.0, ", activation = swiglu, shared = wide, shared_gate = true")],
    ids=["no-drops", "drops-top2", "top2-e3", "swiglu-drops", "swiglu-shared",
         "gelu-shared12", "swiglu-shared-dim", "dropless-normalized", "qwen2-shared-gate"])
def test_moe_matches_plain_torch(experts, top_k, capacity, extra):
    spec = dsl.load(SPEC.format(experts=experts, top_k=top_k, capacity=capacity, extra=extra))
    ours = ShardedModel(lower(spec.model(), None), None, seed=5)
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(4, 6, 8, generator=g),
              "y": torch.randint(0, 5, (4, 6), generator=g)}
    loss = ours(inputs)["loss"]
    loss.backward()
    p = {k: v.detach().clone().requires_grad_() for k, v in ours.params.items()}
    names = sorted(p)
    moe = {n.split(".", 1)[1]: p[n] for n in names if n.startswith("moe0.")}
    lin = {n.rsplit(".", 1)[1]: p[n] for n in names if n.startswith("linear")}
    swiglu, has_shared = "swiglu" in extra, "shared" in extra
    gated = "shared_gate" in extra
    want = {"router", "w1", "w2"} | ({"w3"} if swiglu else set()) | \
        ({"shared_gate"} if gated else set())
    if has_shared:  # mlp's linears: w1, the gate's up projection (swiglu), w2
        want |= {f"mlp0.linear{i}.weight" for i in range(3 if swiglu else 2)}
    assert set(moe) == want and set(lin) == {"weight", "bias"}, names
    shared = None
    if has_shared:
        s1, s2 = moe["mlp0.linear0.weight"], moe[f"mlp0.linear{2 if swiglu else 1}.weight"]
        shared = (s1, s2, moe["mlp0.linear1.weight"] if swiglu else None)
    ce, aux, dropped = reference(inputs["x"], inputs["y"], moe["router"], moe["w1"], moe["w2"],
                                 lin["weight"], lin["bias"], top_k, capacity,
                                 w3=moe.get("w3"), shared=shared,
                                 normalize="normalize" in extra,
                                 shared_gate=moe.get("shared_gate"))
    (ce + aux).backward()
    stats = next(iter(ours.ctx.moe.values()))
    assert torch.allclose(loss, ce, rtol=1e-5), (float(loss), float(ce))
    assert math.isclose(stats["aux"], aux.item(), rel_tol=1e-5), (stats, aux.item())
    assert stats["dropped"] == dropped, (stats, dropped)
    assert (dropped > 0) == (0 < capacity < 1.5)  # the cases cover both drops and none
    if has_shared:  # the shared expert's width is the dim it names (or a literal's)
        width = {"ffn": 16, "12": 12, "wide": 20}[extra.split("shared = ")[1].split(",")[0]]
        assert shared[0].shape == (8, width), shared[0].shape
    for n in names:
        got, want = ours.params[n].grad, p[n].grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), n


@pytest.mark.parametrize("top_k,capacity,extra,needle", [
    (5, 1.0, "", "top_k = 5 must be between 1"),
    (1, -1.0, "", "capacity = -1.0 must not be negative"),
    (1, 1.0, ", shared_gate = true", "moe's shared_gate gates a shared expert, and this moe "
     "has none"),
    (1, 1.0, ", activation = swiglue", "must be one of gelu, relu, silu, swiglu, not 'swiglue'"),
    (1, 1.0, ", shared = 1.5", "argument 'shared' must name a dim"),
    (1, 1.0, ", shared = width", "unknown dim 'width'"),
    (1, 1.0, ", shared = hidden", "moe's shared dim hidden is already a dim of the input"),
    (1, 1.0, ", shared = experts", "moe's shared expert width is the experts dim experts")],
    ids=["top_k", "capacity", "gate-no-shared", "swiglu-typo", "shared-float", "shared-unknown",
         "shared-hidden", "shared-experts"])
def test_moe_bad_arguments_are_located(top_k, capacity, extra, needle):
    with pytest.raises(SpecError) as err:
        dsl.load(SPEC.format(experts=4, top_k=top_k, capacity=capacity, extra=extra))
    assert needle in str(err.value) and ":6:" in str(err.value), str(err.value)


@pytest.mark.parametrize("scale", [1, 2], ids=["microbatches", "and-accumulate"])
def test_moe_microbatches_count_their_own_tokens(scale):
    """Gradient accumulation over 2 microbatches (as a pipeline runs them) routes each apart:
    its capacity and balance loss count that microbatch's tokens, and the balance loss's
    gradient is scaled like the training loss's (1 / microbatches, and 1 / batches under
    run --accumulate). The plain-torch reference runs the halves of the batch one by one."""
    spec = dsl.load(SPEC.format(experts=4, top_k=2, capacity=0.55, extra=", activation = swiglu")
                    + ACC2)
    ex = Executor(lower_graph(spec.model(), spec.parallel("acc2")), None, seed=5)
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(4, 6, 8, generator=g),
              "y": torch.randint(0, 5, (4, 6), generator=g)}
    loss = ex.forward_backward(inputs, scale=scale)
    ours = ex.models[0]
    p = {k: v.detach().clone().requires_grad_() for k, v in ours.params.items()}
    moe = {n.split(".", 1)[1]: p[n] for n in p if n.startswith("moe0.")}
    lin = {n.rsplit(".", 1)[1]: p[n] for n in p if n.startswith("linear")}
    want_loss, dropped = 0.0, 0
    for half in (slice(0, 2), slice(2, 4)):
        ce, aux, drops = reference(inputs["x"][half], inputs["y"][half], moe["router"],
                                   moe["w1"], moe["w2"], lin["weight"], lin["bias"], 2, 0.55,
                                   w3=moe["w3"])
        ((ce + aux) / (2 * scale)).backward()
        want_loss += float(ce.detach()) / 2
        dropped += drops
    assert math.isclose(loss, want_loss, rel_tol=1e-5), (loss, want_loss)
    assert dropped > 0
    for n in sorted(p):
        got, want = ours.params[n].grad, p[n].grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), n
