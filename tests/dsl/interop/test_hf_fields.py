"""Every config.json field that changes the math is honoured or refused (dsl/interop/hf_fields.py).

- A LLaMA-3 (rope_theta 500000, rope_type llama3 scaling, rms_norm_eps 1e-5) and a GPT-2 with
  layer_norm_epsilon 1e-6 and exact gelu, imported into the model their config describes
  (`hf.spec_text`), give transformers' logits within 1e-5 (fp32); the scaling is no no-op
  there (the unscaled model's logits differ); `export` writes the config's values back and
  transformers computes the same logits from them.
- `run examples/llama.par --init hf:DIR` whose spec disagrees with DIR's config is exit 2 at the
  spec's line, naming the field, both values and what to write: rope_theta, rms_norm_eps,
  layer_norm_epsilon, activation_function (gelu vs gelu_new), attention_bias,
  tie_word_embeddings, rope_scaling, Qwen3's q/k norms, Mistral's sliding_window. Another rope
  type is refused naming the field.
- The families computed by examples/llama.par's model and its arguments: Mistral (a sliding
  window), Qwen2 (q/k/v biases alone, tied head), Qwen3 (qk_norm) match transformers on tiny
  random configs and export back as the same family; a window only some layers have is refused.
- head_dim other than hidden / heads (Qwen3's real sizes; a LLaMA too): attention's `head_dim`
  argument, imported, matching transformers and exported; a spec without it is exit 2 at the
  attention naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import hf_models
import pytest
import torch
from cli_calls import cli

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.interop import hf, hf_config
from soapstone.dsl.model.ir import Output
from soapstone.shard.runtime.sharded_model import ShardedModel

ROOT = Path(__file__).resolve().parents[3]
# LLaMA-3.1's rope, its original context shrunk so the 16 positions of the test see the
# scaling: wavelengths over 64 positions are stretched 8x, those between 16 and 64 blended
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LLAMA3_CONFIG = {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 512}
GPT2_CONFIG = {"layer_norm_epsilon": 1e-6, "activation_function": "gelu"}


def _config_model(directory: Path):
    """The model DIR's config describes (spec_text), its logits an output too."""
    cfg = hf_config.read_config(directory)
    model = dsl.load(hf.spec_text(cfg), filename="<config>").model(cfg.kind)
    return attrs.evolve(model, outputs=(*model.outputs, Output("logits", "logits", False)))


def _logits(model, state, tokens) -> torch.Tensor:
    sm = ShardedModel(lower(model, None), None, seed=0)
    sm.load_full_state_dict(state)
    with torch.no_grad():
        return sm({"tokens": tokens, "targets": tokens})["logits"]


def _theirs(directory: Path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf_models.load(directory)(input_ids=tokens).logits


@pytest.mark.parametrize("kind,config", [("llama", LLAMA3_CONFIG), ("gpt2", GPT2_CONFIG)])
def test_config_values_match_transformers_and_export_back(tmp_path, kind, config):
    src = hf_models.save(kind, tmp_path / "src", **config)
    model = _config_model(src)
    state = hf.load(src, model)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(4))
    ours = _logits(model, state, tokens)
    torch.testing.assert_close(ours, _theirs(src, tokens), rtol=1e-5, atol=1e-5)
    hf.save(tmp_path / "out", model, state)
    written = json.loads((tmp_path / "out/config.json").read_text())
    if kind == "llama":
        assert written["rope_theta"] == 500000.0 and written["rms_norm_eps"] == 1e-5
        assert {k: written["rope_scaling"][k] for k in LLAMA3} == LLAMA3
    else:
        assert written["layer_norm_epsilon"] == 1e-6
        assert written["activation_function"] == "gelu"
    torch.testing.assert_close(_theirs(tmp_path / "out", tokens), ours, rtol=1e-5, atol=1e-5)


def test_llama3_scaling_changes_the_logits(tmp_path):
    """The scaled rope is no identity at these positions: the same weights without the
    scaling give other logits (so the match above proves the scaling)."""
    src = hf_models.save("llama", tmp_path / "src", **LLAMA3_CONFIG)
    model = _config_model(src)
    state = hf.load(src, model)
    cfg = attrs.evolve(hf_config.read_config(src), rope_scaling=None)
    plain = dsl.load(hf.spec_text(cfg), filename="<plain>").model("llama")
    plain = attrs.evolve(plain, outputs=(*plain.outputs, Output("logits", "logits", False)))
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(5))
    assert (_logits(model, state, tokens) - _logits(plain, state, tokens)).abs().max() > 1e-3


def _dir(tmp_path: Path, kind: str, **config) -> Path:
    return hf_models.save(kind, tmp_path / f"{kind}-{'-'.join(config)}", **config)


