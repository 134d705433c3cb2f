"""A Hugging Face GPT-2, LLaMA or MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) config.json in
soapstone's terms (`HFConfig`): read from a save_pretrained directory (`read_config`; a field
soapstone cannot express, an activation, rope scaling, ..., is an HFError naming it), read off
a .par model (`config_of`), and written (`config_json`). No transformers import.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from soapstone.comm.errors import UserError
from soapstone.dsl.model import ir
from soapstone.shard.plan.sizes import MAX_DIM


class HFError(UserError):
    """A Hugging Face directory, config or weight that soapstone cannot use (bad input)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def format(self) -> str:
        """The message, and the hint on its own line."""
        return f"error: {self}" + (f"\nhint: {self.hint}" if self.hint else "")


@attrs.frozen
class MoE:
    """A sparse MLP's router conventions (every layer's): top_k experts per token after a
    softmax over all of them, `normalize`d to sum 1 or not (norm_topk_prob; Mixtral always),
    a shared expert whose output a sigmoid gates per token (Qwen2-MoE). Its dims (experts,
    the experts' ffn, the shared expert's width `shared`) are HFConfig.dims."""

    top_k: int
    normalize: bool
    shared_gate: bool = False


@attrs.frozen
class HFConfig:
    """What a config.json describes, in soapstone's terms: `kind` (gpt2 | llama), the dims by
    soapstone's names and the layer options."""

    kind: str
    # vocab, hidden, heads, [kv_heads, head_dim], ffn, [max_seq], layers
    dims: tuple[tuple[str, int], ...]
    eps: float
    activation: str = "gelu_tanh"  # gpt2's mlp activation choice
    rope_theta: float = 10000.0
    # LLaMA-3's rope frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), None without
    rope_scaling: tuple[float, float, float, int] | None = None
    attention_bias: bool = False  # llama: o_proj's bias
    mlp_bias: bool = False  # llama
    tied: bool = True
    path: str = ""
    family: str = ""  # config.json's model_type (llama, mistral, qwen2 share kind llama)
    qkv_bias: bool = False  # llama's attention_bias, qwen2 always: q/k/v_proj's biases
    window: int | None = None  # sliding-window attention (mistral, qwen2): keys per query
    qk_norm: bool = False  # qwen3: q and k RMS-normed per head (with eps)
    moe: MoE | None = None  # mixtral, qwen2_moe, qwen3_moe: every layer's MLP is sparse

    def size(self, dim: str) -> int:
        """A dim's size."""
        return dict(self.dims)[dim]


# config.json's activation_function -> the mlp activation computing it
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
             "relu": "relu", "silu": "silu", "swish": "silu"}
_ACT_NAME = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _field(conf: dict, key: str, path: str, default=None, kind=int, noun="integer"):
    """A numeric field: an int is a size or a count (>= 1), a float an epsilon (> 0, finite);
    anything else is an HFError naming the field before a layer divides by it."""
    value = conf.get(key, default)
    if value is None or isinstance(value, bool) \
            or (kind is int and not isinstance(value, int)) \
            or (kind is float and not isinstance(value, int | float)):
        raise HFError(f"{path}: field {key!r} is {value!r}; soapstone needs "
                      f"{'an integer' if kind is int else 'a number'} there")
    if kind is int and not 1 <= value <= MAX_DIM:
        raise HFError(f"{path}: field {key!r} = {json.dumps(value)} must be a positive {noun} "
                      f"(at most {MAX_DIM}): it is a size or a count",
                      f"fix {key!r} in {path}")
    if kind is float and not (math.isfinite(value) and value > 0):
        raise HFError(f"{path}: field {key!r} = {json.dumps(value)} must be a finite number "
                      "above 0: it is an epsilon added before a root",
                      f"fix {key!r} in {path}, e.g. {json.dumps(default)}")
    return value


