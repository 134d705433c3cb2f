"""Small random Hugging Face GPT-2 and LLaMA models (transformers, tests only), shaped like
examples/gpt2.par and examples/llama.par, saved with save_pretrained: what `hf:DIR` imports
(and Mistral, Qwen2 and Qwen3 of the LLaMA shape; Mixtral, Qwen2-MoE and Qwen3-MoE shaped like
examples/mixtral.par: 4 experts of width 48, top 2).

Every parameter is drawn at random (biases and norm weights too, which Hugging Face would
start at 0 and 1), so a tensor mapped to the wrong place cannot go unnoticed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

GPT2 = {"vocab_size": 64, "n_positions": 32, "n_embd": 32, "n_head": 4, "n_layer": 2,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # grouped-query: 2 per kv head
# the MoE families' own fields (transformers' defaults otherwise: Mixtral's rope theta 1e6
# and eps 1e-5, Qwen2-MoE's q/k/v biases and norm_topk_prob false)
MOE = {"mixtral": {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
       "qwen2_moe": {"moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
                     "num_experts": 4, "num_experts_per_tok": 2},
       "qwen3_moe": {"moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
                     "norm_topk_prob": True}}
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
         "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}


def build(kind: str, seed: int = 0, **config):
    """A random-init GPT2LMHeadModel or LlamaForCausalLM (eval mode, fp32); `config`
    overrides fields of the small default config."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **config}))
    else:  # llama and the families computed by the same model and moe
        name = NAMES[kind]
        conf = getattr(transformers, f"{name}Config")(**{**LLAMA, **MOE.get(kind, {}),
                                                         **config})
        model = getattr(transformers, f"{name}ForCausalLM")(conf)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def save(kind: str, directory: Path, seed: int = 0, **config) -> Path:
    """build(kind, seed, **config) written with save_pretrained to `directory`."""
    build(kind, seed, **config).save_pretrained(directory)
    return Path(directory)


def load(directory: Path):
    """A save_pretrained directory back as a transformers model (eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def with_config(src: Path, dst: Path, **config) -> Path:
    """A copy of the model directory src at dst, its config.json changed by `config`."""
    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    conf.update(config)
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


def assert_trained_alike(got: dict, want: dict, steps: int, lr: float, what: str) -> None:
    """Parameters after `steps` SGD steps at `lr` equal the single rank's: within 2e-5 of
    each tensor's scale, plus one float32 rounding per step's update."""
    atol = steps * lr * float(np.finfo(np.float32).eps)
    for name, w in want.items():
        scale = float(w.abs().max())
        diff = float((got[name] - w).abs().max())
        assert diff <= 1e-5 * 2 * scale + atol, \
            f"{what}: {name} differs by {diff:.3e} (scale {scale:.3e})"
