"""Which chains of a Program the runtime fuses into one kernel (pure data, no torch).

shard/runtime/fusion.py runs them (attention as `scaled_dot_product_attention`, linear + bias as one
`addmm`); this module only finds them, so that `explain` can count what a fused chain
materialises and keeps for backward (nothing of the attention scores, no matmul temporary)
without importing torch.

Which op may fill which slot of a chain is its record's (shard/ops/, `fuses`): per slot, the
attrs the fused kernel honours. A step setting any other attr is left to its own kernel, so a
fused kernel never silently drops an option; the mask slot's rule is the mask's own
(`OpRecord.mask`), which the fused attention kernel applies.
"""

from __future__ import annotations

import attrs

from soapstone.shard.ops.einsum import matmul_split  # noqa: F401 - found here before 0.2
from soapstone.shard.ops.record import Slot
from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.program import Compute, Program


@attrs.frozen
class FusedAttention:
    """A chain of steps computed by one fused call, made when the last of them is reached
    (by then every input is there: a gathered `v` may arrive after the softmax)."""

    at: int  # the output einsum: where the fused call runs
    covered: tuple[int, ...]  # the scores einsum, mask and softmax it also computes
    q: str
    k: str
    v: str
    out: str
    scores: str  # the scores value (its layout gives the causal mask's offsets)
    query: str  # dim names
    key: str
    causal: bool  # a mask applies: its op's kind and attrs (the fused call applies its rule)
    scale: float
    mask_kind: str = ""
    mask_attrs: tuple[tuple[str, object], ...] = ()


@attrs.frozen
class FusedLinear:
    """`out = x . w + bias` contracting x's trailing `k` dims with w's leading ones."""

    at: int  # the bias add
    covered: tuple[int, ...]  # the einsum
    x: str
    w: str
    bias: str
    out: str
    k: int


def per_chunk(program: Program, f: FusedAttention) -> bool:
    """Whether the runtime calls the attention kernel once per zigzag chunk of the queries (a
    balanced split, keys whole, plain causal: fusion.causal_prefixes): each call keeps its own
    output piece for backward, beside their concatenation (the chain's output)."""
    v = program.value(f.scores)
    return f.causal and record_of(f.mask_kind).mask.causal(dict(f.mask_attrs)) \
        and f.query in program.balanced and v.layout.split_axis(f.query) is not None \
        and v.layout.split_axis(f.key) is None


def fits(step, slot: Slot) -> bool:
    """Whether `step` (a Compute, or None) may fill `slot` of a fused chain (its record)."""
    return step is not None and record_of(step.kind).fits(step, slot)


def find_fusions(program: Program) -> dict:
    """Every fusable chain (attention, linear + bias), keyed by the index it runs at."""
    return {**find_attention(program), **find_linear(program)}


class _Uses:
    """Who consumes each value of a program."""

    def __init__(self, program: Program):
        self.program = program
        self.where = {s.out: i for i, s in enumerate(program.steps)}
        self.uses: dict[str, list[int]] = {}
        for i, s in enumerate(program.steps):
            for a in getattr(s, "args", ()) or (getattr(s, "src", None),):
                self.uses.setdefault(a, []).append(i)
        self.outputs = {o.value for o in program.outputs}
        self.params = {p.name for p in program.params}

    def only_use(self, name: str) -> Compute | None:
        """The single local (unowned) Compute consuming `name`, if that is its only use."""
        found = self.uses.get(name, [])
        if len(found) != 1 or name in self.outputs:
            return None
        step = self.program.steps[found[0]]
        return step if isinstance(step, Compute) and not step.owner else None


def find_linear(program: Program) -> dict[int, FusedLinear]:
    """Every `einsum(x, W)` over x's trailing dims whose only use adds a bias parameter."""
    u = _Uses(program)
    found: dict[int, FusedLinear] = {}
    for i, s in enumerate(program.steps):
        if not (isinstance(s, Compute) and fits(s, Slot.MATMUL) and not s.owner
                and s.args[1] in u.params):
            continue
        x, w, y = (program.value(n).dims for n in (*s.args, s.out))
        k = matmul_split(x, w, y)
        add = u.only_use(s.out)
        if not k or not fits(add, Slot.BIAS) or add.args[0] != s.out:
            continue
        bias = add.args[1]
        if bias not in u.params or program.value(bias).dims != w[k:] \
                or program.value(add.out).dims != y:
            continue
        at = u.where[add.out]
        found[at] = FusedLinear(at, (i,), s.args[0], s.args[1], bias, add.out, k)
    return found


def find_attention(program: Program) -> dict[int, FusedAttention]:
    """Every fusable attention chain, keyed by the index of its output einsum."""
    u = _Uses(program)
    steps, where, params, only_use = program.steps, u.where, u.params, u.only_use
    found: dict[int, FusedAttention] = {}
    for s in steps:
        if not (isinstance(s, Compute) and fits(s, Slot.SCORES) and not s.owner):
            continue
        if any(a in params for a in s.args):
            continue
        nxt = only_use(s.out)
        mask = None
        if fits(nxt, Slot.MASK):
            mask, nxt = nxt, only_use(nxt.out)
        if not fits(nxt, Slot.PROBS) or nxt.dist:
            continue
        soft = nxt
        o = only_use(soft.out)
        if not fits(o, Slot.CONTEXT) or o.args[0] != soft.out:
            continue
        chain = _shapes_fit(program, s, soft, o, mask)
        if chain is None:
            continue
        query, key = chain
        found[where[o.out]] = FusedAttention(
            at=where[o.out], covered=tuple(where[x.out] for x in (s, mask, soft) if x is not None),
            q=s.args[0], k=s.args[1], v=o.args[1], out=o.out, scores=s.out,
            query=query, key=key, causal=mask is not None,
            scale=float(s.attr("scale", 1.0)),
            mask_kind=mask.kind if mask else "", mask_attrs=mask.attrs if mask else (),
        )
    return found


def _shapes_fit(program, scores, soft, o, mask) -> tuple[str, str] | None:
    """(query dim, key dim) when the chain is q.k^T -> softmax over keys -> .v, else None."""
    q, k = (program.value(a).dims for a in scores.args)
    v, out = program.value(o.args[1]).dims, program.value(o.out).dims
    sdims = program.value(scores.out).dims
    key = soft.attr("over")
    query_dims = [d for d in sdims if d in q and d not in k]
    if len(query_dims) != 1 or key not in k or key in q:
        return None
    query = query_dims[0]
    if mask is not None and (mask.attr("query"), mask.attr("key")) != (query, key):
        return None
    lead = [d for d in sdims if d not in (query, key)]
    contracted = [d for d in q if d not in sdims]
    values = [d for d in v if d not in lead and d != key]
    if len(contracted) != 1 or contracted[0] not in k or len(values) != 1:
        return None
    if set(q) != {*lead, query, *contracted} or set(k) != {*lead, key, *contracted}:
        return None
    if set(v) != {*lead, key, *values} or set(out) != {*lead, query, *values}:
        return None
    return query, key
