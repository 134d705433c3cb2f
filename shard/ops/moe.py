"""moe: the mixture-of-experts primitive: route, cap, run each expert, combine.

Where the batch is split (`step.dist`), each rank routes its own tokens, with slots and the
balance loss counted over the whole batch (shard/parallel/moe_dispatch.py). Split experts run only
this rank's experts: on the tokens it holds (the output is a partial sum over the experts'
axis), or, where tokens and experts share the axis (`step.exchange`), on the tokens that the
all-to-all brings from every rank.
"""

from __future__ import annotations

import functools

from soapstone.shard.ops.record import OpRecord, Role
from soapstone.shard.parallel.dispatch_plan import kernel_calls
from soapstone.shard.parallel.dispatch_plan import saved_bytes as moe_saved_bytes


def moe_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Split token dims are routed where they are: the op combines the ranks' per-expert
    counts of each run of tokens, so slots fall as on one rank (STAT); split experts give
    partial outputs (unless `exchange` applies), and so does each expert's ffn split as
    Megatron's column/row pair (w1, w3 by column, w2 by row): both SUM."""
    lead = arg_dim_lists[0][:-1]
    return {**dict.fromkeys(lead, Role.STAT), op.attr("experts"): Role.SUM,
            op.attr("ffn"): Role.SUM}


def moe_exchange(op, arg_dim_lists) -> tuple[tuple[str, str], ...]:
    """Tokens split along any token dim go to the ranks holding their experts (all-to-all)
    where the experts split over the same axis."""
    return tuple((d, str(op.attr("experts"))) for d in arg_dim_lists[0][:-1])


@functools.cache
def add_aux():
    """The autograd function that passes y through and, in backward, gives the balance loss
    the gradient the training loss gets (`scale`: 1 / microbatches), so it is added to the
    training loss's gradient without changing what the model returns (made on first use:
    this module imports no torch)."""
    import torch

    class AddAux(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, aux, scale):
            ctx.scale = scale
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            return grad, torch.full((), ctx.scale, dtype=grad.dtype, device=grad.device), None

    return AddAux


def activation(name: str):
    """An expert's activation by its choice name (swiglu gates a silu)."""
    import torch.nn.functional as F

    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu}[name]


def expert_ffn(x, w1, w2, act, w3=None):
    """One expert's FFN on its tokens x[n, h]: act(x @ w1) @ w2, or with a gate w3 (SwiGLU,
    as Mixtral and LLaMA) act(x @ w1) * (x @ w3) @ w2."""
    y = act(x @ w1)
    if w3 is not None:
        y = y * (x @ w3)
    return y @ w2


def moe(step, args, ctx):
    """y[..., h] = sum over kept choices of gate * expert(x); records aux and drops in
    ctx.moe[step.out]."""
    import torch

    from soapstone.shard.ops.kernels import align
    from soapstone.shard.parallel.moe_dispatch import (
        balance_term,
        exchange,
        exchange_group,
        route,
        token_split,
    )

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
    split, coords = token_split(ctx, xv, lead, step.dist) if step.dist else (None, [])
    comm = ctx.mesh.comm(*step.dist) if step.dist else None
    r = route(tokens, router, int(step.attr("top_k")), float(step.attr("capacity")), split,
              comm, normalize=bool(step.attr("normalize", False)))
    act = activation(str(step.attr("activation")))
    first = ctx.offset(ctx.arg(step, 2), e)  # this rank's experts, where they are split

    def expert(rows: torch.Tensor, j: int) -> torch.Tensor:
        """This rank's expert j on its rows."""
        return expert_ffn(rows, w1[j], w2[j], act, None if w3 is None else w3[j])

    send: list[int] = []
    recv: list[int] = []
    if step.exchange:
        axis = step.exchange[0]
        y, send, recv = exchange(tokens, r, exchange_group(ctx, coords, axis),
                                 ctx.mesh.coord(axis), ctx.comm(axis), w1.shape[0], expert)
    else:
        y = torch.zeros_like(tokens)
        for j in range(w1.shape[0]):
            tok, choice = ((r.experts == first + j) & r.kept).nonzero(as_tuple=True)
            if tok.numel():
                out = expert(tokens[tok], j)
                y = y.index_add(0, tok, out * r.gates[tok, choice].unsqueeze(-1).to(out.dtype))
    # a partial sum over an experts axis the tokens are not split on: one rank of it adds
    # the balance term; where the batch is split each rank adds its own tokens' term
    split = ctx.arg(step, 2).layout.split_axis(e)
    once = split is None or split in step.exchange or ctx.mesh.coord(split) == 0
    # each expert's ffn split over an axis (tensor parallel inside an expert) is a partial
    # sum over it too
    ffn_split = ctx.arg(step, 2).layout.split_axis(f)
    once = once and (ffn_split is None or ctx.mesh.coord(ffn_split) == 0)
    aux = float(step.attr("aux")) * balance_term(r) * (1.0 if once else 0.0)
    stats = ctx.__dict__.setdefault("moe", {})
    choices = r.tokens * r.experts.shape[1]
    # aux: this rank's term (the whole loss when the batch is not split); drops: the batch's;
    # sizes: rows the dispatch sends to and gets from each rank (the combine sends them
    # back); sent, returned: those that leave this rank
    me = ctx.mesh.coord(step.exchange[0]) if step.exchange else 0
    stats[step.out] = {"aux": float(aux.detach()),
                       "dropped": choices - int(r.kept_per_rank().sum()), "choices": choices,
                       "sizes": (send, recv), "sent": sum(send[:me] + send[me + 1:]),
                       "returned": sum(recv[:me] + recv[me + 1:])}
    if torch.is_grad_enabled() and aux.requires_grad:
        y = add_aux().apply(y, aux, ctx.loss_scale)
    y = y.reshape(shape)
    order = [(*lead, h).index(d) for d in xv.dims]
    return y.permute(order) if order != list(range(len(order))) else y


def moe_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Its input (the router's matmul) and what its experts keep."""
    return floats[:1], moe_saved_bytes(step, program)


def moe_keeps(step) -> tuple[str, ...]:
    """Its weights, in the order backward meets them: the experts' matmuls first, the router
    last."""
    return tuple(reversed(step.args[1:]))


RECORDS = (
    OpRecord(
        "moe",
        "args (x[..., h], router[h, E], w1[E, h, f], w2[E, f, h], w3[E, h, f] with "
        "activation=swiglu) -> [..., h]: top_k softmax routing with a capacity (0: none); attrs: "
        "hidden, experts, ffn, top_k, capacity, aux, activation, normalize (the kept weights "
        "rescaled to sum 1) (dsl/layers/moe.py, shard/ops/moe.py)",
        kernel=moe, roles=moe_roles, exchange=moe_exchange, saves=moe_saves, keeps=moe_keeps,
        calls=kernel_calls,
    ),
)
