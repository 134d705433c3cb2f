"""Hugging Face GPT-2 and LLaMA checkpoints in and out: a `save_pretrained` directory
(config.json + safetensors) <-> a .par model and its full parameters.

- `read_config(DIR)` reads config.json into an `HFConfig` (the model's dims and options);
  a field soapstone cannot express (an activation, rope scaling, ...) is an HFError naming it.
- `spec_text(cfg)` is the .par model that computes what the config describes (examples/gpt2.par
  and examples/llama.par are these texts with layouts); `check_model(model, cfg)` proves a
  checked model is that model (dims first, with the --dim flags that fix them, then every param
  and op), so weights are never poured into a model that computes something else.
- `load(DIR, model)` -> {param name: full tensor} (fp32, soapstone's dim order);
  `save(DIR, model, state)` writes config.json and model.safetensors that transformers loads.
  The tensor correspondence is `tensor_map(cfg)`: per Hugging Face tensor, the params it holds
  and how (transposed, heads flattened, q/k/v side by side); a shape that disagrees names the
  tensor, both shapes and the dim.

No transformers import: the files are read and written with json and safetensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from soapstone.comm.errors import UserError

from . import ir


class HFError(UserError):
    """A Hugging Face directory, config or weight that soapstone cannot use (bad input)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def format(self) -> str:
        """The message, and the hint on its own line."""
        return f"error: {self}" + (f"\nhint: {self.hint}" if self.hint else "")


@attrs.frozen
class HFConfig:
    """What a config.json describes, in soapstone's terms: `kind` (gpt2 | llama), the dims by
    soapstone's names and the layer options."""

    kind: str
    dims: tuple[tuple[str, int], ...]  # vocab, hidden, heads, [kv_heads], ffn, [max_seq], layers
    eps: float
    activation: str = "gelu_tanh"  # gpt2's mlp activation choice
    rope_theta: float = 10000.0
    attention_bias: bool = False  # llama
    mlp_bias: bool = False  # llama
    tied: bool = True
    path: str = ""

    def size(self, dim: str) -> int:
        """A dim's size."""
        return dict(self.dims)[dim]


# config.json's activation_function -> the mlp activation computing it
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
             "relu": "relu", "silu": "silu", "swish": "silu"}
_ACT_NAME = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _field(conf: dict, key: str, path: str, default=None, kind=int):
    value = conf.get(key, default)
    if value is None or (kind is int and (isinstance(value, bool) or not isinstance(value, int))) \
            or (kind is float and not isinstance(value, int | float)):
        raise HFError(f"{path}: field {key!r} is {value!r}; soapstone needs "
                      f"{'an integer' if kind is int else 'a number'} there")
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
    if kind == "llama":
        return _llama_config(conf, str(path))
    raise HFError(f"{path}: field 'model_type' = {json.dumps(kind)} is not supported: soapstone "
                  "imports gpt2 and llama")


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


def _llama_config(conf: dict, path: str) -> HFConfig:
    _must(conf, "hidden_act", lambda v: v == "silu", path, "LLaMA's gated mlp uses silu")
    _must(conf, "rope_scaling", lambda v: v is None, path, "rope computes plain positions "
          "(no scaling)")
    rope = conf.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            raise HFError(f"{path}: field 'rope_parameters' = {json.dumps(rope)} is not "
                          "supported: rope computes plain positions (rope_type default)")
        theta = rope.get("rope_theta", conf.get("rope_theta", 10000.0))
    else:
        theta = conf.get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or theta <= 0:
        raise HFError(f"{path}: rope_theta = {json.dumps(theta)} must be a positive number")
    hidden = _field(conf, "hidden_size", path)
    heads = _field(conf, "num_attention_heads", path)
    kv = _field(conf, "num_key_value_heads", path, heads)
    if hidden % heads:
        raise HFError(f"{path}: hidden_size = {hidden} does not divide over "
                      f"num_attention_heads = {heads}")
    _must(conf, "head_dim", lambda v: v is None or v == hidden // heads, path,
          f"soapstone's head_dim is hidden_size / num_attention_heads = {hidden // heads}")
    if heads % kv:
        raise HFError(f"{path}: num_key_value_heads = {kv} does not divide "
                      f"num_attention_heads = {heads}")
    dims = (("vocab", _field(conf, "vocab_size", path)), ("hidden", hidden), ("heads", heads),
            ("kv_heads", kv), ("ffn", _field(conf, "intermediate_size", path)),
            ("layers", _field(conf, "num_hidden_layers", path)))
    return HFConfig("llama", dims, float(_field(conf, "rms_norm_eps", path, 1e-6, float)),
                    rope_theta=float(theta), attention_bias=bool(conf.get("attention_bias")),
                    mlp_bias=bool(conf.get("mlp_bias")),
                    tied=bool(conf.get("tie_word_embeddings", False)), path=path)


