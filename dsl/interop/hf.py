"""Hugging Face GPT-2 and LLaMA checkpoints in and out (and LLaMA's kin: Mistral, Qwen2/3, and
the MoE families Mixtral, Qwen2-MoE, Qwen3-MoE): a `save_pretrained` directory (config.json +
safetensors) <-> a .par model and its full parameters.

- `read_config(DIR)` reads config.json into an `HFConfig` (the model's dims and options;
  hf_config.py); a field soapstone cannot express (an activation, rope scaling, ...) is an
  HFError naming it.
- `spec_text(cfg)` is the .par model that computes what the config describes (examples/gpt2.par
  and examples/llama.par are these texts with layouts); `check_model(model, cfg)` proves a
  checked model is that model (dims first, with the --dim flags that fix them, then every param
  and op), so weights are never poured into a model that computes something else.
- `load(DIR, model)` -> {param name: full tensor} (fp32, soapstone's dim order);
  `save(DIR, model, state)` writes config.json and model.safetensors that transformers loads.
  The tensor correspondence is `tensor_map(cfg)` (hf_tensors.py): per Hugging Face tensor, the
  params it holds and how (transposed, heads flattened, q/k/v side by side); a shape that
  disagrees names the tensor, both shapes and the dim.

No transformers import: the files are read and written with json and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from soapstone.dsl.interop.hf_config import HFConfig, HFError, config_json, config_of, read_config
from soapstone.dsl.interop.hf_fields import (
    HFMismatch,
    field_of_param,
    mismatch_of_head_dim,
    mismatch_of_op,
    place_of_param,
)
from soapstone.dsl.interop.hf_files import check_tensors, read_headers
from soapstone.dsl.interop.hf_reader import HFReader
from soapstone.dsl.interop.hf_tensors import hf_dims, hf_shape, tensor_map, to_hf
from soapstone.dsl.model import ir

# ---- the .par model ------------------------------------------------------------------------

def _num(x: float) -> str:
    text = repr(float(x))
    return text if "e" in text or "." in text else text + ".0"


def _bool(b: bool) -> str:
    return "true" if b else "false"


def spec_text(cfg: HFConfig, name: str | None = None, batch: int = 8, seq: int = 16,
              vocab: int | None = None) -> str:
    """The .par model computing what `cfg` describes (inputs tokens/targets[batch, seq]);
    `vocab` > the config's pads the vocab (Megatron's): cross_entropy's classes are the real
    ones, the padded rows of the tables zeros."""
    name = name or cfg.kind
    d = dict(cfg.dims)
    loss = "  output loss = cross_entropy(logits, targets)\n"
    if vocab is not None and vocab > d["vocab"]:
        loss = f"  output loss = cross_entropy(logits, targets, classes = {d['vocab']})\n"
        d["vocab"] = vocab
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
            f"{tie}{loss}"
            "}\n")
    eps = "" if cfg.eps == 1e-6 else f", eps = {_num(cfg.eps)}"
    ab, qb, mb = _bool(cfg.attention_bias), _bool(cfg.qkv_bias), _bool(cfg.mlp_bias)
    window = f", window = {cfg.window}" if cfg.window is not None else ""
    if cfg.qk_norm:
        window += f", qk_norm = {_num(cfg.eps)}"
    if d["head_dim"] * d["heads"] != d["hidden"]:  # heads x head_dim wider or narrower
        window += f", head_dim = {d['head_dim']}"
    scaled = ""
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        scaled = (f", rope_factor = {_num(factor)}, rope_low_freq = {_num(low)}, "
                  f"rope_high_freq = {_num(high)}, rope_original_max = {original}")
    moe_dims = "".join(f", {k} = {d[k]}" for k in ("experts", "shared") if k in d)
    return (
        f"model {name} {{\n"
        f"  dim batch = {batch}, seq = {seq}, hidden = {d['hidden']}, heads = {d['heads']}, "
        f"kv_heads = {d['kv_heads']}, ffn = {d['ffn']}{moe_dims}, vocab = {d['vocab']}\n"
        "  input tokens  : i64[batch, seq]\n"
        "  input targets : i64[batch, seq]\n"
        "  x = embedding(tokens, vocab -> hidden)\n"
        f"  repeat {d['layers']} as layer {{\n"
        f"    x = x + attention(rmsnorm(x{eps}), heads = heads, kv_heads = kv_heads, "
        f"rope = {_num(cfg.rope_theta)}{scaled}, bias = {ab}, qkv_bias = {qb}{window})\n"
        f"    x = x + {_mlp_call(cfg, f'rmsnorm(x{eps})', mb)}\n"
        "  }\n"
        f"  logits = linear(rmsnorm(x{eps}), hidden -> vocab, bias = false)\n"
        f"{tie}{loss}"
        "}\n")


def _mlp_call(cfg: HFConfig, x: str, bias: str) -> str:
    """A block's MLP on x: LLaMA's gated silu, or a MoE family's router and SwiGLU experts
    (no capacity, no balance loss: transformers' forward and loss)."""
    if cfg.moe is None:
        return f"mlp({x}, ffn, activation = silu, gated = true, bias = {bias})"
    m = cfg.moe
    shared = ", shared = shared, shared_gate = true" if m.shared_gate else ""
    return (f"moe({x}, experts, ffn, top_k = {m.top_k}, capacity = 0.0, aux = 0.0, "
            f"activation = swiglu, normalize = {_bool(m.normalize)}{shared})")


def reference_model(cfg: HFConfig, like: ir.Model) -> ir.Model:
    """`spec_text(cfg)` checked, with `like`'s name and batch and seq sizes."""
    from soapstone.dsl.lang.spec import load

    sizes = dict(like.dims)
    text = spec_text(cfg, like.name, sizes.get("batch", 8), sizes.get("seq", 16),
                     sizes.get("vocab"))
    return load(text, filename=f"<{cfg.kind} from {cfg.path}>").model(like.name)


def check_model(model: ir.Model, cfg: HFConfig, spec: str = "the spec") -> None:
    """HFError unless `model` computes what `cfg` describes: its dims (naming the --dim flags
    that fix them), then its params and ops, compared with `spec_text(cfg)`'s; an option
    that differs (rope theta, a norm's eps, the activation, a bias) is an HFMismatch at its
    place in the spec naming the config field and both values."""
    from soapstone.dsl.compile.lower import resolve_ties

    _check_dims(dict(model.dims), cfg, spec, model.name, len(model.blocks), model)
    ref = resolve_ties(reference_model(cfg, model))
    _check_params({p.name: p.type.dims for p in resolve_ties(model).params}, ref, cfg, spec,
                  model)
    check_ops(model, ref, cfg, spec)


def check_ops(model: ir.Model, ref: ir.Model, cfg: HFConfig, spec: str) -> None:
    """Every op of `model` is `ref`'s (the config's model), else an HFMismatch at the first
    that differs."""
    for a, b in zip(model.ops, ref.ops, strict=False):
        if (a.kind, a.attrs, a.type) != (b.kind, b.attrs, b.type):
            raise mismatch_of_op(a, b, cfg, spec, model.name)
    if len(model.ops) != len(ref.ops):
        raise HFError(f"{spec}: model {model.name} has {len(model.ops)} ops, the {cfg.kind} of "
                      f"{cfg.path} {len(ref.ops)}")


def _check_dims(have: dict[str, int], cfg: HFConfig, spec: str, name: str,
                blocks: int, model: ir.Model | None = None) -> None:
    if blocks != cfg.size("layers"):
        raise HFError(f"{spec}: model {name} repeats {blocks} blocks, but {cfg.path} has "
                      f"{cfg.size('layers')} layers", f"write repeat {cfg.size('layers')} "
                      "as layer (and place the blocks of pipeline layouts)")
    missing = [d for d, _ in cfg.dims if d not in have and d != "layers"]
    if missing:
        raise HFError(f"{spec}: model {name} has no dim {', '.join(missing)}, which "
                      f"{cfg.path} sets; write the model as "
                      "`soapstone.dsl.interop.hf.spec_text` does (examples/"
                      f"{'mixtral' if cfg.moe else cfg.kind}.par)")
    if "head_dim" in dict(cfg.dims) and have["head_dim"] != cfg.size("head_dim"):
        raise mismatch_of_head_dim(have["head_dim"], cfg, model)
    # a larger vocab is the config's padded (cross_entropy's classes then say the real one)
    wrong = [(d, n) for d, n in cfg.dims if d != "layers" and have[d] != n
             and not (d == "vocab" and have[d] > n)]
    if wrong:
        said = ", ".join(f"{d} = {have[d]} (config: {n})" for d, n in wrong)
        raise HFError(f"{spec}: model {name}'s dims differ from {cfg.path}: {said}",
                      "run with " + " ".join(f"--dim {d}={n}" for d, n in wrong))


def _check_params(have: dict[str, tuple[str, ...]], ref: ir.Model, cfg: HFConfig,
                  spec: str, model: ir.Model | None = None) -> None:
    """The params (ties resolved) by name and dims are the reference model's; one that a
    config flag decides (a bias, the untied head) names the flag, at its place in `model`."""
    mine = dict(have)
    for p in ref.params:
        dims = mine.pop(p.name, None)
        if dims != p.type.dims:
            got = "missing" if dims is None else f"[{', '.join(dims)}]"
            field = field_of_param(p.name, cfg) if dims is None else None
            hint = f"{cfg.path} says {field[0].format(v='true')}: write " \
                f"{field[1].format(v='true')} in this layer" \
                if field and field[0] != "tie_word_embeddings" else None
            if field and field[0] == "tie_word_embeddings":
                hint = f"{cfg.path} sets tie_word_embeddings = false: drop the tie statement"
            raise HFMismatch(f"{spec}: model {ref.name} is not the {cfg.kind} {cfg.path} "
                             f"describes: param {_param_text(p)} expected, {got} here",
                             hint, place_of_param(p.name, model))
    if mine:
        extra = next(iter(mine))
        field = field_of_param(extra, cfg)
        hint = None
        if field and field[0] == "tie_word_embeddings":
            hint = f"{field[1]} ({cfg.path} sets tie_word_embeddings = true)"
        elif field:
            hint = f"{cfg.path} says {field[0].format(v='false')}: write " \
                f"{field[1].format(v='false')} in this layer"
        raise HFMismatch(f"{spec}: model {ref.name} has param {extra}, which the {cfg.kind} of "
                         f"{cfg.path} lacks", hint, place_of_param(extra, model))


def check_graph(directory: str | Path, graph, model: ir.Model | None = None) -> HFConfig:
    """HFError unless the compiled `graph` (any layout) holds the params, by name and dims,
    of the model DIR/config.json describes, and `model` (the spec's, when given) computes it
    op by op (what `run --init hf:DIR` checks before launch)."""
    from soapstone.dsl.compile.lower import resolve_ties

    cfg = read_config(directory)
    prog = graph.stages[0].program
    spec = f"--init hf:{directory}"
    _check_dims(dict(prog.dims), cfg, spec, graph.model,
                sum(len(s.blocks) for s in graph.stages), model)
    sizes = dict(prog.dims)
    like = ir.Model(graph.model, tuple({**sizes, "batch": graph.batch or 8}.items()), (), (),
                    (), (), ())
    have = {p.name: p.dims for s in graph.stages for p in s.program.params}
    ref = resolve_ties(reference_model(cfg, like))
    _check_params(have, ref, cfg, spec, model)
    if model is not None:
        check_ops(model, resolve_ties(reference_model(cfg, model)), cfg, spec)
    open_weights(directory, cfg, graph_params(graph))  # the files' headers, before launch
    return cfg


def _param_text(p: ir.Param) -> str:
    tie = f" tied to {p.tied_to}" if p.tied_to else ""
    return f"{p.name} [{', '.join(p.type.dims)}]{tie}"


def load(directory: str | Path, model: ir.Model, spec: str = "the spec") -> dict:
    """The full fp32 tensors, by param name, of a save_pretrained directory for `model`
    (checked against its config.json first). Tied params are absent: their target holds them."""
    cfg = read_config(directory)
    check_model(model, cfg, spec)
    from soapstone.dsl.compile.lower import resolve_ties

    sizes = dict(model.dims)
    params = {p.name: (p.type.dims, tuple(sizes[d] for d in p.type.dims))
              for p in resolve_ties(model).params}
    return read_weights(directory, cfg, params)


def open_weights(directory: str | Path, cfg: HFConfig,
                 params: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> HFReader:
    """A reader of DIR's weights for params (name -> (dims, full shape)), every tensor they
    need checked from the files' headers first: there, complete, of the right shape (HFError
    naming the file and the tensor otherwise). Reads no tensor data."""
    directory = Path(directory)
    entries = read_headers(directory)
    wanted = tensor_map(cfg)
    real = real_shapes(cfg, params)
    check_tensors(directory, cfg, entries, {
        t.name: (hf_shape(t.how, t.part([real[n] for n in t.params])),
                 hf_dims(t.how, t.part([params[n][0] for n in t.params]))) for t in wanted})
    return HFReader(wanted, entries, {n: shape for n, (_, shape) in params.items()}, real=real)


def real_shapes(cfg: HFConfig, params: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]
                ) -> dict[str, tuple[int, ...]]:
    """Each param's shape in the Hugging Face files: a padded vocab dim at the config's."""
    vocab = cfg.size("vocab")
    return {n: tuple(min(s, vocab) if d == "vocab" else s for d, s in zip(dims, shape,
                                                                          strict=True))
            for n, (dims, shape) in params.items()}


def read_weights(directory: str | Path, cfg: HFConfig,
                 params: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> dict:
    """{param name: full fp32 tensor} from DIR's safetensors for params (name -> (dims,
    shape)); a tensor missing, unknown or of another shape is an HFError naming it."""
    import torch

    from soapstone.shard.checkpoint.boxes import Box

    reader = open_weights(directory, cfg, params)
    held = {n for t in tensor_map(cfg) for n in t.params}
    state = {n: reader.read(f"param/{n}", Box((0,) * len(shape), shape), torch.float32)
             for n, (_, shape) in params.items() if n in held}
    reader.close()
    return state


def graph_params(graph) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The params of a compiled graph: name -> (dims, full shape)."""
    return {p.name: (p.dims, p.shape) for s in graph.stages for p in s.program.params}


def load_init(executor, directory: str) -> str:
    """`run --init hf:DIR`: DIR's weights into `executor` (any layout: each rank reads only
    the slices it holds); a line saying what was loaded. Collective."""
    from soapstone.shard.checkpoint.load import fill_shares

    cfg = check_graph(directory, executor.graph)
    params = graph_params(executor.graph)
    reader = open_weights(directory, cfg, params)
    fill_shares(executor, reader, ("param",))
    return f"hf:{directory}: {len(reader.where)} parameters of a Hugging Face {cfg.kind}"


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
    from soapstone.dsl.compile.lower import resolve_ties

    sizes = dict(model.dims)
    real = real_shapes(cfg, {p.name: (p.type.dims, tuple(sizes[d] for d in p.type.dims))
                             for p in resolve_ties(model).params})
    state = {n: v[tuple(slice(0, k) for k in real[n])] if n in real else v
             for n, v in state.items()}  # a padded vocab's rows stripped
    out = {}
    for t in tensor_map(cfg):
        missing = [n for n in t.params if n not in state]
        if missing:
            raise HFError(f"the parameters lack {missing[0]} (Hugging Face's {t.name})")
        x = to_hf(t.how, t.part([state[n].detach().to(torch.float32).cpu() for n in t.params]))
        out[t.name] = x.contiguous().clone()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    return cfg