def _must(conf: dict, key: str, ok, path: str, why: str) -> None:
    if key in conf and not ok(conf[key]):
        raise HFError(f"{path}: field {key!r} = {json.dumps(conf[key])} is not supported: {why}")


def read_config(directory: str | Path) -> HFConfig:
    """The config.json of a save_pretrained directory (GPT-2 or LLaMA) as an HFConfig."""
    path = Path(directory) / "config.json"
    try:
        conf = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{path}: no such file; --init hf:DIR needs a directory that "
                      "save_pretrained wrote (config.json + model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(conf, dict):
        raise HFError(f"{path}: not a JSON object")
    kind = conf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(conf, str(path))
    if kind in LLAMA_FAMILY:
        return _moe_config(_llama_config(conf, str(path), kind), conf) if kind in MOE_FAMILY \
            else _llama_config(conf, str(path), kind)
    raise HFError(f"{path}: field 'model_type' = {json.dumps(kind)} is not supported: soapstone "
                  f"imports gpt2, {', '.join(LLAMA_FAMILY)}")


# model types computed by examples/llama.par's model and its arguments: model_type ->
# (architecture, q/k/v biases fixed by the family or None: the attention_bias field)
LLAMA_FAMILY = {"llama": ("LlamaForCausalLM", None), "mistral": ("MistralForCausalLM", False),
                "qwen2": ("Qwen2ForCausalLM", True), "qwen3": ("Qwen3ForCausalLM", None),
                "mixtral": ("MixtralForCausalLM", False),
                "qwen2_moe": ("Qwen2MoeForCausalLM", True),  # its qkv_bias field: _moe_config
                "qwen3_moe": ("Qwen3MoeForCausalLM", None)}
QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # their window: use_sliding_window
# the families whose every layer's MLP is a router and experts: model_type -> (the experts'
# count field, the experts' width field, whether a sigmoid-gated shared expert is there)
MOE_FAMILY = {"mixtral": ("num_local_experts", "intermediate_size", False),
              "qwen2_moe": ("num_experts", "moe_intermediate_size", True),
              "qwen3_moe": ("num_experts", "moe_intermediate_size", False)}


def _gpt2_config(conf: dict, path: str) -> HFConfig:
    act = conf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise HFError(f"{path}: field 'activation_function' = {json.dumps(act)} is not "
                      f"supported: soapstone's mlp computes {', '.join(sorted(_GPT2_ACT))}")
    _must(conf, "scale_attn_weights", lambda v: v is True, path, "attention scores are scaled "
          "by 1/sqrt(head_dim)")
    _must(conf, "scale_attn_by_inverse_layer_idx", lambda v: not v, path,
          "no per-layer attention scaling")
    _must(conf, "add_cross_attention", lambda v: not v, path, "no cross-attention")
    hidden = _field(conf, "n_embd", path)
    heads = _field(conf, "n_head", path)
    inner = conf.get("n_inner")
    ffn = 4 * hidden if inner is None else _field(conf, "n_inner", path)
    if hidden % heads:
        raise HFError(f"{path}: n_embd = {hidden} does not divide over n_head = {heads}")
    dims = (("vocab", _field(conf, "vocab_size", path)),
            ("max_seq", _field(conf, "n_positions", path)), ("hidden", hidden),
            ("heads", heads), ("ffn", ffn), ("layers", _field(conf, "n_layer", path)))
    return HFConfig("gpt2", dims, float(_field(conf, "layer_norm_epsilon", path, 1e-5, float)),
                    activation=_GPT2_ACT[act], tied=bool(conf.get("tie_word_embeddings", True)),
                    path=path)


