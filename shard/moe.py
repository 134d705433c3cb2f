"""The local kernel of the `moe` primitive: route, cap, run each expert, combine.

Every token is routed on every rank (the rule keeps token dims whole: the capacity and the
balance loss count the whole batch); a split experts dim runs only this rank's experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from soapstone.shard.ops import align, op

_ACT = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu}


class _AddAux(torch.autograd.Function):
    """Pass y through; in backward give the balance loss a gradient of one, so it is added
    to the training loss's gradient without changing what the model returns."""

    @staticmethod
    def forward(ctx, y, aux):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, capacity: float):
    """Routing of tokens x[T, h]: (probs[T, E], experts[T, k], gates[T, k], kept[T, k] bool).

    Choices take expert slots rank by rank (every token's first choice, then the seconds),
    in token order within a rank; past ceil(capacity * T * k / E) slots an expert drops them."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    n_tok, n_exp = probs.shape
    slots = math.ceil(capacity * n_tok * top_k / n_exp)
    onehot = F.one_hot(experts.t().reshape(-1), n_exp)  # [k*T, E], choice-major order
    position = (onehot.cumsum(0) - 1)[torch.arange(onehot.shape[0]), experts.t().reshape(-1)]
    kept = (position < slots).reshape(top_k, n_tok).t()
    return probs, experts, gates, kept


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act,
               w3: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's FFN on its tokens x[n, h]: act(x @ w1) @ w2, or with a gate w3 (SwiGLU,
    as Mixtral and LLaMA) act(x @ w1) * (x @ w3) @ w2."""
    y = act(x @ w1)
    if w3 is not None:
        y = y * (x @ w3)
    return y @ w2


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch's load-balancing loss: E * sum_e(share of choices to e * mean prob of e)."""
    n_exp = probs.shape[-1]
    share = F.one_hot(experts.reshape(-1), n_exp).float().mean(0)
    return n_exp * (share * probs.mean(0)).sum()


@op("moe")
def moe(step, args, ctx):
    """y[..., h] = sum over kept choices of gate * expert(x); records aux and drops in
    ctx.moe[step.out]."""
    x, router, w1, w2 = args[:4]
    xv = ctx.arg(step, 0)
    h, e, f = step.attr("hidden"), step.attr("experts"), step.attr("ffn")
    router = align(router, ctx.arg(step, 1).dims, (h, step.attr("scores")))
    w1 = align(w1, ctx.arg(step, 2).dims, (e, h, f))
    w2 = align(w2, ctx.arg(step, 3).dims, (e, f, h))
    w3 = align(args[4], ctx.arg(step, 4).dims, (e, h, f)) if len(args) > 4 else None
    lead = tuple(d for d in xv.dims if d != h)
    xt = align(x, xv.dims, (*lead, h))
    shape = xt.shape
    tokens = xt.reshape(-1, shape[-1])
    probs, experts, gates, kept = route(tokens, router, int(step.attr("top_k")),
                                        float(step.attr("capacity")))
    act = _ACT[str(step.attr("activation"))]
    y = torch.zeros_like(tokens)
    first = ctx.offset(ctx.arg(step, 2), e)  # this rank's experts, where they are split
    for j in range(w1.shape[0]):
        tok, choice = ((experts == first + j) & kept).nonzero(as_tuple=True)
        if tok.numel():
            out = expert_ffn(tokens[tok], w1[j], w2[j], act, None if w3 is None else w3[j])
            y = y.index_add(0, tok, out * gates[tok, choice].unsqueeze(-1).to(out.dtype))
    # the output is a partial sum over a split experts dim: one rank of it adds the aux term
    split = ctx.arg(step, 2).layout.split_axis(e)
    once = split is None or ctx.mesh.coord(split) == 0
    aux = float(step.attr("aux")) * balance_loss(probs, experts) * (1.0 if once else 0.0)
    stats = ctx.__dict__.setdefault("moe", {})
    stats[step.out] = {"aux": float(aux.detach()), "dropped": int((~kept).sum()),
                       "choices": kept.numel()}
    if torch.is_grad_enabled() and aux.requires_grad:
        y = _AddAux.apply(y, aux)
    y = y.reshape(shape)
    order = [(*lead, h).index(d) for d in xv.dims]
    return y.permute(order) if order != list(range(len(order))) else y
