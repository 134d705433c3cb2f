"""Multi-head self-attention: projections, rope, grouped-query heads, causal mask, softmax."""

from __future__ import annotations

import math

from soapstone.dsl.layers.positions import rope_op, scaling_attrs
from soapstone.dsl.layers.registry import (
    Arg,
    Operand,
    builtin,
    dims_text,
    finite_number,
    need_float,
)
from soapstone.shard.plan.sizes import MAX_DIM, divisors


@builtin("attention", Arg("x", "tensor"), Arg("heads", "dim"), Arg("causal", "bool", True),
         Arg("kv_heads", "dim", None), Arg("rope", "float", None), Arg("bias", "bool", True),
         Arg("qkv_bias", "bool", False), Arg("window", "int", None),
         Arg("rope_factor", "float", 1.0), Arg("rope_low_freq", "float", 1.0),
         Arg("rope_high_freq", "float", 4.0), Arg("rope_original_max", "int", 8192),
         Arg("qk_norm", "float", 0.0), Arg("dropout", "float", 0.0),
         Arg("head_dim", "dim", None))
def _attention(ctx, x, heads, causal, kv_heads, rope, bias, qkv_bias, window, rope_factor,
               rope_low_freq, rope_high_freq, rope_original_max, qk_norm, dropout, head_dim):
    """Multi-head self-attention over x[..., S, h]: q, k, v projections (einsum with wq, wk,
    wv[h, heads, head_dim]), scores[..., heads, S, S_k] scaled by 1/sqrt(head_dim), an optional
    causal_mask, softmax over S_k, o = probs x v, then the output projection wo and bias bo.
    kv_heads: grouped-query attention (wk, wv[h, kv_heads, head_dim], each kv head serving
    heads / kv_heads query heads through repeat_dim); rope = THETA rotates q and k by their
    global positions along S (THETA > 0; without the argument, no rotation), with LLaMA-3's
    frequency scaling when rope_factor > 1 (rope_low_freq, rope_high_freq,
    rope_original_max: the rope op's); bias = false drops bo; qkv_bias = true adds bq, bk,
    bv; window = N (sliding-window attention, Mistral's): a query sees only the last N
    positions (query - key < N), an attr of the causal mask; qk_norm = EPS (Qwen3's)
    RMS-normalises each head's q and k over head_dim (params q_norm, k_norm[head_dim]) before
    rope; dropout = P drops attention probabilities (GPT-2's and Megatron's attention dropout:
    the scores are then computed and kept unfused, as Korthikanti et al. count them); head_dim
    = D (a dim, or a size: Qwen3's 128 beside hidden 1024 and 16 heads) sets each head's width,
    so q, k, v project hidden -> heads x D and wo heads x D -> hidden (without it, D = hidden /
    heads). The primitives it emits: their records in shard/ops/."""
    need_float(ctx, x, "attention's input")
    if window is not None and window <= 0:
        ctx.error(f"attention window = {window} must be a positive number of positions",
                  "window = N lets each query see itself and the N - 1 positions before it")
    if window is not None and window > MAX_DIM:
        # positions are int64 and the mask compares their differences with the window, so a
        # larger one cannot run; any window of seq positions or more masks nothing more than
        # causal does, so a sound spec never needs one (a smaller seq under --dim keeps it)
        ctx.error(f"attention window = {window} is more positions than a sequence can hold "
                  f"(at most {MAX_DIM})", "a window at least as long as the sequence is "
                  "the same as none: leave window out, or give the window the model uses")
    if not 0.0 <= dropout < 1.0:
        ctx.error(f"attention dropout = {dropout} is not in [0, 1)",
                  "the probability of dropping an attention weight, e.g. dropout = 0.1")
    if window is not None and not causal:
        ctx.error("attention window needs causal = true: the window is a causal mask's",
                  "drop causal = false, or the window")
    if len(x.dims) < 2:
        ctx.error(f"attention needs x[..., seq, hidden], got {dims_text(x.dims)}")
    lead, S, h = x.dims[:-2], x.dims[-2], x.dims[-1]
    H = heads
    if H in x.dims:
        ctx.error(f"attention heads dim {H} is already a dim of the input {dims_text(x.dims)}")
    hd = head_dim_of(ctx, x, H, head_dim)
    Sk = ctx.derive(f"{S}_k", ctx.size(S), alias_of=S, why=f"the key positions of {S}")
    if hd in x.dims or Sk in x.dims:
        ctx.error(f"attention's derived dims {hd}, {Sk} clash with the input {dims_text(x.dims)}")
    KV = kv_heads_dim(ctx, x, H, kv_heads)
    wq = ctx.param("wq", (h, H, hd), "normal(0.02)")
    wk = ctx.param("wk", (h, KV, hd), "normal(0.02)")
    wv = ctx.param("wv", (h, KV, hd), "normal(0.02)")
    wo = ctx.param("wo", (H, hd, h), "normal(0.02)")
    dt = x.dtype
    heads_dims = lead + (S, H, hd)

    def project(w: Operand, nh: str, name: str) -> Operand:
        if not qkv_bias:
            return ctx.op("einsum", (x, w), lead + (S, nh, hd), dt, name=name)
        y = ctx.op("einsum", (x, w), lead + (S, nh, hd), dt, name=f"{name}_mm")
        b = ctx.param(f"b{name}", (nh, hd), "zeros")
        return ctx.op("add", (y, b), y.dims, dt, name=name)

    q, k, v = project(wq, H, "q"), project(wk, KV, "k"), project(wv, KV, "v")
    finite_number(ctx, qk_norm, "attention qk_norm", "Qwen3 uses its rms_norm_eps, 1e-06")
    if qk_norm < 0:
        ctx.error(f"attention qk_norm = {qk_norm}: give the norm's eps (> 0), or 0 for none",
                  "Qwen3 uses its rms_norm_eps, 1e-06")
    if qk_norm:  # over head_dim, which no layout splits: each head normalised on its rank
        q = ctx.op("rmsnorm", (q, ctx.param("q_norm", (hd,), "ones")), q.dims, dt,
                   {"eps": float(qk_norm), "over": hd}, name="q_normed")
        k = ctx.op("rmsnorm", (k, ctx.param("k_norm", (hd,), "ones")), k.dims, dt,
                   {"eps": float(qk_norm), "over": hd}, name="k_normed")
    if rope is not None:  # given: a rotary base, checked (0 never means "off")
        scaling = scaling_attrs(ctx, rope_factor, rope_low_freq, rope_high_freq,
                                rope_original_max)
        q = rope_op(ctx, q, S, hd, rope, name="q_rot", scaling=scaling)
        k = rope_op(ctx, k, S, hd, rope, name="k_rot", scaling=scaling)
    elif rope_factor != 1.0:
        ctx.error(f"attention rope_factor = {rope_factor} without rope: the factor scales "
                  "rope's frequencies", "add rope = THETA, or drop rope_factor")
    k2 = ctx.op("rename", (k,), lead + (Sk, KV, hd), dt, {"dst": Sk, "src": S}, name="k2")
    v2 = ctx.op("rename", (v,), lead + (Sk, KV, hd), dt, {"dst": Sk, "src": S}, name="v2")
    if KV != H:  # each kv head serves heads / kv_heads query heads
        kdims = lead + (Sk, H, hd)
        k2 = ctx.op("repeat_dim", (k2,), kdims, dt, {"dst": H, "src": KV}, name="k_rep")
        v2 = ctx.op("repeat_dim", (v2,), kdims, dt, {"dst": H, "src": KV}, name="v_rep")
    sdims = lead + (H, S, Sk)
    s = ctx.op("einsum", (q, k2), sdims, dt, {"scale": 1.0 / math.sqrt(ctx.size(hd))},
               name="scores")
    if causal:
        mask = {"key": Sk, "query": S} if window is None else {"key": Sk, "query": S,
                                                                "window": window}
        s = ctx.op("causal_mask", (s,), sdims, dt, mask, name="masked")
    p = ctx.op("softmax", (s,), sdims, dt, {"over": Sk}, name="probs")
    if dropout:
        p = ctx.op("dropout", (p,), sdims, dt, {"p": float(dropout)}, name="probs_dropped")
    o = ctx.op("einsum", (p, v2), heads_dims, dt, name="o")
    if not bias:
        return ctx.op("einsum", (o, wo), lead + (S, h), dt)
    y = ctx.op("einsum", (o, wo), lead + (S, h), dt, name="y")
    bo = ctx.param("bo", (h,), "zeros")
    return ctx.op("add", (y, bo), lead + (S, h), dt)


