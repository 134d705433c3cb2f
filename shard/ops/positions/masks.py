"""causal_mask: attention scores of keys a query may not see set to -inf, by global positions
(so a split query or key dim masks exactly what one rank masks): those after it, and with a
`window` of N (sliding-window attention) those N or more positions before it."""

from __future__ import annotations

import math

from soapstone.shard.ops.record import MaskRule, OpRecord, Slot, per_element


def causal_visible(attrs: dict, qi, ki):
    """[q, k]: key position ki is at or before query position qi (and, with a window of N,
    qi - ki < N)."""
    seen = ki.view(1, -1) <= qi.view(-1, 1)
    window = attrs.get("window")
    if window is not None:
        seen = seen & (qi.view(-1, 1) - ki.view(1, -1) < int(window))
    return seen


def plain_causal(attrs: dict) -> bool:
    """No window: exactly key <= query."""
    return "window" not in attrs


def causal_mask(step, args, ctx):
    """-inf where the mask's rule hides the key from the query (global positions)."""
    from soapstone.shard.ops.kernels import align

    x = args[0]
    v = ctx.arg(step, 0)
    q, k = step.attr("query"), step.attr("key")
    qi, ki = ctx.index(v, q).to(x.device), ctx.index(v, k).to(x.device)
    hidden = align(~causal_visible(dict(step.attrs), qi, ki), (q, k), v.dims)
    return x.masked_fill(hidden, float("-inf"))


def mask_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """A boolean mask over this rank's (query, key) positions."""
    v = program.value(step.args[0])
    q, k = step.attr("query"), step.attr("key")
    return [], math.prod(n for d, n in zip(v.dims, v.local_shape, strict=True) if d in (q, k))


RECORDS = (
    OpRecord(
        "causal_mask",
        "args (x,). attrs: query=dq, key=dk, window=N (optional): -inf where position(dk) > "
        "position(dq), or position(dq) - position(dk) >= N",
        kernel=causal_mask, flops=per_element(1), saves=mask_saves,
        # the fused attention kernel applies the same rule (or is_causal where it is exact)
        fuses={Slot.MASK: frozenset({"query", "key", "window"})},
        mask=MaskRule(causal_visible, plain_causal),
    ),
)
