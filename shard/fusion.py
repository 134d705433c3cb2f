"""Kernel fusion at run time: chains of primitives run as one fused torch call.

The compiler speaks in primitives (einsum, add, causal_mask, softmax), which keeps the
sharding rules small. Executing them one by one materialises intermediates torch's fused
kernels never build. Where a Program holds such a chain on local shards with nothing in
between (no collective, no other consumer, no split statistic), the runtime runs it fused:
- attention: scores einsum -> causal_mask -> softmax -> einsum with v, as
  `scaled_dot_product_attention` (nothing stored for backward but q, k and v);
- linear: x . W over x's trailing dims, then + bias, as one `addmm` (nn.Linear's kernel;
  one fewer full-size temporary).
This is a choice of kernel for local work only; layouts and collectives are untouched, so
what `soapstone show` prints is exactly what runs. Each fusion runs when the last step it
covers is reached (by then every input is there: a gathered `v` may arrive after the
softmax) and produces that step's output.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

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
    causal: bool
    scale: float


    def run(self, env: dict[str, torch.Tensor], program: Program, offset) -> torch.Tensor:
        """The chain's output from q, k and v in one scaled_dot_product_attention call."""
        return run_attention(self, env, program, offset)


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

    def run(self, env: dict[str, torch.Tensor], program: Program, offset) -> torch.Tensor:
        """One addmm over the flattened leading dims."""
        x, w, b = env[self.x], env[self.w], env[self.bias]
        lead, k = x.shape[:-self.k], self.k
        y = torch.addmm(b.reshape(-1), x.reshape(-1, math.prod(x.shape[-k:])),
                        w.reshape(math.prod(w.shape[:k]), -1))
        return y.reshape(*lead, *w.shape[k:])


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
    from soapstone.shard.ops import matmul_split

    u = _Uses(program)
    found: dict[int, FusedLinear] = {}
    for i, s in enumerate(program.steps):
        if not (isinstance(s, Compute) and s.kind == "einsum" and not s.owner
                and s.args[1] in u.params and s.attr("scale") is None):
            continue
        x, w, y = (program.value(n).dims for n in (*s.args, s.out))
        k = matmul_split(x, w, y)
        add = u.only_use(s.out)
        if not k or add is None or add.kind != "add" or add.args[0] != s.out:
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
        if not (isinstance(s, Compute) and s.kind == "einsum" and not s.owner):
            continue
        if any(a in params for a in s.args):
            continue
        nxt = only_use(s.out)
        mask = None
        if nxt is not None and nxt.kind == "causal_mask":
            mask, nxt = nxt, only_use(nxt.out)
        if nxt is None or nxt.kind != "softmax" or nxt.dist:
            continue
        soft = nxt
        o = only_use(soft.out)
        if o is None or o.kind != "einsum" or o.args[0] != soft.out:
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


def run_attention(f: FusedAttention, env: dict[str, torch.Tensor], program: Program,
                  offset) -> torch.Tensor:
    """The chain's output from q, k and v in one scaled_dot_product_attention call."""
    from soapstone.shard.ops import align

    sv = program.value(f.scores)
    lead = tuple(d for d in sv.dims if d not in (f.query, f.key))
    qv, kv, vv, ov = (program.value(n) for n in (f.q, f.k, f.v, f.out))
    (qd,) = [d for d in qv.dims if d not in (*lead, f.query)]
    (vd,) = [d for d in vv.dims if d not in (*lead, f.key)]
    q = align(env[f.q], qv.dims, (*lead, f.query, qd))
    k = align(env[f.k], kv.dims, (*lead, f.key, qd))
    v = align(env[f.v], vv.dims, (*lead, f.key, vd))
    mask, causal = None, False
    if f.causal:
        q0, k0 = offset(sv, f.query), offset(sv, f.key)
        if q0 == k0 == 0 and q.shape[-2] == k.shape[-2]:
            causal = True
        else:  # shards of the sequence: compare global positions
            qi = torch.arange(q.shape[-2]) + q0
            ki = torch.arange(k.shape[-2]) + k0
            mask = ki.view(1, -1) <= qi.view(-1, 1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                       scale=f.scale)
    return align(y, (*lead, f.query, vd), ov.dims)
