"""Hugging Face's MoE families in and out: Mixtral, Qwen2-MoE, Qwen3-MoE (dsl/interop; transformers
only here).

Their routers' conventions are arguments of soapstone's moe layer and op record, read from the
config: a softmax over every expert before the top_k (all three), the kept weights
renormalised (`normalize`: Mixtral always, Qwen's norm_topk_prob: false by default in
Qwen2-MoE, true in the Qwen3-MoE here), SwiGLU experts, no capacity (`capacity = 0.0`), and
Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate) (`shared_gate`).
transformers adds its router balance loss only with output_router_logits (false by default
and in the hub's configs); the losses here are compared without it, and a config that sets it
is refused.

Random-init models of examples/mixtral.par's shape (tests/support/hf_models.py): logits and
loss within 1e-5 of transformers in fp32, greedy generation token for token, export back to a
directory transformers loads with the same logits, the weights round trip exactly, bad fields
exit 2 naming them. Every layout of examples/mixtral.par under mpiexec: hf_moe_cases.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import hf_models
import pytest
import torch
import torch.nn.functional as F
from cli_calls import cli
from mpirun import case_params

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.interop import hf, hf_config
from soapstone.dsl.model.ir import Output
from soapstone.shard.data.source import make_task
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.runtime.sharded_model import ShardedModel
from soapstone.shard.train.generate import generate

ROOT = Path(__file__).resolve().parents[3]
CASES = "tests/dsl/interop/hf_moe_cases.py"
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
CLI = ["-m", "soapstone.dsl.cli"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """family -> a save_pretrained directory of hf_models.build(family)."""
    root = tmp_path_factory.mktemp("hf-moe")
    return {k: hf_models.save(k, root / k) for k in FAMILIES}


def _model(directory: Path, text: str | None = None):
    """The model DIR's config describes (or `text`'s), its logits an output too."""
    text = text or hf.spec_text(hf_config.read_config(directory), "moe")
    model = dsl.load(text, filename="<config>").model()
    return attrs.evolve(model, outputs=(*model.outputs, Output("logits", "logits", False)))


def _ours(model, state, tokens) -> dict[str, torch.Tensor]:
    sm = ShardedModel(lower(model, None), None, seed=0)
    sm.load_full_state_dict(state)
    with torch.no_grad():
        return sm({"tokens": tokens, "targets": tokens.roll(-1, 1)})


def _theirs(directory: Path, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = hf_models.load(directory)(input_ids=tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, 64), tokens.roll(-1, 1).reshape(-1))
    return logits, loss


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers(hf_dirs, family):
    model = _model(hf_dirs[family])
    state = hf.load(hf_dirs[family], model)
    tokens = _tokens(1)
    out = _ours(model, state, tokens)
    logits, loss = _theirs(hf_dirs[family], tokens)
    assert logits.abs().max() > 0.1  # a real signal, not all zeros
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=0)


def test_window_matches_transformers_and_exports_back(tmp_path):
    """Mixtral's sliding_window (every layer, as Mistral's) over 16 positions of window 4."""
    src = hf_models.save("mixtral", tmp_path / "src", sliding_window=4)
    model = _model(src)
    state = hf.load(src, model)
    tokens = _tokens(4)
    logits, _ = _theirs(src, tokens)
    torch.testing.assert_close(_ours(model, state, tokens)["logits"], logits, rtol=1e-5,
                               atol=1e-5)
    hf.save(tmp_path / "out", model, state)
    assert json.loads((tmp_path / "out/config.json").read_text())["sliding_window"] == 4
    torch.testing.assert_close(_theirs(tmp_path / "out", tokens)[0], logits, rtol=1e-5,
                               atol=1e-5)


def test_mixtral_example_is_the_config_model(hf_dirs):
    """examples/mixtral.par is what hf writes from a Mixtral config, and exports as one."""
    cfg = hf_config.read_config(hf_dirs["mixtral"])
    model = dsl.load(ROOT / "examples/mixtral.par").model("mixtral")
    hf.check_model(model, cfg)
    assert hf_config.config_of(model) == attrs.evolve(cfg, path="model mixtral")


@pytest.mark.parametrize("family,flip,needle", [
    ("qwen3_moe", ("normalize = true", "normalize = false"), "field 'norm_topk_prob'"),
    ("qwen2_moe", ("normalize = false", "normalize = true"), "field 'norm_topk_prob'"),
    ("qwen2_moe", ("shared_gate = true", "shared_gate = false"),
     r"param layer\.0\.moe0\.shared_gate \[hidden\] expected, missing here"),
])
def test_each_router_convention_changes_the_logits(hf_dirs, family, flip, needle):
    """The conventions are no no-ops: computing the other one misses transformers' logits,
    and the import refuses it naming the field."""
    cfg = hf_config.read_config(hf_dirs[family])
    text = hf.spec_text(cfg, "moe")
    model = _model(hf_dirs[family])
    state = hf.load(hf_dirs[family], model)
    other = _model(hf_dirs[family], text.replace(*flip))
    if "shared_gate" in flip[0]:
        state = {n: t for n, t in state.items() if not n.endswith("shared_gate")}
    logits, _ = _theirs(hf_dirs[family], _tokens(2))
    assert (_ours(other, state, _tokens(2))["logits"] - logits).abs().max() > 1e-3
    with pytest.raises(hf_config.HFError, match=needle):
        hf.load(hf_dirs[family], other)


def test_a_rank_reads_only_its_experts_slices(hf_dirs):
    """Experts 2-3 of a stack, half of each expert's ffn (as dpep x tp would hold them): read
    from those experts' own tensors, exactly the box's bytes, 512 bytes at a time."""
    from soapstone.dsl.compile.lower import resolve_ties
    from soapstone.shard.checkpoint.boxes import Box

    cfg = hf_config.read_config(hf_dirs["qwen2_moe"])
    model = _model(hf_dirs["qwen2_moe"])
    sizes = dict(model.dims)
    params = {p.name: (p.type.dims, tuple(sizes[d] for d in p.type.dims))
              for p in resolve_ties(model).params}
    full = hf.read_weights(hf_dirs["qwen2_moe"], cfg, params)
    reader = hf.open_weights(hf_dirs["qwen2_moe"], cfg, params)
    reader.chunk_bytes = 512
    for name, box, part in (("layer.1.moe0.w1", Box((2, 0, 24), (2, 32, 24)),
                             (slice(2, 4), slice(None), slice(24, 48))),
                            ("layer.1.moe0.w2", Box((2, 24, 0), (2, 24, 32)),
                             (slice(2, 4), slice(24, 48))),
                            ("layer.1.moe0.shared_gate", Box((8,), (16,)), (slice(8, 24),))):
        before = reader.bytes_read
        dest = torch.empty(box.numel)
        reader.read_into(f"param/{name}", box, dest)
        assert reader.bytes_read - before == 4 * box.numel, name
        assert torch.equal(dest.view(box.shape), full[name][part]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(hf_dirs, family):
    """8 greedy tokens after a 4-token prompt (within the 16 positions the model compiles)."""
    model = _model(hf_dirs[family])
    ex = Executor(lower_graph(model, None), None, draw=False)
    hf.load_init(ex, str(hf_dirs[family]))
    prompt = [5, 17, 42, 9]
    ours = generate(ex, "tokens", "targets", "logits", prompt, 8, temperature=0.0,
                    shape=(8, 16))
    ref = hf_models.load(hf_dirs[family])
    ref.generation_config.eos_token_id = None  # Mixtral's id 2 would stop it: all 8 tokens
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_exactly_and_transformers_loads_it(hf_dirs, tmp_path, family):
    model = _model(hf_dirs[family])
    state = hf.load(hf_dirs[family], model)
    state = {n: t + 0.01 * torch.randn_like(t) for n, t in state.items()}  # not the originals
    hf.save(tmp_path / "out", model, state)
    back = hf.load(tmp_path / "out", model)
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(back[name], t), name
    tokens = _tokens(3)
    out = _ours(model, state, tokens)
    logits, loss = _theirs(tmp_path / "out", tokens)
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=0)
    src = json.loads((hf_dirs[family] / "config.json").read_text())
    written = json.loads((tmp_path / "out/config.json").read_text())
    for key in ("model_type", "num_experts_per_tok", "norm_topk_prob", "num_local_experts",
                "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                "qkv_bias", "attention_bias", "rms_norm_eps"):
        if key in src and key != "num_local_experts" or family == "mixtral":
            assert written.get(key) == src.get(key), key


def test_the_commands_run_export_and_refuse(hf_dirs, tmp_path):
    """In one process: `run examples/mixtral.par --init hf:DIR` starts from transformers'
    loss (no router balance loss on either side); `export examples/mixtral.par --seed 3 --hf
    OUT` writes what transformers computes as soapstone does; a config with
    output_router_logits is exit 2 naming the field."""
    metrics = tmp_path / "m.jsonl"
    bad = hf_models.with_config(hf_dirs["mixtral"], tmp_path / "bad", output_router_logits=True)
    ran, exported, refused = cli(
        ["run", "examples/mixtral.par", "--init", f"hf:{hf_dirs['mixtral']}", "--steps", "1",
         "--optimizer", "sgd", "--quiet", "--metrics", str(metrics)],
        ["export", "examples/mixtral.par", "--seed", "3", "--hf", str(tmp_path / "out")],
        ["run", "examples/mixtral.par", "--init", f"hf:{bad}", "--steps", "1"])
    assert ran["rc"] == 0 and exported["rc"] == 0, (ran, exported)
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    model = _model(tmp_path, (ROOT / "examples/mixtral.par").read_text())
    batch = make_task(lower(model, None), 0).batch(0)
    with torch.no_grad():
        logits = hf_models.load(hf_dirs["mixtral"])(input_ids=batch["tokens"]).logits
    loss = F.cross_entropy(logits.reshape(-1, 64), batch["targets"].reshape(-1))
    assert first == pytest.approx(float(loss), rel=1e-5)
    tokens = _tokens(5)
    with torch.no_grad():
        ours = ShardedModel(lower(model, None), None, seed=3)(
            {"tokens": tokens, "targets": tokens})["logits"]
    torch.testing.assert_close(ours, _theirs(tmp_path / "out", tokens)[0], rtol=1e-5,
                               atol=1e-5)
    assert refused["rc"] == 2, refused
    assert "field 'output_router_logits' = true is not supported" in refused["text"]
    assert "Traceback" not in refused["text"]


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_hf_moe_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


# ---- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("family,field,value", [
    ("qwen2_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "mlp_only_layers", [0]),
    ("mixtral", "router_jitter_noise", 0.01),
    ("qwen2_moe", "output_router_logits", True),
])
def test_unsupported_moe_field_is_named(hf_dirs, tmp_path, family, field, value):
    bad = hf_models.with_config(hf_dirs[family], tmp_path / "bad", **{field: value})
    with pytest.raises(hf_config.HFError, match=f"field '{field}' = .* is not supported"):
        hf_config.read_config(bad)


def test_qwen2_moe_window_on_alternate_layers_is_refused(tmp_path):
    """Qwen2-MoE slides on every other layer below max_window_layers: not every block alike."""
    src = hf_models.save("qwen2_moe", tmp_path / "src", use_sliding_window=True,
                         sliding_window=4, max_window_layers=2)
    with pytest.raises(hf_config.HFError, match="field 'layer_types' = .* is not supported"):
        hf_config.read_config(src)


def test_too_many_experts_per_token_is_refused(hf_dirs, tmp_path):
    bad = hf_models.with_config(hf_dirs["qwen3_moe"], tmp_path / "bad", num_experts_per_tok=5)
    with pytest.raises(hf_config.HFError, match="num_experts_per_tok = 5 must be between 1 "
                       "and num_local_experts = 4"):
        hf_config.read_config(bad)


@pytest.mark.parametrize("edit,config,needle,hint", [
    (None, {"num_experts_per_tok": 1}, r"moe top_k is 2 here \(layer\.0\.moe0\), but "
     r".* says 1 \(field 'num_experts_per_tok'\)", "write top_k = 1 in this moe"),
    (("normalize = true", "normalize = false"), {}, r"moe normalize is absent here .* says "
     r"true \(field 'model_type'\)", "write normalize = true in this moe"),
    (("capacity = 0.0", "capacity = 1.25"), {}, r"moe capacity is 1\.25 here .* says 0\.0",
     "write capacity = 0.0 in this moe"),
    (("aux = 0.0", "aux = 0.01"), {}, r"moe aux is 0\.01 here .* says 0\.0 \(field "
     r"'output_router_logits'\)", "write aux = 0.0 in this moe"),
])
def test_a_spec_that_routes_otherwise_is_refused_at_its_line(hf_dirs, tmp_path, edit, config,
                                                             needle, hint):
    src = hf_models.with_config(hf_dirs["mixtral"], tmp_path / "src", **config)
    text = (ROOT / "examples/mixtral.par").read_text()
    if edit is not None:
        text = text.replace(*edit)
    model = dsl.load(text, filename="mixtral.par").model("mixtral")
    with pytest.raises(hf_config.HFError, match=needle) as e:
        hf.load(src, model)
    assert e.value.hint == hint
    assert e.value.format().startswith("mixtral.par:")  # the spec line that differs


def test_other_expert_counts_name_the_dim_flags(tmp_path):
    src = hf_models.save("mixtral", tmp_path / "eight", num_local_experts=8,
                         intermediate_size=24)
    model = dsl.load(ROOT / "examples/mixtral.par").model("mixtral")
    with pytest.raises(hf_config.HFError, match=r"ffn = 48 \(config: 24\), experts = 4 "
                       r"\(config: 8\)") as e:
        hf.load(src, model)
    assert e.value.hint == "run with --dim ffn=24 --dim experts=8"


def test_missing_shared_expert_names_the_family(hf_dirs):
    text = hf.spec_text(hf_config.read_config(hf_dirs["qwen2_moe"]), "moe")
    model = dsl.load(text.replace(", shared = shared, shared_gate = true", ""),
                     filename="q.par").model()
    with pytest.raises(hf_config.HFError, match="param layer.0.moe0.mlp0.linear0.weight "
                       r"\[hidden, shared\] expected, missing here") as e:
        hf.load(hf_dirs["qwen2_moe"], model)
    assert "shared = shared, shared_gate = true" in e.value.hint