def _window(conf: dict, path: str, family: str, layers: int) -> int | None:
    """The sliding window every layer has, or None; one that only some layers have (Qwen2's
    max_window_layers, alternating layer_types) is an HFError naming the field."""
    window = conf.get("sliding_window")
    if family in QWEN and not conf.get("use_sliding_window"):
        window = None
    if family == "llama":
        return None  # LlamaForCausalLM reads no window
    kinds = conf.get("layer_types")
    if kinds is None and window is not None and family in QWEN:
        first = conf.get("max_window_layers", layers)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise HFError(f"{path}: field 'max_window_layers' = {json.dumps(first)} must be a "
                          "number of layers (0 or more)")
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if family == "qwen2_moe":  # every other layer below max_window_layers slides
            kinds = ["sliding_attention" if i % 2 == 0 and i < first else "full_attention"
                     for i in range(layers)]
        elif family == "qwen3_moe":  # every layer slides
            kinds = ["sliding_attention"] * layers
    if kinds is not None and window is not None:
        if len(set(kinds)) > 1:
            raise HFError(f"{path}: field 'layer_types' = {json.dumps(kinds)} is not supported: "
                          "soapstone's repeated blocks all attend alike (all sliding or none)")
        if kinds and kinds[0] != "sliding_attention":
            window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= MAX_DIM):
        raise HFError(f"{path}: field 'sliding_window' = {json.dumps(window)} must be a "
                      f"positive number of positions, at most {MAX_DIM} (or null)")
    return window


def _llama_config(conf: dict, path: str, family: str = "llama") -> HFConfig:
    _must(conf, "hidden_act", lambda v: v == "silu", path, "LLaMA's gated mlp uses silu")
    theta, scaling = _rope(conf, path)
    hidden = _field(conf, "hidden_size", path)
    heads = _field(conf, "num_attention_heads", path)
    kv = _field(conf, "num_key_value_heads", path, heads)
    head_dim = conf.get("head_dim")
    if head_dim is None and hidden % heads:
        raise HFError(f"{path}: hidden_size = {hidden} does not divide over "
                      f"num_attention_heads = {heads}, and no head_dim says each head's width")
    head_dim = hidden // heads if head_dim is None else _field(conf, "head_dim", path,
                                                               noun="width")
    if heads % kv:
        raise HFError(f"{path}: num_key_value_heads = {kv} does not divide "
                      f"num_attention_heads = {heads}")
    dims = (("vocab", _field(conf, "vocab_size", path)), ("hidden", hidden), ("heads", heads),
            ("kv_heads", kv), ("head_dim", head_dim),
            ("ffn", _field(conf, "intermediate_size", path)),
            ("layers", _field(conf, "num_hidden_layers", path)))
    fixed = LLAMA_FAMILY[family][1]
    qkv = bool(conf.get("attention_bias")) if fixed is None else fixed
    return HFConfig("llama", dims, float(_field(conf, "rms_norm_eps", path, 1e-6, float)),
                    rope_theta=float(theta), rope_scaling=scaling,
                    attention_bias=qkv if fixed is None else False,
                    mlp_bias=bool(conf.get("mlp_bias")) if family == "llama" else False,
                    tied=bool(conf.get("tie_word_embeddings", False)), path=path,
                    family=family, qkv_bias=qkv, qk_norm=family == "qwen3",
                    window=_window(conf, path, family, dict(dims)["layers"]))


