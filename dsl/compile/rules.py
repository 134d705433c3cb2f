"""How each primitive op may be sharded: the role every dim of its iteration space plays.

A dim's role decides what splitting it over a mesh axis means for the op:
- FREE: the op works slice by slice along it; args that have the dim are split the same way
  and so is the output (batch, seq, heads, ffn in an elementwise op or einsum's free dims);
- SUM: the op sums over it linearly (einsum's contracted dims, the vocab lookup of an
  embedding, the positions a mean loss averages): args split along it give a partial output;
- STAT: the op reduces over it through a statistic with a distributed form (layernorm's mean
  and variance, softmax's max and sum, cross-entropy's log-sum-exp): args split along it,
  the op combines partial statistics across the axis, the output keeps the split (or is
  replicated when the dim is gone).

Besides splits, linear ops pass partial sums through (`PARTIAL_PASS`): einsum and mul with one
partial arg, add with all args partial. Everything else in the Megatron and sequence-parallel
patterns follows from these tables and the cost of moving data; nothing is special-cased.
"""

from __future__ import annotations

from soapstone.dsl.model import ir

FREE, SUM, STAT = "free", "sum", "stat"

# "one": exactly one arg partial, the rest replicated; "all": every arg partial.
PARTIAL_PASS = {"einsum": "one", "mul": "one", "add": "all", "rename": "one", "dropout": "one",
                "rope": "one", "repeat_dim": "one"}

# Ops that read an arg by global index (repeat_dim: output index i reads i // group), so they
# can take it whole where splitting it with the output does not divide (one kv head, 2 ranks).
WHOLE_ARG = ("repeat_dim",)


def arg_dims(op: ir.Op, arg: int, dims: tuple[str, ...]) -> tuple[str, ...]:
    """An arg's dims named in the op's iteration space (rename and repeat_dim map src to dst:
    splitting dst splits the arg along src)."""
    if op.kind in ("rename", "repeat_dim"):
        src, dst = op.attr("src"), op.attr("dst")
        return tuple(dst if d == src else d for d in dims)
    return dims


def roles(op: ir.Op, arg_dim_lists: list[tuple[str, ...]]) -> dict[str, str]:
    """The role of every dim the op iterates over (dims absent from the map may not split)."""
    out = op.type.dims
    kind = op.kind
    if kind.startswith("custom:"):
        return custom_roles(op, arg_dim_lists)
    if kind in ("einsum", "embedding"):
        every = dict.fromkeys(d for dims in arg_dim_lists for d in dims)
        return {d: (FREE if d in out else SUM) for d in every}
    if kind in ("layernorm", "rmsnorm", "softmax"):
        over = op.attr("over")
        return {d: (STAT if d == over else FREE) for d in out}
    if kind == "cross_entropy":
        over = op.attr("over")
        return {d: (STAT if d == over else SUM) for d in arg_dim_lists[0]}
    if kind == "moe":
        # split token dims are routed where they are: the op combines the ranks' per-expert
        # counts of each run of tokens, so slots fall as on one rank; split experts give
        # partial outputs (unless `exchange` applies)
        # each expert's ffn split as Megatron's column/row pair (w1, w3 by column, w2 by
        # row) gives partial outputs too
        lead = arg_dim_lists[0][:-1]
        return {**dict.fromkeys(lead, STAT), op.attr("experts"): SUM, op.attr("ffn"): SUM}
    if kind == "rope":  # rotates pairs across the whole `over` dim: it never splits
        return {d: FREE for d in out if d != op.attr("over")}
    # elementwise (add, mul, activations, dropout, causal_mask), rename, repeat_dim, positions
    return dict.fromkeys(out, FREE)


def exchange(op: ir.Op, arg_dim_lists: list[tuple[str, ...]]) -> tuple[tuple[str, str], ...]:
    """The (rows dim, owners dim) pairs an op may split over one axis together, moving each
    row to the rank owning its target and back by all-to-all. moe: tokens split along any
    token dim go to the ranks holding their experts."""
    if op.kind == "moe":
        return tuple((d, str(op.attr("experts"))) for d in arg_dim_lists[0][:-1])
    return ()


def custom_roles(op: ir.Op, arg_dim_lists: list[tuple[str, ...]]) -> dict[str, str]:
    """Roles of a custom layer's op: its leading `...` dims are free; `op.shard` names the rest.

    The op's attrs bind each of the layer's dim variables to a model dim."""
    named = {dim for _, dim in op.attrs if isinstance(dim, str)}
    result = {d: FREE for dims in arg_dim_lists for d in dims if d not in named}
    for dim, how in op.shard:
        result[dim] = FREE if how == "split" else SUM
    return result