# ---- the .par model ------------------------------------------------------------------------

def _num(x: float) -> str:
    text = repr(float(x))
    return text if "e" in text or "." in text else text + ".0"


def _bool(b: bool) -> str:
    return "true" if b else "false"


def spec_text(cfg: HFConfig, name: str | None = None, batch: int = 8, seq: int = 16) -> str:
    """The .par model computing what `cfg` describes (inputs tokens/targets[batch, seq])."""
    name = name or cfg.kind
    d = dict(cfg.dims)
    tie = "  tie linear0.weight = embedding0.table\n" if cfg.tied else ""
    if cfg.kind == "gpt2":
        eps = "" if cfg.eps == 1e-5 else f", eps = {_num(cfg.eps)}"
        return (
            f"model {name} {{\n"
            f"  dim batch = {batch}, seq = {seq}, max_seq = {d['max_seq']}, "
            f"hidden = {d['hidden']}, heads = {d['heads']}, ffn = {d['ffn']}, "
            f"vocab = {d['vocab']}\n"
            "  input tokens  : i64[batch, seq]\n"
            "  input targets : i64[batch, seq]\n"
            "  x = embedding(tokens, vocab -> hidden) + embedding(positions(seq), "
            "max_seq -> hidden)\n"
            f"  repeat {d['layers']} as layer {{\n"
            f"    x = x + attention(layernorm(x{eps}), heads = heads, causal = true, "
            "qkv_bias = true)\n"
            f"    x = x + mlp(layernorm(x{eps}), ffn, activation = {cfg.activation})\n"
            "  }\n"
            f"  logits = linear(layernorm(x{eps}), hidden -> vocab, bias = false)\n"
            f"{tie}"
            "  output loss = cross_entropy(logits, targets)\n"
            "}\n")
    eps = "" if cfg.eps == 1e-6 else f", eps = {_num(cfg.eps)}"
    ab, mb = _bool(cfg.attention_bias), _bool(cfg.mlp_bias)
    return (
        f"model {name} {{\n"
        f"  dim batch = {batch}, seq = {seq}, hidden = {d['hidden']}, heads = {d['heads']}, "
        f"kv_heads = {d['kv_heads']}, ffn = {d['ffn']}, vocab = {d['vocab']}\n"
        "  input tokens  : i64[batch, seq]\n"
        "  input targets : i64[batch, seq]\n"
        "  x = embedding(tokens, vocab -> hidden)\n"
        f"  repeat {d['layers']} as layer {{\n"
        f"    x = x + attention(rmsnorm(x{eps}), heads = heads, kv_heads = kv_heads, "
        f"rope = {_num(cfg.rope_theta)}, bias = {ab}, qkv_bias = {ab})\n"
        f"    x = x + mlp(rmsnorm(x{eps}), ffn, activation = silu, gated = true, bias = {mb})\n"
        "  }\n"
        f"  logits = linear(rmsnorm(x{eps}), hidden -> vocab, bias = false)\n"
        f"{tie}"
        "  output loss = cross_entropy(logits, targets)\n"
        "}\n")


def reference_model(cfg: HFConfig, like: ir.Model) -> ir.Model:
    """`spec_text(cfg)` checked, with `like`'s name and batch and seq sizes."""
    from .spec import load

    sizes = dict(like.dims)
    text = spec_text(cfg, like.name, sizes.get("batch", 8), sizes.get("seq", 16))
    return load(text, filename=f"<{cfg.kind} from {cfg.path}>").model(like.name)


