"""cross_entropy: the mean token loss, with its distributed form over a split class dim."""

from __future__ import annotations

import math

from soapstone.shard.ops.record import DistStat, OpRecord, Reduce, Role, StatShape


def cross_entropy_roles(op, arg_dim_lists) -> dict[str, Role]:
    """The class dim STAT (log-sum-exp); the positions SUM (the mean sums over them)."""
    over = op.attr("over")
    return {d: (Role.STAT if d == over else Role.SUM) for d in arg_dim_lists[0]}


#: tokens x classes of one chunk (elements): 64 Mi, a 128K vocab's 523 tokens, so a chunk's
#: fp32 temporaries are 256 MiB each whatever the batch. A quarter of that left an H100
#: waiting on the CPU: 50 chunks at GPT-2's vocab and 16K tokens cost ~8 ms of kernel launches
#: a step (BENCHMARKS.md, "On a GPU"). `cross_entropy(..., chunk = N)` sets it.
CHUNK_ELEMENTS = 1 << 26


def chunk_rows(step, program) -> int:
    """Tokens per chunk: the chunk budget over this rank's classes (padding included), at
    least one token, at most all of them."""
    lv = program.value(step.args[0])
    n = lv.local_shape[lv.dims.index(step.attr("over"))]
    tokens = math.prod(lv.local_shape) // max(1, n)
    budget = step.attr("chunk") or CHUNK_ELEMENTS
    return max(1, min(tokens, budget // max(1, n)))


def cross_entropy(step, args, ctx):
    """Mean token loss, a chunk of tokens at a time (shard/ops/loss/loss_kernels.py). Split
    positions give partial sums (divided by the global count); a split class dim combines
    max, log-sum-exp and the target logit across ranks."""
    from soapstone.shard.ops.kernels import Stats, align
    from soapstone.shard.ops.loss.loss_kernels import PlainLoss, SplitLoss

    logits, targets = args
    lv, tv = ctx.arg(step, 0), ctx.arg(step, 1)
    over = step.attr("over")
    lead = tuple(d for d in lv.dims if d != over)
    x = align(logits, lv.dims, (*lead, over))
    shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    t = align(targets, tv.dims, lead).reshape(-1)
    count = math.prod(ctx.sizes[d] for d in lead)
    classes = step.attr("classes")
    rows = chunk_rows(step, ctx.program)
    # the gradient goes into the logits' storage when no one reads them again, or a copy's
    mine = step.args[0] in ctx.overwritable or \
        x.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    if not step.dist:
        return PlainLoss.apply(x, t, classes or x.shape[-1], rows, mine) / count
    stats = Stats(step, ctx, RECORDS)
    return SplitLoss.apply(x, t, ctx.offset(lv, over), classes, stats, rows, mine,
                           tuple(shape)).sum() / count


def chunk_bytes(step, program) -> int:
    """One chunk of this rank's logits, in their dtype."""
    lv = program.value(step.args[0])
    n = lv.local_shape[lv.dims.index(step.attr("over"))]
    return chunk_rows(step, program) * n * lv.nbytes // max(1, math.prod(lv.local_shape))


def token_bytes(step, program) -> int:
    """One float per token of this rank, in the logits' dtype."""
    lv = program.value(step.args[0])
    n = lv.local_shape[lv.dims.index(step.attr("over"))]
    return lv.nbytes // max(1, n)


def cross_entropy_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """The logits (backward runs the chunks again from them); split, the max and the sum of
    exponentials per token too."""
    return floats[:1], (2 * token_bytes(step, program) if step.dist else 0)


def cross_entropy_scratch(step, program) -> int:
    """Forward's temporaries: one chunk's log-probabilities (and, with padded classes, the
    real classes' copy they are taken from; split: its shifted logits and their exponentials),
    and a float or more per token (the target log-probabilities; split: the statistics and
    the target logits)."""
    chunks = 2 if step.dist or step.attr("classes") is not None else 1
    return chunks * chunk_bytes(step, program) + (3 if step.dist else 1) * token_bytes(
        step, program)


def cross_entropy_backward_scratch(step, program) -> int:
    """Backward's temporaries beside the gradient: one chunk's log-probabilities, their
    gradient and the logits' (split: the exponentials and the gradient)."""
    return (2 if step.dist else 3) * chunk_bytes(step, program) + 2 * token_bytes(step, program)


RECORDS = (
    OpRecord(
        "cross_entropy",
        "args (logits[..., C], targets[...] int). attrs: over=C, optional classes=N (the "
        "first N classes are real, the rest padding left out of the loss), optional chunk=E "
        "(tokens x classes per chunk, default 2**24). "
        "-> f32[] mean over all target positions",
        kernel=cross_entropy, roles=cross_entropy_roles,
        # the max and the sums are taken with the class dim moved last: the max keeps it
        dist_stats=(DistStat(Reduce.MAX, False, StatShape.LAST),
                    DistStat(Reduce.SUM, False, StatShape.DROP),
                    DistStat(Reduce.SUM, False, StatShape.DROP)),
        saves=cross_entropy_saves, scratch=cross_entropy_scratch,
        backward_scratch=cross_entropy_backward_scratch, grad_in_place=True,
    ),
)
