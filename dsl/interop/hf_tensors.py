"""The tensors of a Hugging Face GPT-2, LLaMA or MoE model and the soapstone params each holds:
`tensor_map(cfg)` (per tensor, the params and how: transposed, heads flattened, q/k/v side by
side), `to_hf` / `from_hf` between the two, `hf_dims` labels for messages.
"""

from __future__ import annotations

import math

import attrs

from soapstone.dsl.interop.hf_config import HFConfig


@attrs.frozen
class HFTensor:
    """One Hugging Face tensor and the params it holds. how:
    same      the param as is
    t         the param transposed ([in, out] -> nn.Linear's [out, in])
    cols      params [a, *rest] side by side as [a, sum of prod(rest)] (GPT-2's c_attn)
    flat      params flattened and concatenated (GPT-2's c_attn bias, LLaMA's q/k/v bias)
    rows      [*lead, b] -> [prod(lead), b] (GPT-2's attention c_proj from wo)
    cols_t    [a, *rest] -> [prod(rest), a] (LLaMA's q/k/v_proj from wq, wk, wv)
    rows_t    [*lead, b] -> [b, prod(lead)] (LLaMA's o_proj from wo)
    row       [b] -> [1, b] (Qwen2-MoE's shared_expert_gate)
    `index`: the tensor holds one slice of its param along the first dim (one expert of
    stacked experts: `part`), laid out by `how` as if that slice were the param."""

    name: str
    params: tuple[str, ...]
    how: str = "same"
    index: int | None = None

    def part(self, xs: list) -> list:
        """Of each param's full tensor, shape or dims: what this tensor holds."""
        return xs if self.index is None else [x[self.index] if hasattr(x, "shape") else
                                              tuple(x[1:]) for x in xs]


def tensor_map(cfg: HFConfig) -> list[HFTensor]:
    """Every Hugging Face tensor of `cfg`'s model and the soapstone params it holds."""
    T = HFTensor
    out: list[HFTensor] = []
    if cfg.kind == "gpt2":
        out += [T("transformer.wte.weight", ("embedding0.table",)),
                T("transformer.wpe.weight", ("embedding1.table",))]
        for i in range(cfg.size("layers")):
            h, p = f"transformer.h.{i}.", f"layer.{i}."
            a = p + "attention0."
            out += [
                T(h + "ln_1.weight", (p + "layernorm0.gamma",)),
                T(h + "ln_1.bias", (p + "layernorm0.beta",)),
                T(h + "attn.c_attn.weight", (a + "wq", a + "wk", a + "wv"), "cols"),
                T(h + "attn.c_attn.bias", (a + "bq", a + "bk", a + "bv"), "flat"),
                T(h + "attn.c_proj.weight", (a + "wo",), "rows"),
                T(h + "attn.c_proj.bias", (a + "bo",)),
                T(h + "ln_2.weight", (p + "layernorm1.gamma",)),
                T(h + "ln_2.bias", (p + "layernorm1.beta",)),
                T(h + "mlp.c_fc.weight", (p + "mlp0.linear0.weight",)),
                T(h + "mlp.c_fc.bias", (p + "mlp0.linear0.bias",)),
                T(h + "mlp.c_proj.weight", (p + "mlp0.linear1.weight",)),
                T(h + "mlp.c_proj.bias", (p + "mlp0.linear1.bias",)),
            ]
        out += [T("transformer.ln_f.weight", ("layernorm0.gamma",)),
                T("transformer.ln_f.bias", ("layernorm0.beta",))]
    else:
        out.append(T("model.embed_tokens.weight", ("embedding0.table",)))
        for i in range(cfg.size("layers")):
            h, p = f"model.layers.{i}.", f"layer.{i}."
            a, m = p + "attention0.", p + "mlp0."
            out += [T(h + "input_layernorm.weight", (p + "rmsnorm0.gamma",))]
            for x in "qkv":
                out.append(T(h + f"self_attn.{x}_proj.weight", (a + f"w{x}",), "cols_t"))
                if cfg.qkv_bias:
                    out.append(T(h + f"self_attn.{x}_proj.bias", (a + f"b{x}",), "flat"))
            if cfg.qk_norm:
                out += [T(h + "self_attn.q_norm.weight", (a + "q_norm",)),
                        T(h + "self_attn.k_norm.weight", (a + "k_norm",))]
            out.append(T(h + "self_attn.o_proj.weight", (a + "wo",), "rows_t"))
            if cfg.attention_bias:
                out.append(T(h + "self_attn.o_proj.bias", (a + "bo",)))
            out.append(T(h + "post_attention_layernorm.weight", (p + "rmsnorm1.gamma",)))
            if cfg.moe is not None:
                out += moe_tensors(cfg, h, p + "moe0.")
                continue
            for j, x in enumerate(("gate", "up", "down")):
                out.append(T(h + f"mlp.{x}_proj.weight", (m + f"linear{j}.weight",), "t"))
                if cfg.mlp_bias:
                    out.append(T(h + f"mlp.{x}_proj.bias", (m + f"linear{j}.bias",)))
        out.append(T("model.norm.weight", ("rmsnorm0.gamma",)))
    if not cfg.tied:
        head = "lm_head.weight"
        out.append(T(head, ("linear0.weight",), "t"))
    return out