def check_model(model: ir.Model, cfg: HFConfig, spec: str = "the spec") -> None:
    """HFError unless `model` computes what `cfg` describes: its dims (naming the --dim flags
    that fix them), then its params and ops, compared with `spec_text(cfg)`'s."""
    from .lower import resolve_ties

    _check_dims(dict(model.dims), cfg, spec, model.name, len(model.blocks))
    ref = resolve_ties(reference_model(cfg, model))
    _check_params({p.name: p.type.dims for p in resolve_ties(model).params}, ref, cfg, spec)
    for a, b in zip(model.ops, ref.ops, strict=False):
        if (a.kind, a.attrs, a.type) != (b.kind, b.attrs, b.type):
            raise HFError(f"{spec}: model {model.name} is not the {cfg.kind} {cfg.path} "
                          f"describes: it computes {a.out} = {a.kind}{_attrs(a)} where "
                          f"{b.kind}{_attrs(b)} is expected ({b.out})")
    if len(model.ops) != len(ref.ops):
        raise HFError(f"{spec}: model {model.name} has {len(model.ops)} ops, the {cfg.kind} of "
                      f"{cfg.path} {len(ref.ops)}")


def _check_dims(have: dict[str, int], cfg: HFConfig, spec: str, name: str,
                blocks: int) -> None:
    if blocks != cfg.size("layers"):
        raise HFError(f"{spec}: model {name} repeats {blocks} blocks, but {cfg.path} has "
                      f"{cfg.size('layers')} layers", f"write repeat {cfg.size('layers')} "
                      "as layer (and place the blocks of pipeline layouts)")
    missing = [d for d, _ in cfg.dims if d not in have and d != "layers"]
    if missing:
        raise HFError(f"{spec}: model {name} has no dim {', '.join(missing)}, which "
                      f"{cfg.path} sets; write the model as `soapstone.dsl.hf.spec_text` does "
                      f"(examples/{cfg.kind}.par)")
    wrong = [(d, n) for d, n in cfg.dims if d != "layers" and have[d] != n]
    if wrong:
        said = ", ".join(f"{d} = {have[d]} (config: {n})" for d, n in wrong)
        raise HFError(f"{spec}: model {name}'s dims differ from {cfg.path}: {said}",
                      "run with " + " ".join(f"--dim {d}={n}" for d, n in wrong))


def _check_params(have: dict[str, tuple[str, ...]], ref: ir.Model, cfg: HFConfig,
                  spec: str) -> None:
    """The params (ties resolved) by name and dims are the reference model's."""
    mine = dict(have)
    for p in ref.params:
        dims = mine.pop(p.name, None)
        if dims != p.type.dims:
            got = "missing" if dims is None else f"[{', '.join(dims)}]"
            raise HFError(f"{spec}: model {ref.name} is not the {cfg.kind} {cfg.path} "
                          f"describes: param {_param_text(p)} expected, {got} here")
    if mine:
        extra = next(iter(mine))
        hint = "tie linear0.weight = embedding0.table (tie_word_embeddings)" \
            if cfg.tied and extra == "linear0.weight" else None
        raise HFError(f"{spec}: model {ref.name} has param {extra}, which the {cfg.kind} of "
                      f"{cfg.path} lacks", hint)


def check_graph(directory: str | Path, graph) -> HFConfig:
    """HFError unless the compiled `graph` (any layout) holds the params, by name and dims,
    of the model DIR/config.json describes (what `run --init hf:DIR` checks before launch)."""
    from .lower import resolve_ties

    cfg = read_config(directory)
    prog = graph.stages[0].program
    spec = f"--init hf:{directory}"
    _check_dims(dict(prog.dims), cfg, spec, graph.model,
                sum(len(s.blocks) for s in graph.stages))
    sizes = dict(prog.dims)
    like = ir.Model(graph.model, tuple({**sizes, "batch": graph.batch or 8}.items()), (), (),
                    (), (), ())
    have = {p.name: p.dims for s in graph.stages for p in s.program.params}
    _check_params(have, resolve_ties(reference_model(cfg, like)), cfg, spec)
    return cfg


def _param_text(p: ir.Param) -> str:
    tie = f" tied to {p.tied_to}" if p.tied_to else ""
    return f"{p.name} [{', '.join(p.type.dims)}]{tie}"


def _attrs(op: ir.Op) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in op.attrs) + ")"


