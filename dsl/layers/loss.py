"""Losses: mean cross entropy of logits against integer targets."""

from __future__ import annotations

from soapstone.dsl.layers.registry import Arg, builtin, dims_text, last_dim, need_float
from soapstone.shard.plan.dtypes import INTS


@builtin("cross_entropy", Arg("logits", "tensor"), Arg("targets", "tensor"),
         Arg("classes", "int", None), Arg("chunk", "int", None))
def _cross_entropy(ctx, logits, targets, classes, chunk):
    """Mean cross entropy of logits[..., C] (float) against targets[...] (integer) -> f32[].
    classes = N < |C|: only the first N classes are real, the rest padding (a vocab padded
    to split evenly, as Megatron pads it): their logits take no part in the loss, and
    generation never picks them. chunk = E: tokens x classes of one chunk of the loss (only
    one chunk's log-probabilities and gradient are alive at a time; default 2**24)."""
    need_float(ctx, logits, "cross_entropy's logits")
    C = last_dim(ctx, logits, "cross_entropy")
    if targets.dtype not in INTS:
        ctx.error(f"cross_entropy targets must be an integer tensor, got {targets.dtype}",
                  "declare targets as i64[...]")
    if targets.dims != logits.dims[:-1]:
        ctx.error(f"cross_entropy targets {dims_text(targets.dims)} must have the logits' leading "
                  f"dims {dims_text(logits.dims[:-1])}")
    size = ctx.size(C)
    if classes is not None and not 1 <= classes <= size:
        ctx.error(f"cross_entropy classes = {classes} must be between 1 and {C} = {size}",
                  f"the real classes, at most the padded {C}")
    if chunk is not None and chunk < 1:
        ctx.error(f"cross_entropy chunk = {chunk} must be at least 1",
                  "tokens x classes per chunk, e.g. chunk = 16777216")
    extra = {"classes": int(classes)} if classes is not None and classes < size else {}
    if chunk is not None:
        extra["chunk"] = int(chunk)
    return ctx.op("cross_entropy", (logits, targets), (), "f32", {"over": C, **extra})
