"""Hugging Face GPT-2 and LLaMA in and out (soapstone.dsl.interop.hf; transformers only here).

Random-init GPT2LMHeadModel and LlamaForCausalLM (grouped-query: 4 heads, 2 kv heads; every
parameter random, biases and norms too) saved with save_pretrained are imported into the
shipped examples/gpt2.par and examples/llama.par: logits and loss match transformers within
1e-5 in fp32 on one rank; exported weights load back into transformers with the same logits;
`run --init hf:DIR` starts from exactly transformers' loss; bad configs and weights exit 2
naming the field or the tensor. Layouts under mpiexec and tp2 training against transformers'
own AdamW steps: tests/dsl/interop/hf_cases.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import hf_models
import pytest
import torch
import torch.nn.functional as F
from mpirun import case_params, run_mpi

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.interop import hf, hf_config
from soapstone.dsl.model.ir import Output
from soapstone.shard.data.source import make_task
from soapstone.shard.runtime.sharded_model import ShardedModel

ROOT = Path(__file__).resolve().parents[3]
CASES = "tests/dsl/interop/hf_cases.py"
KINDS = ("gpt2", "llama")
CLI = ["-m", "soapstone.dsl.cli"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> a save_pretrained directory of hf_models.build(kind)."""
    root = tmp_path_factory.mktemp("hf")
    return {k: hf_models.save(k, root / k) for k in KINDS}


def _model(kind: str):
    """The shipped example's model, its logits an output too."""
    model = dsl.load(ROOT / f"examples/{kind}.par").model(kind)
    return attrs.evolve(model, outputs=(*model.outputs, Output("logits", "logits", False)))


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, 64, (8, 16), generator=g),
            "targets": torch.randint(0, 64, (8, 16), generator=g)}


def _ours(model, state: dict | None, batch, seed: int = 0) -> dict[str, torch.Tensor]:
    sm = ShardedModel(lower(model, None), None, seed=seed)
    if state is not None:
        sm.load_full_state_dict(state)
    with torch.no_grad():
        return sm(batch)