def _moe_config(cfg: HFConfig, conf: dict) -> HFConfig:
    """`cfg` (read as a LLaMA) with its MLPs sparse: the experts' dims and router conventions
    of a MOE_FAMILY config; a field soapstone's moe cannot compute is an HFError naming it."""
    path, family = cfg.path, cfg.family
    count, width, has_shared = MOE_FAMILY[family]
    # Qwen3MoeConfig writes num_experts as num_local_experts (its attribute_map)
    count = next((k for k in ("num_experts", "num_local_experts") if k in conf), count)
    experts, top_k = _field(conf, count, path), _field(conf, "num_experts_per_tok", path)
    if not 1 <= top_k <= experts:
        raise HFError(f"{path}: num_experts_per_tok = {top_k} must be between 1 and "
                      f"{count} = {experts}")
    _must(conf, "decoder_sparse_step", lambda v: v == 1, path, "soapstone's repeated blocks "
          "are alike: every layer's MLP is the router and experts (decoder_sparse_step 1)")
    _must(conf, "mlp_only_layers", lambda v: not v, path, "soapstone's repeated blocks are "
          "alike: no layer's MLP is dense (mlp_only_layers [])")
    _must(conf, "output_router_logits", lambda v: not v, path, "transformers then adds its "
          "balance loss over every layer's router logits to the loss; moe's `aux` is Switch's "
          "per layer (set it false, transformers' default: no balance loss)")
    _must(conf, "router_jitter_noise", lambda v: not v, path, "soapstone's router multiplies "
          "no noise into its input in training (router_jitter_noise 0)")
    sizes = {"experts": experts}
    if has_shared:
        sizes["shared"] = _field(conf, "shared_expert_intermediate_size", path)
    ffn = _field(conf, width, path)
    dims = tuple((d, ffn if d == "ffn" else n) for d, n in cfg.dims if d != "layers")
    moe = MoE(top_k, family == "mixtral" or bool(conf.get("norm_topk_prob", False)),
              shared_gate=has_shared)
    qkv = bool(conf.get("qkv_bias", True)) if family == "qwen2_moe" else cfg.qkv_bias
    return attrs.evolve(cfg, dims=(*dims, *sizes.items(), ("layers", cfg.size("layers"))),
                        moe=moe, qkv_bias=qkv, qk_norm=family == "qwen3_moe")


def _rope(conf: dict, path: str) -> tuple[float, tuple | None]:
    """(rope_theta, LLaMA-3 scaling or None) from rope_scaling (transformers 4) or
    rope_parameters (transformers 5); another rope type is an HFError naming the field."""
    theta = conf.get("rope_theta", 10000.0)
    scaling = None
    for key in ("rope_scaling", "rope_parameters"):  # each present one must be computable
        rope = conf.get(key)
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
            else None
        if kind not in ("default", "llama3"):
            raise HFError(f"{path}: field {key!r} = {json.dumps(rope)} is not supported: rope "
                          "computes plain positions (rope_type default) or LLaMA-3's scaling "
                          "(rope_type llama3)")
        theta = rope.get("rope_theta", theta)
        part = rope.get("partial_rotary_factor", conf.get("partial_rotary_factor", 1.0))
        if part not in (1, 1.0):  # rotating only part of head_dim: rope rotates all of it
            raise HFError(f"{path}: field {key!r} has partial_rotary_factor = "
                          f"{json.dumps(part)}, which is not supported: rope rotates the whole "
                          "head_dim (partial_rotary_factor 1)")
        if kind == "llama3":
            scaling = _llama3(rope, key, path)
    if isinstance(theta, bool) or not isinstance(theta, int | float) \
            or not (math.isfinite(theta) and theta > 0):
        raise HFError(f"{path}: rope_theta = {json.dumps(theta)} must be a finite positive "
                      "number")
    return float(theta), scaling


def _llama3(rope: dict, key: str, path: str) -> tuple[float, float, float, int]:
    """The llama3 rope type's four numbers, each checked."""
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    vals = []
    for name in names:
        v = rope.get(name)
        if isinstance(v, bool) or not isinstance(v, int | float) \
                or not (math.isfinite(v) and 0 < v <= MAX_DIM):
            raise HFError(f"{path}: field {key!r} has {name} = {json.dumps(v)}; the llama3 "
                          f"rope type needs a finite positive number there (at most {MAX_DIM})")
        vals.append(v)
    factor, low, high, original = vals
    if not low < high or factor < 1:
        raise HFError(f"{path}: field {key!r} = {json.dumps(rope)} is not supported: llama3 "
                      "scaling needs factor >= 1 and low_freq_factor < high_freq_factor")
    return float(factor), float(low), float(high), int(original)


