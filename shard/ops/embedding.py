"""embedding: a table lookup by token id."""

from __future__ import annotations

from soapstone.shard.ops.einsum import einsum_roles
from soapstone.shard.ops.record import OpRecord


def embedding(step, args, ctx):
    """Lookup; with the vocab split, rows outside this rank's range contribute zeros."""
    import torch
    import torch.nn.functional as F

    ids, table = args
    tv = ctx.arg(step, 1)
    vocab_dim = tv.dims[0]
    if tv.layout.split_axis(vocab_dim) is None:
        return F.embedding(ids, table)
    lo, n = ctx.offset(tv, vocab_dim), tv.local_shape[0]
    inside = (ids >= lo) & (ids < lo + n)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    return F.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)


RECORDS = (
    OpRecord(
        "embedding",
        "args (ids[...], table[vocab, hidden]) -> [..., hidden]. attrs: vocab, hidden",
        # a lookup is a contraction with one-hot ids: the vocab dim sums, a split vocab
        # gives partial rows
        kernel=embedding, roles=einsum_roles,
    ),
)
