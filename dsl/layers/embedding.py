"""The embedding layer: a lookup table from integer ids to vectors."""

from __future__ import annotations

from soapstone.dsl.layers.registry import PARAM_DTYPE, Arg, builtin, dims_text
from soapstone.shard.plan.dtypes import INTS


@builtin("embedding", Arg("ids", "tensor"), Arg("dims", "map"))
def _embedding(ctx, ids, dims):
    """embedding(ids, vocab -> hidden): param table[vocab, hidden]; ids.dims + [hidden]."""
    vocab, hidden = dims
    if ids.dtype not in INTS:
        ctx.error(f"embedding ids must be an integer tensor, got {ids.dtype}",
                  "declare the input as i64[...]")
    if vocab in ids.dims or hidden in ids.dims:
        ctx.error(f"embedding {vocab} -> {hidden}: ids {dims_text(ids.dims)} already has that dim")
    src = ctx.producer(ids.name)
    if src is not None and src.kind == "positions" and ctx.size(ids.dims[0]) > ctx.size(vocab):
        d = ids.dims[0]
        ctx.error(f"positions({d}) reach {ctx.size(d) - 1}, but the table has only "
                  f"{vocab} = {ctx.size(vocab)} rows",
                  f"--dim {vocab}={ctx.size(d)}, or a shorter {d}")
    table = ctx.param("table", (vocab, hidden), "normal(0.02)")
    return ctx.op("embedding", (ids, table), ids.dims + (hidden,), PARAM_DTYPE,
                  {"hidden": hidden, "vocab": vocab})