MISMATCHES = [
    # (kind, config, what the error says: field, the config's value, the fix)
    ("llama", {"rope_theta": 500000.0}, ["rope theta is 10000.0 here", "500000.0",
                                         "'rope_theta'", "write rope = 500000.0"]),
    ("llama", {"rms_norm_eps": 1e-5}, ["rmsnorm eps is 1e-06 here", "1e-05", "'rms_norm_eps'",
                                       "write eps = 1e-05 in this rmsnorm"]),
    ("llama", {"rope_scaling": LLAMA3, "max_position_embeddings": 512},
     ["rope factor is absent here", "8.0", "'rope_scaling'", "write rope_factor = 8.0"]),
    ("llama", {"attention_bias": True}, ["param layer.0.attention0.bq",
                                         "attention_bias = true",
                                         "write bias = true, qkv_bias = true"]),
    ("gpt2", {"layer_norm_epsilon": 1e-6}, ["layernorm eps is 1e-05 here", "1e-06",
                                            "'layer_norm_epsilon'", "write eps = 1e-06"]),
    ("gpt2", {"activation_function": "gelu"}, ["activation is gelu_tanh here",
                                               "'activation_function'",
                                               "write activation = gelu in this mlp"]),
    ("gpt2", {"tie_word_embeddings": False}, ["param linear0.weight", "missing here",
                                              "tie_word_embeddings = false: drop the tie"]),
    ("qwen3", {"head_dim": 8}, ["param layer.0.attention0.q_norm", "model_type qwen3",
                                "write qk_norm = 1e-06"]),
    ("mistral", {"sliding_window": 4}, ["causal_mask window is absent here", "4",
                                        "'sliding_window'", "write window = 4"]),
    ("llama", {"head_dim": 16}, ["attention head_dim is 8 here (hidden / heads)", "16",
                                 "'head_dim'", "write head_dim = 16 in this attention"]),
]


def test_a_spec_that_disagrees_with_the_config_is_exit_2_at_its_line(tmp_path):
    dirs = [_dir(tmp_path, kind, **config) for kind, config, _ in MISMATCHES]
    spec = {kind: "gpt2" if kind == "gpt2" else "llama" for kind, _, _ in MISMATCHES}
    runs = cli(*[["run", f"examples/{spec[kind]}.par", "--init", f"hf:{d}", "--steps", "1",
                  "--quiet"] for (kind, _, _), d in zip(MISMATCHES, dirs, strict=True)])
    for (kind, config, says), r in zip(MISMATCHES, runs, strict=True):
        assert r["rc"] == 2, (config, r["text"])
        assert f"examples/{spec[kind]}.par:" in r["text"], r["text"]  # the line to change
        for text in says:
            assert text in r["text"], (config, text, r["text"])
        assert "Traceback" not in r["text"]


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0},  # numbers missing
                                  {"rope_type": "default", "partial_rotary_factor": 0.5}])
def test_other_rope_scaling_is_refused_naming_the_field(tmp_path, rope):
    d = _dir(tmp_path, "llama")
    conf = json.loads((d / "config.json").read_text())
    conf.pop("rope_parameters", None)
    conf["rope_scaling"] = rope
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(hf_config.HFError, match="field 'rope_scaling'"):
        hf_config.read_config(d)


FAMILIES = [
    # Mistral: a sliding window of 4 keys per query (a causal mask's window attr)
    ("mistral", {"sliding_window": 4}, "window = 4"),
    # Qwen2: biases on q/k/v_proj alone, the head tied, every layer sliding
    ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 5,
               "max_window_layers": 0}, "qkv_bias = true"),
    # Qwen3: q and k RMS-normed per head before rope (its head_dim set to hidden / heads)
    ("qwen3", {"head_dim": 8, "rms_norm_eps": 1e-5}, "qk_norm = 1e-05"),
    # real Qwen3 sizes have heads x head_dim != hidden (0.6B: 16 x 128 beside 1024): q, k, v
    # project 32 -> 4 x 16, o_proj 64 -> 32; rope and the q/k norms span 16
    ("qwen3", {"head_dim": 16}, "qk_norm = 1e-06, head_dim = 16"),
    ("qwen3", {"head_dim": 4, "num_key_value_heads": 1}, "head_dim = 4"),  # narrower, MQA
    ("llama", {"head_dim": 16}, "head_dim = 16"),
]


@pytest.mark.parametrize("family,config,says", FAMILIES)
def test_families_match_transformers_and_export_back(tmp_path, family, config, says):
    src = hf_models.save(family, tmp_path / "src", **config)
    cfg = hf_config.read_config(src)
    assert says in hf.spec_text(cfg)
    model = _config_model(src)
    state = hf.load(src, model)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(6))
    ours = _logits(model, state, tokens)
    torch.testing.assert_close(ours, _theirs(src, tokens), rtol=1e-5, atol=1e-5)
    hf.save(tmp_path / "out", model, state)
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["model_type"] == family
    assert written.get("sliding_window") == config.get("sliding_window")
    assert written["head_dim"] == config.get("head_dim", 8)
    torch.testing.assert_close(_theirs(tmp_path / "out", tokens), ours, rtol=1e-5, atol=1e-5)


def test_qwen2_with_sliding_layers_and_full_layers_is_refused(tmp_path):
    d = hf_models.save("qwen2", tmp_path / "mixed", use_sliding_window=True, sliding_window=4,
                       max_window_layers=1)  # layer 0 full, layer 1 sliding
    with pytest.raises(hf_config.HFError, match="field 'layer_types'"):
        hf_config.read_config(d)


@pytest.mark.parametrize("value,says", [(0, "field 'head_dim' = 0 must be a positive width"),
                                        ("wide", "field 'head_dim' is 'wide'; soapstone needs "
                                                 "an integer")])
def test_a_head_dim_that_is_no_width_is_refused(tmp_path, value, says):
    d = _dir(tmp_path, "qwen3", head_dim=8)
    conf = json.loads((d / "config.json").read_text())
    conf["head_dim"] = value
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(hf_config.HFError, match=says):
        hf_config.read_config(d)