def _theirs(ref, batch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = ref(input_ids=batch["tokens"]).logits
    return logits, F.cross_entropy(logits.reshape(-1, 64), batch["targets"].reshape(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_import_matches_transformers(hf_dirs, kind):
    model = _model(kind)
    state = hf.load(hf_dirs[kind], model)
    batch = _batch()
    out = _ours(model, state, batch)
    logits, loss = _theirs(hf_models.load(hf_dirs[kind]), batch)
    assert logits.abs().max() > 0.1  # a real signal, not all zeros
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_back_into_transformers(hf_dirs, tmp_path, kind):
    model = _model(kind)
    state = hf.load(hf_dirs[kind], model)
    state = {n: t + 0.01 * torch.randn_like(t) for n, t in state.items()}  # not the originals
    hf.save(tmp_path / "out", model, state)
    batch = _batch(2)
    out = _ours(model, state, batch)
    logits, loss = _theirs(hf_models.load(tmp_path / "out"), batch)
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_export_command_writes_what_soapstone_computes(tmp_path, kind):
    """`soapstone export SPEC --seed 3 --hf DIR`: transformers computes soapstone's logits."""
    r = run_mpi(1, [*CLI, "export", f"examples/{kind}.par", "--seed", "3",
                    "--hf", str(tmp_path / "out")])
    assert r.ok, r.report()
    assert f"as a Hugging Face {kind}" in r.stdout
    batch = _batch(3)
    out = _ours(_model(kind), None, batch, seed=3)
    logits, _ = _theirs(hf_models.load(tmp_path / "out"), batch)
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)


def test_run_init_hf_starts_from_transformers_loss(hf_dirs, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = run_mpi(1, [*CLI, "run", "examples/llama.par", "--init", f"hf:{hf_dirs['llama']}",
                    "--steps", "1", "--optimizer", "sgd", "--quiet", "--metrics", str(metrics)])
    assert r.ok, r.report()
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    model = dsl.load(ROOT / "examples/llama.par").model("llama")
    batch = make_task(lower(model, None), 0).batch(0)
    _, loss = _theirs(hf_models.load(hf_dirs["llama"]), batch)
    assert first == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_hf_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


# ---- bad input -----------------------------------------------------------------------------

def test_unsupported_config_field_exit_2(hf_dirs, tmp_path):
    bad = hf_models.with_config(hf_dirs["gpt2"], tmp_path / "bad", activation_function="quick_gelu")
    r = run_mpi(1, [*CLI, "run", "examples/gpt2.par", "--init", f"hf:{bad}", "--steps", "1"])
    assert r.returncode == 2, r.report()
    assert "field 'activation_function' = \"quick_gelu\" is not supported" in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("kind,field,value", [
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("llama", "rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0}),
    ("llama", "hidden_act", "gelu"),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "model_type", "bert"),
])
def test_unsupported_config_field_is_named(hf_dirs, tmp_path, kind, field, value):
    bad = hf_models.with_config(hf_dirs[kind], tmp_path / "bad", **{field: value})
    with pytest.raises(hf_config.HFError, match=f"field '{field}' = .* is not supported"):
        hf_config.read_config(bad)


def test_weight_of_wrong_shape_names_tensor_shapes_and_dim(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = hf_models.with_config(hf_dirs["gpt2"], tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["transformer.wpe.weight"] = torch.zeros(40, 32)
    tensors["transformer.h.1.attn.c_attn.weight"] = torch.zeros(32, 99)
    save_file(tensors, str(bad / "model.safetensors"))
    model = dsl.load(ROOT / "examples/gpt2.par").model("gpt2")
    with pytest.raises(hf_config.HFError) as e:
        hf.load(bad, model)
    assert "tensor transformer.wpe.weight has shape [40, 32], the model expects [32, 32] " \
        "(max_seq, hidden): dim 0 (max_seq) is 40 there and 32 here" in str(e.value)
    del tensors["transformer.wpe.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(hf_config.HFError, match="the weights lack tensor transformer.wpe.weight"):
        hf.load(bad, model)
    tensors["transformer.wpe.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(hf_config.HFError, match=r"c_attn.weight has shape \[32, 99\], the model "
                       r"expects \[32, 96\] .*: dim 1 \(heads x head_dim \+ heads x head_dim "
                       r"\+ heads x head_dim\) is 99 there and 96 here"):
        hf.load(bad, model)


def test_dims_that_differ_name_the_flags(hf_dirs):
    model = dsl.load(ROOT / "examples/gpt2.par", dims={"hidden": 64, "ffn": 64}).model("gpt2")
    with pytest.raises(hf_config.HFError, match=r"hidden = 64 \(config: 32\), ffn = 64 "
                       r"\(config: 128\)") as e:
        hf.load(hf_dirs["gpt2"], model)
    assert e.value.hint == "run with --dim hidden=32 --dim ffn=128"


def test_another_layer_count_names_the_repeat(hf_dirs, tmp_path):
    bad = hf_models.with_config(hf_dirs["llama"], tmp_path / "bad", num_hidden_layers=3)
    model = dsl.load(ROOT / "examples/llama.par").model("llama")
    with pytest.raises(hf_config.HFError, match="repeats 2 blocks, but .* has 3 layers") as e:
        hf.load(bad, model)
    assert e.value.hint.startswith("write repeat 3 as layer")


def test_a_model_computing_something_else_is_refused(hf_dirs):
    text = (ROOT / "examples/gpt2.par").read_text().replace("gelu_tanh", "gelu")
    model = dsl.load(text, filename="gelu.par").model("gpt2")
    with pytest.raises(hf_config.HFError, match=r"activation is gelu here \(layer\.0\.mlp0\.act\), "
                       r"but .* says gelu_tanh \(field 'activation_function'\)"):
        hf.load(hf_dirs["gpt2"], model)
    text = (ROOT / "examples/gpt2.par").read_text().replace("causal = true", "causal = false")
    text = text.split("\nparallel ")[0]  # its balanced layouts need the causal mask
    model = dsl.load(text, filename="acausal.par").model("gpt2")
    with pytest.raises(hf_config.HFError, match=r"computes layer\.0\.attention0\.probs = "
                       r"softmax\(over=seq_k\) where causal_mask\(.*\) is expected") as e:
        hf.load(hf_dirs["gpt2"], model)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "causal = false" in t)
    assert e.value.format().startswith(f"acausal.par:{line}:")  # the spec line that differs
    untied = (ROOT / "examples/gpt2.par").read_text().replace("tie linear0", "# tie linear0")
    with pytest.raises(hf_config.HFError, match="has param linear0.weight"):
        hf.load(hf_dirs["gpt2"], dsl.load(untied, filename="untied.par").model("gpt2"))


def test_spec_text_is_the_shipped_example(hf_dirs):
    """What hf generates from a config compiles to the shipped example's model."""
    for kind in KINDS:
        cfg = hf_config.read_config(hf_dirs[kind])
        model = dsl.load(ROOT / f"examples/{kind}.par").model(kind)
        hf.check_model(model, cfg)
        assert hf_config.config_of(model).dims == cfg.dims
