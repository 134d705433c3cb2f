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
              offset, float8: dict | None = None) -> torch.Tensor:
    """The output of fused chain `f` from its inputs in `env`; `float8`: the float8 matmuls
    by step output (Shards.float8)."""
    if isinstance(f, FusedLinear):
        return run_linear(f, env, (float8 or {}).get(program.steps[f.covered[0]].out))
    return run_attention(f, env, program, offset)


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
                  offset) -> torch.Tensor:
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
        q0, k0 = offset(sv, f.query), offset(sv, f.key)
        if rule.causal(attrs) and q0 == k0 == 0 and q.shape[-2] == k.shape[-2]:
            causal = True
        else:  # shards of the sequence, or another rule: compare global positions
            qi = torch.arange(q.shape[-2], device=q.device) + q0
            ki = torch.arange(k.shape[-2], device=q.device) + k0
            mask = rule.visible(attrs, qi, ki)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                       scale=f.scale)
    return align(y, (*lead, f.query, vd), ov.dims)