def config_of(model: ir.Model) -> HFConfig:
    """The HFConfig a model was written from (what `export` writes as config.json), read off
    its ops: rope means LLaMA, else GPT-2. check_model then proves it describes the model."""
    sizes = dict(model.dims)
    loss = next((op for op in model.ops if op.kind == "cross_entropy"), None)
    if loss is not None and loss.attr("classes") is not None:
        sizes["vocab"] = int(loss.attr("classes"))  # a padded vocab: the config's is the real
    kinds = {op.kind for op in model.ops}
    tied = any(p.tied_to for p in model.params)
    layers = len(model.blocks)
    norm = next((op for op in model.ops if op.kind in ("layernorm", "rmsnorm")), None)
    eps = float(norm.attr("eps")) if norm is not None else 1e-5
    try:
        if "rope" in kinds:
            rope = next(op for op in model.ops if op.kind == "rope")
            theta = float(rope.attr("theta"))
            scaling = None if rope.attr("factor") is None else (
                float(rope.attr("factor")), float(rope.attr("low_freq")),
                float(rope.attr("high_freq")), int(rope.attr("original_max")))
            names = {p.name.split(".")[-1] for p in model.params}
            dims = tuple((d, sizes[d]) for d in ("vocab", "hidden", "heads", "kv_heads",
                                                 "head_dim", "ffn"))
            mask = next((op for op in model.ops if op.kind == "causal_mask"), None)
            window = mask.attr("window") if mask is not None else None
            qkv, o, mlp = "bq" in names, "bo" in names, "bias" in names
            qk = "q_norm" in names
            moe = _moe_of(model, sizes)
            if moe is not None:
                family = _moe_family(model.name, moe[0], qkv, o, mlp, qk)
                dims = (*dims, *moe[1])
            else:
                family = "qwen3" if qk else _family(model.name, qkv, o, mlp, window)
            return HFConfig("llama", (*dims, ("layers", layers)), eps, rope_theta=theta,
                            rope_scaling=scaling, attention_bias=o, mlp_bias=mlp, tied=tied,
                            path=f"model {model.name}", family=family, qkv_bias=qkv,
                            window=window, qk_norm=qk, moe=moe and moe[0])
        act = next((op for op in model.ops if op.kind in ("gelu", "relu", "silu")
                    and op.layer == "mlp"), None)
        activation = "gelu_tanh" if act is not None and act.attr("approximate") == "tanh" \
            else (act.kind if act is not None else "gelu_tanh")
        dims = tuple((d, sizes[d]) for d in ("vocab", "max_seq", "hidden", "heads", "ffn"))
        return HFConfig("gpt2", (*dims, ("layers", layers)), eps, activation=activation,
                        tied=tied, path=f"model {model.name}")
    except KeyError as e:
        raise HFError(f"model {model.name} has no dim {e.args[0]}: only models written as "
                      "examples/gpt2.par or examples/llama.par export to Hugging Face") from None


def _family(name: str, qkv: bool, o: bool, mlp: bool, window) -> str:
    """The model_type whose config can say what the model computes (biases, window)."""
    if qkv and not o and not mlp:
        return "qwen2"  # q/k/v biases alone; qwen2 also has a window setting
    if window is None:
        if qkv != o:
            raise HFError(f"model {name} has {'q/k/v' if qkv else 'o_proj'} biases alone "
                          "with an mlp bias: no Hugging Face family computes that")
        return "llama"
    if qkv or o or mlp:
        raise HFError(f"model {name} has a sliding window and biases: Mistral (the window) "
                      "has no biases; no Hugging Face family computes that")
    return "mistral"


def _moe_of(model: ir.Model, sizes: dict) -> tuple[MoE, tuple] | None:
    """A model's router conventions and expert dims, read off its (first) moe op; None
    without one (check_model then proves every layer's is the same)."""
    op = next((op for op in model.ops if op.kind == "moe"), None)
    if op is None:
        return None
    gated = any(o.kind == "sigmoid" and o.layer == "moe" for o in model.ops)
    dims = (("experts", sizes["experts"]),) + ((("shared", sizes["shared"]),) if gated else ())
    return MoE(int(op.attr("top_k")), bool(op.attr("normalize", False)), gated), dims