def config_of(model: ir.Model) -> HFConfig:
    """The HFConfig a model was written from (what `export` writes as config.json), read off
    its ops: rope means LLaMA, else GPT-2. check_model then proves it describes the model."""
    sizes = dict(model.dims)
    kinds = {op.kind for op in model.ops}
    tied = any(p.tied_to for p in model.params)
    layers = len(model.blocks)
    norm = next((op for op in model.ops if op.kind in ("layernorm", "rmsnorm")), None)
    eps = float(norm.attr("eps")) if norm is not None else 1e-5
    try:
        if "rope" in kinds:
            theta = next(float(op.attr("theta")) for op in model.ops if op.kind == "rope")
            names = {p.name.split(".")[-1] for p in model.params}
            dims = tuple((d, sizes[d]) for d in ("vocab", "hidden", "heads", "kv_heads", "ffn"))
            return HFConfig("llama", (*dims, ("layers", layers)), eps, rope_theta=theta,
                            attention_bias="bq" in names, mlp_bias="bias" in names, tied=tied,
                            path=f"model {model.name}")
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
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": d["vocab"], "hidden_size": d["hidden"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"],
        "head_dim": d["hidden"] // d["heads"], "intermediate_size": d["ffn"],
        "num_hidden_layers": d["layers"], "hidden_act": "silu", "rms_norm_eps": cfg.eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tied, "attention_dropout": 0.0, "dtype": "float32",
    }


# ---- the tensors ---------------------------------------------------------------------------

@attrs.frozen
class HFTensor:
    """One Hugging Face tensor and the params it holds. how:
    same      the param as is
    t         the param transposed ([in, out] -> nn.Linear's [out, in])
    cols      params [a, *rest] side by side as [a, sum of prod(rest)] (GPT-2's c_attn)
    flat      params flattened and concatenated (GPT-2's c_attn bias, LLaMA's q/k/v bias)
    rows      [*lead, b] -> [prod(lead), b] (GPT-2's attention c_proj from wo)
    cols_t    [a, *rest] -> [prod(rest), a] (LLaMA's q/k/v_proj from wq, wk, wv)
    rows_t    [*lead, b] -> [b, prod(lead)] (LLaMA's o_proj from wo)"""

    name: str
    params: tuple[str, ...]
    how: str = "same"


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
                if cfg.attention_bias:
                    out.append(T(h + f"self_attn.{x}_proj.bias", (a + f"b{x}",), "flat"))
            out.append(T(h + "self_attn.o_proj.weight", (a + "wo",), "rows_t"))
            if cfg.attention_bias:
                out.append(T(h + "self_attn.o_proj.bias", (a + "bo",)))
            out.append(T(h + "post_attention_layernorm.weight", (p + "rmsnorm1.gamma",)))
            for j, x in enumerate(("gate", "up", "down")):
                out.append(T(h + f"mlp.{x}_proj.weight", (m + f"linear{j}.weight",), "t"))
                if cfg.mlp_bias:
                    out.append(T(h + f"mlp.{x}_proj.bias", (m + f"linear{j}.bias",)))
        out.append(T("model.norm.weight", ("rmsnorm0.gamma",)))
    if not cfg.tied:
        head = "lm_head.weight"
        out.append(T(head, ("linear0.weight",), "t"))
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
    raise AssertionError(how)


def from_hf(how: str, t, shapes: list[tuple[int, ...]]) -> list:
    """The params' full tensors (of `shapes`) from their Hugging Face tensor (to_hf inverted)."""
    if how == "same":
        return [t]
    if how in ("t", "cols_t", "rows_t"):
        return [t.T.reshape(shapes[0])]
    if how == "rows":
        return [t.reshape(shapes[0])]
    sizes = [math.prod(s[1:]) if how == "cols" else math.prod(s) for s in shapes]
    pieces = t.split(sizes, dim=1 if how == "cols" else 0)
    return [x.reshape(s) for x, s in zip(pieces, shapes, strict=True)]


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
    return [dims[0][-1], flat(dims[0][:-1])]  # rows_t


# buffers some checkpoints carry that are no parameters (GPT-2's causal mask, rotary tables)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index}: not a safetensors index ({e})") from None
        return {k: directory / v for k, v in wmap.items()}
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), "pt") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as e:  # noqa: BLE001 - a corrupt file is bad input
            raise HFError(f"{single}: not a safetensors file ({e})") from None
    hint = " (it has pytorch_model.bin: save with safe_serialization=True)" \
        if (directory / "pytorch_model.bin").exists() else ""
    raise HFError(f"{directory}: no model.safetensors or model.safetensors.index.json{hint}")


