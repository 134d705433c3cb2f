"""Ops that move data along dims without arithmetic: rename (a relabelled view) and
repeat_dim (grouped-query heads: each source index serves a group of output indices)."""

from __future__ import annotations

from soapstone.shard.ops.record import Bound, OpRecord, Partial, per_element


def src_as_dst(op, arg: int, dims: tuple[str, ...]) -> tuple[str, ...]:
    """The arg's src dim named dst: splitting dst splits the arg along src."""
    src, dst = op.attr("src"), op.attr("dst")
    return tuple(dst if d == src else d for d in dims)


def rename(step, args, ctx):
    """The input itself: only the dim's name changes."""
    return args[0]


def repeat_dim(step, args, ctx):
    """Index i of dst (this rank's slice of it) reads index i // group of src (its own slice
    of src, or the whole of it)."""
    import torch

    x = args[0]
    v, o = ctx.arg(step, 0), ctx.out(step)
    src, dst = step.attr("src"), step.attr("dst")
    group = ctx.sizes[dst] // ctx.sizes[src]
    d = o.dims.index(dst)
    idx = (torch.arange(o.local_shape[d], device=x.device) + ctx.offset(o, dst)) // group \
        - ctx.offset(v, src)
    return x.index_select(d, idx)


RECORDS = (
    OpRecord("rename", "args (x,). attrs: src=d, dst=d2 (same size): relabel one dim, no "
             "data change", kernel=rename, arg_dims=src_as_dst, partial_pass=Partial.ONE,
             bound=Bound.VIEW),
    OpRecord("repeat_dim", "args (x[..., src, ...]) -> the same with dst for src (|dst| a "
             "multiple g of |src|): index i of dst reads index i // g of src (grouped-query "
             "heads). attrs: src, dst", kernel=repeat_dim, arg_dims=src_as_dst,
             partial_pass=Partial.ONE,
             # reads src by global index: it may take src whole where splitting it with
             # the output does not divide (one kv head, 2 ranks)
             whole_arg=True, flops=per_element(0)),
)
