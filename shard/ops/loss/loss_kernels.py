"""cross_entropy's kernels, a chunk of tokens at a time: only one chunk's log-probabilities,
exponentials and gradient are ever alive, never a tensor of the logits' size beside them.

Forward runs chunk by chunk and keeps the logits; backward runs the chunks again and writes
each chunk's gradient, computed exactly as torch's own backward would, into the logits' own
storage when the runtime says no one reads them again (`Shards.overwritable`, from
shard/runtime/overwrite_plan.py), else into one buffer of the logits' size. Every per-token
loss and every gradient element is bit-identical to the unchunked forms (the plain form:
F.cross_entropy; the distributed form: the max, log-sum-exp and target logit combined across
ranks, differentiated by autograd): the same torch ops run on each token's row, and the sum
over tokens is taken once, over all of them, in the same order (tests/shard/ops/
test_chunked_loss.py). How many tokens a chunk holds: cross_entropy.chunk_rows.

Folding the gradient into forward (Liger's kernel) keeps the same bytes (a gradient of the
logits' size instead of the logits) but must guess the loss's incoming gradient: computing
it in backward keeps it exact for any scaling of the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from soapstone.shard.ops.record import Reduce


def _spans(n: int, rows: int):
    return ((a, min(n, a + rows)) for a in range(0, n, rows))


def _target(x: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Where backward writes the logits' gradient: their own storage, or a new buffer."""
    return x if in_place else torch.empty_like(x, memory_format=torch.contiguous_format)


class PlainLoss(torch.autograd.Function):
    """The summed token loss of x[N, C'] over its first `classes` classes (the rest padding,
    given gradient 0) against t[N], `rows` tokens at a time; F.cross_entropy(x[:, :classes],
    t, reduction="sum") to the bit, forward and backward."""

    @staticmethod
    def forward(ctx, x, t, classes: int, rows: int, in_place: bool):
        picked = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        for a, b in _spans(x.shape[0], rows):
            lp = torch.log_softmax(x[a:b, :classes].contiguous(), -1)
            picked[a:b] = lp.gather(1, t[a:b, None]).squeeze(1)
            del lp
        ctx.save_for_backward(x, t)
        ctx.classes, ctx.rows, ctx.in_place = classes, rows, in_place
        # nll_loss over the picked log-probabilities: F.cross_entropy's own sum, in its order
        return F.nll_loss(picked[:, None], torch.zeros_like(t), reduction="sum")

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        c = ctx.classes
        out = _target(x, ctx.in_place)
        for a, b in _spans(x.shape[0], ctx.rows):
            lp = torch.log_softmax(x[a:b, :c].contiguous(), -1)
            # what nll_loss's backward hands log_softmax's: -g at each target, 0 elsewhere
            glp = torch.zeros_like(lp)
            glp.scatter_(1, t[a:b, None], (-g).to(lp.dtype).expand(b - a, 1))
            out[a:b, :c] = torch._log_softmax_backward_data(glp, lp, 1, lp.dtype)
            del lp, glp
        if c < x.shape[1]:
            out[:, c:] = 0
        return out, None, None, None, None


class SplitLoss(torch.autograd.Function):
    """The per-token loss over a class dim split across ranks: x[N, n] is this rank's slice
    (classes from `lo`; global classes >= `classes` are padding), `stats` combines the max,
    the sum of exponentials and the target logit across the ranks (the record's dist_stats, in
    order, each in the tokens' shape `lead`); `rows` tokens at a time. Backward needs no
    communication: each rank's logits get exp(x - m) / se and -1 at their targets, as autograd
    gives the unchunked form."""

    @staticmethod
    def forward(ctx, x, t, lo: int, classes: int | None, stats, rows: int, in_place: bool,
                lead: tuple[int, ...]):
        n, tokens = x.shape[1], x.shape[0]
        pad = (torch.arange(lo, lo + n, device=x.device) >= classes) \
            if classes is not None else None
        m = torch.empty(x.shape[0], 1, dtype=x.dtype, device=x.device)
        for a, b in _spans(x.shape[0], rows):
            m[a:b] = _masked(x[a:b], pad).amax(-1, keepdim=True)
        # reduced in the tokens' own shape: the collectives the plan lists (show, verify)
        m = stats.reduce(m.view(*lead, 1), Reduce.MAX).reshape(tokens, 1)
        se = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        for a, b in _spans(x.shape[0], rows):
            se[a:b] = torch.exp(_masked(x[a:b], pad) - m[a:b]).sum(-1)
        se = stats.reduce(se.view(lead), Reduce.SUM).reshape(tokens)
        lse = torch.log(se) + m.squeeze(-1)
        inside = (t >= lo) & (t < lo + n)
        local = torch.where(inside, t - lo, torch.zeros_like(t))
        at = torch.arange(x.shape[0], device=x.device)
        # where, not a product: a rank holding only padded classes picks -inf, and -inf x 0 is nan
        picked = stats.reduce(torch.where(inside, _masked(x, pad, at, local), 0.0).view(lead),
                              Reduce.SUM).reshape(tokens)
        ctx.save_for_backward(x, m, se, local, inside)
        ctx.pad, ctx.rows, ctx.in_place = pad, rows, in_place
        return lse - picked

    @staticmethod
    def backward(ctx, g):
        x, m, se, local, inside = ctx.saved_tensors
        out = _target(x, ctx.in_place)
        gse = g / se  # log's backward
        gpick = -g * inside.to(g.dtype)  # the target logit's, through its mask
        for a, b in _spans(x.shape[0], ctx.rows):
            gx = gse[a:b, None] * torch.exp(_masked(x[a:b], ctx.pad) - m[a:b])
            gx[torch.arange(b - a, device=x.device), local[a:b]] += gpick[a:b]
            if ctx.pad is not None:
                gx.masked_fill_(ctx.pad, 0)
            out[a:b] = gx
            del gx
        return out, None, None, None, None, None, None, None


def _masked(x, pad, rows=None, cols=None):
    """x with its padded classes at -inf (a chunk's copy only), or its elements [rows, cols]."""
    if rows is not None:
        got = x[rows, cols]
        return got if pad is None else got.masked_fill(pad[cols], float("-inf"))
    return x if pad is None else x.masked_fill(pad, float("-inf"))