def load(directory: str | Path, model: ir.Model, spec: str = "the spec") -> dict:
    """The full fp32 tensors, by param name, of a save_pretrained directory for `model`
    (checked against its config.json first). Tied params are absent: their target holds them."""
    cfg = read_config(directory)
    check_model(model, cfg, spec)
    from .lower import resolve_ties

    sizes = dict(model.dims)
    params = {p.name: (p.type.dims, tuple(sizes[d] for d in p.type.dims))
              for p in resolve_ties(model).params}
    return read_weights(directory, cfg, params)


def read_weights(directory: str | Path, cfg: HFConfig,
                 params: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> dict:
    """{param name: full fp32 tensor} from DIR's safetensors for params (name -> (dims,
    shape)); a tensor missing, unknown or of another shape is an HFError naming it."""
    import torch
    from safetensors import safe_open

    directory = Path(directory)
    files = _weight_files(directory)
    wanted = tensor_map(cfg)
    known = {t.name for t in wanted}
    for name in files:
        if name not in known and not name.endswith(_BUFFERS) and not (
                cfg.tied and name == "lm_head.weight"):
            raise HFError(f"{files[name]}: tensor {name} has no place in the {cfg.kind} of "
                          f"{cfg.path}", "the config and the weights disagree")
    state: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    for t in wanted:
        if t.name not in files:
            raise HFError(f"{directory}: the weights lack tensor {t.name} (holding "
                          f"{', '.join(t.params)})")
        f = files[t.name]
        if f not in handles:
            handles[f] = safe_open(str(f), "pt")
        x = handles[f].get_tensor(t.name).to(torch.float32)
        shapes = [params[n][1] for n in t.params]
        want = tuple(to_hf(t.how, [torch.empty(s, device="meta") for s in shapes]).shape)
        if tuple(x.shape) != want:
            _shape_error(f, t, tuple(x.shape), want,
                         hf_dims(t.how, [params[n][0] for n in t.params]))
        for n, v in zip(t.params, from_hf(t.how, x, shapes), strict=True):
            state[n] = v.contiguous()
    return state


class _StateReader:
    """The checkpoint reader protocol (read(key, box, dtype)) over full tensors in memory."""

    def __init__(self, state: dict):
        self.state = state
        self.bytes_read = 0

    def read(self, tensor: str, box, dtype):
        """The region `box` of param `tensor` ("param/NAME")."""
        full = self.state[tensor.split("/", 1)[1]]
        part = full[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))]
        self.bytes_read += part.numel() * part.element_size()
        return part.to(dtype)


def load_init(executor, directory: str) -> str:
    """`run --init hf:DIR`: DIR's weights into `executor` (any layout: each rank copies its
    slices); a line saying what was loaded."""
    from soapstone.shard.checkpoint.load import fill

    cfg = check_graph(directory, executor.graph)
    params = {p.name: (p.dims, p.shape) for s in executor.graph.stages
              for p in s.program.params}
    state = read_weights(directory, cfg, params)
    fill(executor, _StateReader(state), ("param",))
    return f"hf:{directory}: {len(state)} parameters of a Hugging Face {cfg.kind}"


def _shape_error(file: Path, t: HFTensor, got, want, labels: list[str]) -> None:
    if len(got) != len(want):
        raise HFError(f"{file}: tensor {t.name} has shape {list(got)}, the model expects "
                      f"{list(want)} ({', '.join(labels)}): {len(got)} dims, not {len(want)}")
    j = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    raise HFError(f"{file}: tensor {t.name} has shape {list(got)}, the model expects "
                  f"{list(want)} ({', '.join(labels)}): dim {j} ({labels[j]}) is {got[j]} "
                  f"there and {want[j]} here",
                  f"make config.json and the weights agree on {labels[j]}")


def save(directory: str | Path, model: ir.Model, state: dict) -> HFConfig:
    """Write `state` (full tensors by param name; tied params may be absent) as a save_pretrained
    directory transformers loads: config.json and model.safetensors."""
    import torch
    from safetensors.torch import save_file

    cfg = config_of(model)
    check_model(model, cfg)
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HFError(f"--hf {directory}: cannot create the directory ({e})") from None
    out = {}
    for t in tensor_map(cfg):
        missing = [n for n in t.params if n not in state]
        if missing:
            raise HFError(f"the parameters lack {missing[0]} (Hugging Face's {t.name})")
        x = to_hf(t.how, [state[n].detach().to(torch.float32).cpu() for n in t.params])
        out[t.name] = x.contiguous().clone()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    return cfg