def moe_tensors(cfg: HFConfig, h: str, m: str) -> list[HFTensor]:
    """One layer's router, experts (one tensor per expert and projection, as the hub's
    checkpoints and transformers' save_pretrained write them) and shared expert."""
    T = HFTensor
    mixtral = cfg.family == "mixtral"
    block = h + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = [T(block + "gate.weight", (m + "router",), "t")]
    for e in range(cfg.size("experts")):
        out += [T(f"{block}experts.{e}.{x}.weight", (m + w,), "t", e)
                for x, w in zip(names, ("w1", "w3", "w2"), strict=True)]
    if cfg.moe.shared_gate:
        out += [T(f"{block}shared_expert.{x}.weight", (f"{m}mlp0.linear{j}.weight",), "t")
                for j, x in enumerate(names)]
        out.append(T(block + "shared_expert_gate.weight", (m + "shared_gate",), "row"))
    return out


def to_hf(how: str, parts: list):
    """The Hugging Face tensor from its params' full tensors (torch, or names for labels)."""
    import torch

    if how == "same":
        return parts[0]
    if how == "t":
        return parts[0].T
    if how == "cols":
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
    if how == "flat":
        return torch.cat([p.reshape(-1) for p in parts])
    if how == "rows":
        return parts[0].reshape(-1, parts[0].shape[-1])
    if how == "cols_t":
        return parts[0].reshape(parts[0].shape[0], -1).T
    if how == "rows_t":
        return parts[0].reshape(-1, parts[0].shape[-1]).T
    if how == "row":
        return parts[0].reshape(1, -1)
    raise AssertionError(how)


def from_hf(how: str, t, shapes: list[tuple[int, ...]]) -> list:
    """The params' full tensors (of `shapes`) from their Hugging Face tensor (to_hf inverted)."""
    if how == "same":
        return [t]
    if how == "row":
        return [t.reshape(shapes[0])]
    if how in ("t", "cols_t", "rows_t"):
        return [t.T.reshape(shapes[0])]
    if how == "rows":
        return [t.reshape(shapes[0])]
    sizes = [math.prod(s[1:]) if how == "cols" else math.prod(s) for s in shapes]
    pieces = t.split(sizes, dim=1 if how == "cols" else 0)
    return [x.reshape(s) for x, s in zip(pieces, shapes, strict=True)]


def hf_shape(how: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape from its params' full shapes (to_hf's, without torch)."""
    if how == "same":
        return tuple(shapes[0])
    if how == "t":
        return tuple(reversed(shapes[0]))
    if how == "cols":
        return (shapes[0][0], sum(math.prod(s[1:]) for s in shapes))
    if how == "flat":
        return (sum(math.prod(s) for s in shapes),)
    if how == "rows":
        return (math.prod(shapes[0][:-1]), shapes[0][-1])
    if how == "cols_t":
        return (math.prod(shapes[0][1:]), shapes[0][0])
    if how == "row":
        return (1, *shapes[0])
    return (shapes[0][-1], math.prod(shapes[0][:-1]))  # rows_t


def hf_dims(how: str, dims: list[tuple[str, ...]]) -> list[str]:
    """The labels of a Hugging Face tensor's dims, in soapstone's dim names."""
    def flat(ds):
        return " x ".join(ds)

    if how == "same":
        return list(dims[0])
    if how == "t":
        return list(reversed(dims[0]))
    if how == "cols":
        return [dims[0][0], " + ".join(flat(d[1:]) for d in dims)]
    if how == "flat":
        return [" + ".join(flat(d) for d in dims)]
    if how == "rows":
        return [flat(dims[0][:-1]), dims[0][-1]]
    if how == "cols_t":
        return [flat(dims[0][1:]), dims[0][0]]
    if how == "row":
        return ["1", *dims[0]]
    return [dims[0][-1], flat(dims[0][:-1])]  # rows_t