def head_dim_of(ctx, x: Operand, H: str, head_dim: str | None) -> str:
    """Each head's width: the dim given, or one derived as hidden / heads (which must divide)."""
    h = x.dims[-1]
    if head_dim is not None:
        if head_dim in x.dims or head_dim == H:
            ctx.error(f"attention head_dim {head_dim} is already a dim of the input "
                      f"{dims_text(x.dims)} or the heads", "give each head's width its own dim")
        return head_dim
    hs, Hs = ctx.size(h), ctx.size(H)
    if hs % Hs:
        ok = divisors(hs)
        near = min(ok, key=lambda n: (abs(n - Hs), -n))
        ctx.error(f"{h} = {hs} does not divide evenly over {H} = {Hs}",
                  f"use {H} = {near} (head_dim = {hs // near}), or give head_dim = N")
    return ctx.derive("head_dim", hs // Hs, why=f"{h} / {H}")


def kv_heads_dim(ctx, x: Operand, H: str, kv: str | None) -> str:
    """The key/value heads dim: heads itself, or a dim whose size divides heads."""
    if kv is None or kv == H:
        return H
    if kv in x.dims:
        ctx.error(f"attention kv_heads dim {kv} is already a dim of the input {dims_text(x.dims)}")
    hs, ks = ctx.size(H), ctx.size(kv)
    if hs % ks:
        ok = divisors(hs)
        ctx.error(f"{kv} = {ks} does not divide {H} = {hs}: each kv head serves a whole group "
                  "of query heads", f"use {kv} = one of {', '.join(map(str, ok[:16]))}"
                  + (", ..." if len(ok) > 16 else ""))
    return kv
