"""The `moe` layer: a top-k softmax router over `experts`, one MLP per expert, a capacity.

    y = moe(x, experts, ffn, top_k = 2, capacity = 1.25, aux = 0.01, activation = gelu)
    y = moe(x, experts, ffn, activation = swiglu, shared = ffn)
    y = moe(x, experts, ffn, top_k = 2, capacity = 0.0, aux = 0.0, activation = swiglu,
            normalize = true)                                   # Mixtral's block

params: router[hidden, experts], w1[experts, hidden, ffn], w2[experts, ffn, hidden], and with
activation = swiglu a gate w3[experts, hidden, ffn] (Mixtral's experts). The routed part is one
primitive op `moe` (its record, semantics and kernel: shard/ops/moe.py), because the
capacity and the balance loss see every token of the batch at once. The router's conventions
are its arguments: softmax over every expert, then the top_k; `normalize` rescales the kept
weights to sum to 1 (Mixtral; Qwen-MoE's norm_topk_prob); `capacity = 0` keeps every choice
(no token dropped: transformers' routers). `shared = d` adds a dense MLP of width d that every
token goes through (DeepSeek-MoE, Qwen-MoE); it is an `mlp` of plain einsums, so it shards by
their rules and the compiler adds its output to the routed one. `shared_gate` scales it by
sigmoid(x . g) per token (Qwen2-MoE's shared_expert_gate, a param g[hidden]).
"""

from __future__ import annotations

from soapstone.dsl.layers.registry import (
    PARAM_DTYPE,
    Arg,
    builtin,
    dims_text,
    finite_number,
    last_dim,
    need_float,
)


@builtin("moe", Arg("x", "tensor"), Arg("experts", "dim"), Arg("ffn", "dim"),
         Arg("top_k", "int", 1), Arg("capacity", "float", 1.25), Arg("aux", "float", 0.01),
         Arg("activation", "choice", "gelu", ("gelu", "relu", "silu", "swiglu")),
         Arg("shared", "dim", None), Arg("normalize", "bool", False),
         Arg("shared_gate", "bool", False))
def _moe(ctx, x, experts, ffn, top_k, capacity, aux, activation, shared, normalize,
         shared_gate):
    """moe(x, experts, ffn, top_k = 1, capacity = 1.25, aux = 0.01, activation = gelu,
    shared = none, normalize = false, shared_gate = false): each token goes to its top_k
    experts by router softmax, weighted by those probabilities (normalize: divided by their
    sum); an expert takes at most ceil(capacity * tokens * top_k / experts) token choices
    (first choices first, then in token order), the rest are dropped (capacity = 0: none is);
    aux * experts * sum_e(f_e * p_e) (Switch's balance loss) is added to the training loss's
    gradient. swiglu: each expert is silu(x w1) * (x w3) then w2. shared = d: plus a dense
    MLP of width d (same activation) on every token; shared_gate: that MLP times
    sigmoid(x . shared_gate) per token."""
    need_float(ctx, x, "moe's input")
    h = last_dim(ctx, x, "moe")
    for what, d in (("experts", experts), ("ffn", ffn), ("shared", shared)):
        if d is not None and (d in x.dims or d == h):
            ctx.error(f"moe's {what} dim {d} is already a dim of the input {dims_text(x.dims)}",
                      "declare a new dim for it")
    if experts == ffn:
        ctx.error(f"moe's experts and ffn dims are both {experts}",
                  "give the experts' hidden width its own dim")
    if shared == experts:
        ctx.error(f"moe's shared expert width is the experts dim {experts}",
                  f"give the shared expert a width: shared = {ffn}, or a dim of its own")
    n = ctx.size(experts)
    if not 1 <= top_k <= n:
        ctx.error(f"moe top_k = {top_k} must be between 1 and {experts} = {n}",
                  f"write top_k = {min(max(top_k, 1), n)}, or more experts")
    # capacity scales a token count (ceil of it) and aux the loss: inf is neither
    finite_number(ctx, capacity, "moe capacity", "1.25 is Switch's; 0 drops no token")
    finite_number(ctx, aux, "moe aux", "0.01 is Switch's; 0 turns the balance loss off")
    if capacity < 0:
        ctx.error(f"moe capacity = {capacity} must not be negative",
                  "1.0 fits a perfectly balanced load; larger drops fewer tokens; 0 drops none")
    if shared_gate and shared is None:
        ctx.error("moe's shared_gate gates a shared expert, and this moe has none",
                  "write shared = DIM (the shared expert's width), or drop shared_gate")
    if aux < 0:
        ctx.error(f"moe aux = {aux} must not be negative", "0 turns the balance loss off")
    # the router scores every expert on every rank: its own name for the dim keeps
    # `parameter experts -> axis` from splitting it
    scores = ctx.derive(f"{experts}_r", n, alias_of=experts, why=f"the router's {experts}")
    router = ctx.param("router", (h, scores), "normal(0.02)")
    w1 = ctx.param("w1", (experts, h, ffn), "normal(0.02)")
    w2 = ctx.param("w2", (experts, ffn, h), "normal(0.02)")
    args = (x, router, w1, w2)
    if activation == "swiglu":
        args += (ctx.param("w3", (experts, h, ffn), "normal(0.02)"),)
    attrs = {"hidden": h, "experts": experts, "scores": scores, "ffn": ffn, "top_k": top_k,
             "capacity": float(capacity), "aux": float(aux), "activation": activation}
    if normalize:  # absent when false: the records of the models before it stay as they were
        attrs["normalize"] = True
    if shared is None:
        return ctx.op("moe", args, x.dims, PARAM_DTYPE, attrs)
    routed = ctx.op("moe", args, x.dims, PARAM_DTYPE, attrs, name="routed")
    gated = activation == "swiglu"
    dense = ctx.call("mlp", x, shared, activation="silu" if gated else activation,
                     bias=False, gated=gated)
    if shared_gate:  # Qwen2-MoE: sigmoid(x . g) per token scales the shared expert
        g = ctx.param("shared_gate", (h,), "normal(0.02)")
        lead = tuple(d for d in x.dims if d != h)
        score = ctx.op("einsum", (x, g), lead, x.dtype, name="shared_score")
        gate = ctx.op("sigmoid", (score,), lead, x.dtype, name="shared_sigmoid")
        dense = ctx.op("mul", (dense, gate), x.dims, x.dtype, name="shared_gated")
    return ctx.op("add", (routed, dense), x.dims, PARAM_DTYPE)
