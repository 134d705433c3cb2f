"""A vocab padded to split evenly (Megatron's): GPT-2's 50257 ids do not divide over tp ranks,
so the spec's vocab is larger and `cross_entropy(logits, targets, classes = N)` names the real
ones; the padded logits take no part in the loss, the task's targets and generation stay below
N, import fills the padded rows with zeros and export strips them.

Here a GPT-2 of 63 ids (odd: no 2-way split) in examples/gpt2.par at vocab 64: one rank matches
transformers' logits and loss, the export is a 63-id model transformers computes the same
logits with, tp2 (vocab split, the padding all on rank 1) starts from transformers' loss,
greedy tp2 generation never picks the padded id even where its logit is the largest, and the
spec without `classes` is exit 2 naming vocab_size and what to write.
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

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.interop import hf
from soapstone.dsl.model.ir import Output
from soapstone.shard.data.source import make_task
from soapstone.shard.runtime.sharded_model import ShardedModel

ROOT = Path(__file__).resolve().parents[3]
REAL, PADDED = 63, 64
PADDED_SPEC = (ROOT / "examples/gpt2.par").read_text().replace(
    "classes = classes)", f"classes = {REAL})")  # the file's --dim classes=63, written


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    return hf_models.save("gpt2", tmp_path_factory.mktemp("odd") / "gpt2", vocab_size=REAL)


def _spec(tmp_path: Path) -> Path:
    path = tmp_path / "gpt2_padded.par"
    path.write_text(PADDED_SPEC)
    return path


def _model():
    model = dsl.load(PADDED_SPEC, filename="gpt2_padded.par", dims={"vocab": PADDED}) \
        .model("gpt2")
    return attrs.evolve(model, outputs=(*model.outputs, Output("logits", "logits", False)))


def _theirs(directory: Path, batch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = hf_models.load(directory)(input_ids=batch["tokens"]).logits
    return logits, F.cross_entropy(logits.reshape(-1, REAL), batch["targets"].reshape(-1))


def test_padded_vocab_matches_transformers_and_exports_stripped(odd, tmp_path):
    model = _model()
    state = hf.load(odd, model)
    assert state["embedding0.table"].shape[0] == PADDED
    assert not state["embedding0.table"][REAL:].any()  # the padded row is zeros
    batch = make_task(lower(model, None), 0).batch(0)
    assert int(batch["targets"].max()) < REAL  # the task draws real classes only
    sm = ShardedModel(lower(model, None), None, draw=False)
    sm.load_full_state_dict(state)
    with torch.no_grad():
        ours = sm(batch)
    logits, loss = _theirs(odd, batch)
    torch.testing.assert_close(ours["logits"][..., :REAL], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["loss"], loss, rtol=1e-5, atol=0)
    hf.save(tmp_path / "out", model, state)
    assert json.loads((tmp_path / "out/config.json").read_text())["vocab_size"] == REAL
    torch.testing.assert_close(_theirs(tmp_path / "out", batch)[0], logits, rtol=1e-5,
                               atol=1e-5)


def test_tp2_starts_from_transformers_loss_and_unpadded_spec_is_refused(odd, tmp_path):
    spec = _spec(tmp_path)
    metrics = tmp_path / "m.jsonl"
    run = ["-m", "soapstone.dsl.cli", "run", str(spec), "--parallel", "tp2", "--dim",
           f"vocab={PADDED}", "--init", f"hf:{odd}", "--steps", "1", "--optimizer", "sgd",
           "--quiet", "--metrics", str(metrics)]
    from mpirun import run_mpi

    r = run_mpi(2, run, timeout=240)
    assert r.ok, r.report()
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    batch = make_task(lower(_model(), None), 0).batch(0)
    assert first == pytest.approx(float(_theirs(odd, batch)[1]), rel=1e-5)
    refused, = cli(["run", "examples/gpt2.par", "--dim", f"vocab={PADDED}", "--init",
                    f"hf:{odd}", "--steps", "1"])
    assert refused["rc"] == 2, refused["text"]
    assert "'vocab_size'" in refused["text"] and f"write classes = {REAL}" in refused["text"]


def test_generation_never_picks_a_padded_id(odd, tmp_path):
    """Every real logit made -8 and the padded one 0 (every table row v, the final norm's
    output -v): greedy tp2 generation must still pick real ids only (the first, 0)."""
    import shutil

    from mpirun import run_mpi
    from safetensors.torch import load_file, save_file

    d = tmp_path / "negative"
    shutil.copytree(odd, d)
    t = load_file(d / "model.safetensors")
    v = torch.full((t["transformer.wte.weight"].shape[1],), 0.5)
    t["transformer.wte.weight"] = v.expand_as(t["transformer.wte.weight"]).clone()
    t["transformer.ln_f.weight"] = torch.zeros_like(v)
    t["transformer.ln_f.bias"] = -v
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "generate", str(_spec(tmp_path)), "--parallel",
                    "tp2", "--dim", f"vocab={PADDED}", "--init", f"hf:{d}", "--prompt", "!",
                    "--tokens", "3", "--temperature", "0"], timeout=240)
    assert r.ok, r.report()
    assert r.stdout.splitlines()[0] == "!\x00\x00\x00", repr(r.stdout)  # never id 63 ('?')
