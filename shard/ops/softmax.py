"""softmax over one dim, with its distributed form (the max and the normaliser combined)."""

from __future__ import annotations

from soapstone.shard.ops.norms import over_roles
from soapstone.shard.ops.record import DistStat, OpRecord, Reduce, Slot, per_element


def softmax(step, args, ctx):
    """Softmax over `over`; split, the max and the normaliser are combined across ranks."""
    import torch

    from soapstone.shard.ops.kernels import Stats

    x = args[0]
    d = ctx.arg(step, 0).dims.index(step.attr("over"))
    if not step.dist:
        return torch.softmax(x, d)
    stats = Stats(step, ctx, RECORDS)
    e = torch.exp(x - stats.reduce(x.detach().amax(d, keepdim=True), Reduce.MAX))
    return e / stats.reduce(e.sum(d, keepdim=True), Reduce.SUM)


def softmax_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """The output; the distributed form: the exponentials, a tensor of the input's size."""
    if not step.dist:
        return [step.out], 0
    return [], program.value(step.args[0]).nbytes


RECORDS = (
    OpRecord("softmax", "args (x,). attrs: over=d", kernel=softmax, roles=over_roles,
             dist_stats=(DistStat(Reduce.MAX, False), DistStat(Reduce.SUM, True)),
             flops=per_element(5), saves=softmax_saves,
             fuses={Slot.PROBS: frozenset({"over"})}),
)
