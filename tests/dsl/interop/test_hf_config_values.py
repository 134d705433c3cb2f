"""A config.json whose numbers cannot describe a model (a zero head count, a negative or NaN
epsilon) is an HFError naming the file and the field, before a layer divides by them or a
hint suggests the bad value back as a --dim flag or a spec argument (exit 2 through the CLI).
The configs are the ones `export` writes for the examples, damaged one field at a time; no
transformers needed."""

from __future__ import annotations

import json
import math

import pytest
from cli_calls import cli

from soapstone import dsl
from soapstone.dsl.interop import hf_config

CONFIG = {"gpt2": "examples/gpt2.par", "llama": "examples/llama.par"}


def _write(tmp_path, kind: str, name: str = "", **fields) -> str:
    """DIR (tmp_path/name) holding the config.json `export` writes for CONFIG[kind], with
    `fields` replaced."""
    model = dsl.load(CONFIG[kind]).model()
    conf = hf_config.config_json(hf_config.config_of(model)) | fields
    d = tmp_path / (name or kind)
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(conf))
    return str(d)


BAD = [
    ("gpt2", "n_head", 0, "must be a positive integer"),
    ("gpt2", "n_head", -4, "must be a positive integer"),
    ("gpt2", "n_embd", 0, "must be a positive integer"),
    ("gpt2", "n_layer", 0, "must be a positive integer"),
    ("gpt2", "vocab_size", 2 ** 64, "at most 9223372036854775807"),
    ("gpt2", "layer_norm_epsilon", -1, "must be a finite number above 0"),
    ("gpt2", "layer_norm_epsilon", 0.0, "must be a finite number above 0"),
    ("gpt2", "layer_norm_epsilon", math.nan, "must be a finite number above 0"),
    ("gpt2", "layer_norm_epsilon", True, "soapstone needs a number there"),
    ("llama", "num_key_value_heads", 0, "must be a positive integer"),
    ("llama", "num_attention_heads", 0, "must be a positive integer"),
    ("llama", "intermediate_size", -1, "must be a positive integer"),
    ("llama", "rms_norm_eps", math.inf, "must be a finite number above 0"),
    ("llama", "rope_theta", math.inf, "must be a finite positive number"),
]


@pytest.mark.parametrize("kind,field,value,says", BAD, ids=[f"{f}={v}" for _, f, v, _ in BAD])
def test_a_field_no_model_can_have_is_refused_naming_it(tmp_path, kind, field, value, says):
    d = _write(tmp_path, kind, **{field: value})
    with pytest.raises(hf_config.HFError) as e:
        hf_config.read_config(d)
    assert says in str(e.value) and f"{d}/config.json" in str(e.value), str(e.value)
    assert field in str(e.value), str(e.value)
    # no hint that suggests the bad value back (--dim heads=-4, eps = -1.0)
    assert "--dim" not in (e.value.hint or "") and "write" not in (e.value.hint or "")


def test_the_configs_export_writes_still_read(tmp_path):
    for kind in CONFIG:
        assert hf_config.read_config(_write(tmp_path, kind)).kind == kind


def test_run_and_generate_say_it_with_exit_2(tmp_path):
    """Was a ZeroDivisionError traceback (n_head 0, num_key_value_heads 0) and an invalid
    hint (layer_norm_epsilon -1: `write eps = -1.0`)."""
    gpt2 = _write(tmp_path, "gpt2", "heads", n_head=0)
    llama = _write(tmp_path, "llama", "kv", num_key_value_heads=0)
    eps = _write(tmp_path, "gpt2", "eps", layer_norm_epsilon=-1)
    runs = cli(["run", "examples/gpt2.par", "--steps", "1", "--init", f"hf:{gpt2}"],
               ["run", "examples/llama.par", "--steps", "1", "--init", f"hf:{llama}"],
               ["run", "examples/gpt2.par", "--steps", "1", "--init", f"hf:{eps}"])
    for r, field in zip(runs, ("n_head", "num_key_value_heads", "layer_norm_epsilon"),
                        strict=True):
        assert r["rc"] == 2, r
        assert "Traceback" not in r["text"] and f"field '{field}'" in r["stderr"], r
        assert r["stderr"].startswith("error: ") and "config.json" in r["stderr"], r