def _moe_family(name: str, moe: MoE, qkv: bool, o: bool, mlp: bool, qk: bool) -> str:
    """The MoE model_type whose config can say what the model computes."""
    if moe.shared_gate and not (o or mlp or qk):
        return "qwen2_moe"  # its qkv_bias field says whether q/k/v have biases
    if qk and not mlp and qkv == o and not moe.shared_gate:
        return "qwen3_moe"
    if moe.normalize and not (qkv or o or mlp or qk or moe.shared_gate):
        return "mixtral"
    raise HFError(f"model {name}'s moe and attention match no Hugging Face family: Mixtral "
                  "normalizes the top-k weights and has no biases, Qwen3-MoE has q/k norms, "
                  "Qwen2-MoE a sigmoid-gated shared expert (shared_gate) and no o_proj bias")


def _moe_json(cfg: HFConfig) -> dict:
    """A MoE family's own config.json fields: the experts and their router, its window."""
    d, m, family = dict(cfg.dims), cfg.moe, cfg.family
    window = cfg.window is not None
    conf = {"num_experts_per_tok": m.top_k, "output_router_logits": False,
            "router_aux_loss_coef": 0.0}  # transformers adds no balance loss (moe aux 0)
    if family == "mixtral":
        return conf | {"num_local_experts": d["experts"], "router_jitter_noise": 0.0}
    conf |= {"num_experts": d["experts"], "moe_intermediate_size": d["ffn"],
             "norm_topk_prob": m.normalize, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "use_sliding_window": window, "sliding_window": cfg.window}
    if family == "qwen2_moe":
        kind = "sliding_attention" if window else "full_attention"
        return conf | {"qkv_bias": cfg.qkv_bias, "layer_types": [kind] * d["layers"],
                       "shared_expert_intermediate_size": d["shared"],
                       "max_window_layers": d["layers"]}
    return conf | {"attention_bias": cfg.attention_bias}


def config_json(cfg: HFConfig) -> dict:
    """The config.json transformers reads for `cfg` (dropout off: the model has none)."""
    d = dict(cfg.dims)
    if cfg.kind == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": d["vocab"], "n_positions": d["max_seq"], "n_embd": d["hidden"],
            "n_layer": d["layers"], "n_head": d["heads"], "n_inner": d["ffn"],
            "activation_function": _ACT_NAME[cfg.activation],
            "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tied,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "dtype": "float32",
        }
    family = cfg.family or "llama"
    conf = {
        "architectures": [LLAMA_FAMILY[family][0]], "model_type": family,
        "vocab_size": d["vocab"], "hidden_size": d["hidden"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"], "intermediate_size": d["ffn"],
        "num_hidden_layers": d["layers"], "hidden_act": "silu", "rms_norm_eps": cfg.eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tied, "attention_dropout": 0.0, "dtype": "float32",
    }
    if family == "llama":
        conf |= {"attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias}
    elif family in ("mistral", "mixtral"):
        conf["sliding_window"] = cfg.window
    else:  # qwen2, qwen3: every layer slides when the model has a window
        if family == "qwen3":
            conf["attention_bias"] = cfg.attention_bias
        conf |= {"use_sliding_window": cfg.window is not None, "sliding_window": cfg.window,
                 "max_window_layers": 0}
    if cfg.moe is not None:
        conf = {k: v for k, v in conf.items() if k != "max_window_layers"} | _moe_json(cfg)
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        conf["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                "high_freq_factor": high,
                                "original_max_position_embeddings": original}
        # the context the scaling stretches to (LLaMA-3.1 writes the same product)
        conf["max_position_embeddings"] = int(original * factor)
    return conf
