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

import torch
import torch.nn.functional as F

from soapstone.shard.ops.einsum import matmul_2d
from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.program import Program
from soapstone.shard.runtime.fusion_plan import (  # noqa: F401 - found in the plan, run here
    FusedAttention,
    FusedLinear,
    find_attention,
    find_fusions,
    find_linear,
)


def run_fused(f: FusedAttention | FusedLinear, env: dict[str, torch.Tensor], program: Program,
              ctx, float8: dict | None = None) -> torch.Tensor:
    """The output of fused chain `f` from its inputs in `env`; `ctx`: the rank's Shards (where
    its slices sit); `float8`: the float8 matmuls by step output (Shards.float8)."""
    if isinstance(f, FusedLinear):
        return run_linear(f, env, (float8 or {}).get(program.steps[f.covered[0]].out))
    return run_attention(f, env, program, ctx)


def run_linear(f: FusedLinear, env: dict[str, torch.Tensor], float8=None) -> torch.Tensor:
    """One addmm over the flattened leading dims (under float8: its matmul, then the bias)."""
    x, w, b = env[f.x], env[f.w], env[f.bias]
    if float8 is not None:
        return matmul_2d(x, w, f.k, float8) + b
    lead, k = x.shape[:-f.k], f.k
    y = torch.addmm(b.reshape(-1), x.reshape(-1, math.prod(x.shape[-k:])),
                    w.reshape(math.prod(w.shape[:k]), -1))
    return y.reshape(*lead, *w.shape[k:])


def run_attention(f: FusedAttention, env: dict[str, torch.Tensor], program: Program,
                  ctx) -> torch.Tensor:
    """The chain's output from q, k and v in one scaled_dot_product_attention call."""
    from soapstone.shard.ops.kernels import align

    sv = program.value(f.scores)
    lead = tuple(d for d in sv.dims if d not in (f.query, f.key))
    qv, kv, vv, ov = (program.value(n) for n in (f.q, f.k, f.v, f.out))
    (qd,) = [d for d in qv.dims if d not in (*lead, f.query)]
    (vd,) = [d for d in vv.dims if d not in (*lead, f.key)]
    q = align(env[f.q], qv.dims, (*lead, f.query, qd))
    k = align(env[f.k], kv.dims, (*lead, f.key, qd))
    v = align(env[f.v], vv.dims, (*lead, f.key, vd))
    mask, causal = None, False
    if f.causal:  # the mask op's own rule (its record), from global positions
        rule, attrs = record_of(f.mask_kind).mask, dict(f.mask_attrs)
        held = ctx.runs(sv, f.query)
        keys_whole = ctx.positions(sv, f.key) is None and ctx.offset(sv, f.key) == 0 \
            and k.shape[-2] == ctx.sizes[f.key]
        if rule.causal(attrs) and keys_whole and held == [(0, 0, k.shape[-2])]:
            causal = True
        elif rule.causal(attrs) and keys_whole:  # context parallel: skip the unseen keys
            y = causal_prefixes(q, k, v, held, f.scale, rule, attrs)
            return align(y, (*lead, f.query, vd), ov.dims)
        else:  # shards of the keys, or another rule: compare global positions
            mask = rule.visible(attrs, ctx.index(sv, f.query).to(q.device),
                                ctx.index(sv, f.key).to(q.device))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                       scale=f.scale)
    return align(y, (*lead, f.query, vd), ov.dims)


def causal_prefixes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    held: list[tuple[int, int, int]], scale, rule, attrs: dict) -> torch.Tensor:
    """Causal attention of the queries `held` (this rank's runs of a split sequence:
    Shards.runs) to every key in natural order: each run of consecutive positions attends only
    the key prefix it can see (0..its last position), one kernel call per run, so a
    balanced split's ranks do equal work and no rank computes fully masked key blocks. A run
    starting at 0 is the square is_causal covers; the others pass the rule's mask."""
    out = []
    for at, first, n in held:
        stop = first + n
        qs, ks, vs = q[..., at:at + n, :], k[..., :stop, :], v[..., :stop, :]
        if first == 0:
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
            continue
        mask = rule.visible(attrs, torch.arange(first, stop, device=q.device),
                            torch.arange(stop, device=q.device))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)
