"""Hugging Face weight files that cannot be loaded are exit 2 before training starts, naming the
file and the tensor, on every rank alike, never a traceback (dsl/interop/hf_files.py reads the
safetensors headers before launch); each rank then reads only the slices it holds
(dsl/interop/hf_reader.py), which the layouts of tests/dsl/interop/hf_cases.py prove exact.

The directories are real save_pretrained output (tests/support/hf_models.py), then damaged
the way downloads and conversions damage them: a tensor missing, a tensor of another shape,
a file cut short, only a pytorch_model.bin, an untied head without its tensor, a sharded
index naming a file that is not there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hf_models
import pytest
import torch
from cli_calls import cli
from mpirun import run_mpi
from safetensors.torch import load_file, save_file

from soapstone import dsl
from soapstone.dsl.interop import hf

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A good save_pretrained LLaMA directory (the shape of examples/llama.par)."""
    return hf_models.save("llama", tmp_path_factory.mktemp("good") / "llama")


def _damaged(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    change(dst)
    return dst


def _edit_tensors(edit):
    def change(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return change


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _only_bin(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")  # any pickle would do


def _sharded_missing_file(d: Path) -> None:
    names = list(load_file(d / "model.safetensors"))
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    wmap = {n: "model-00001-of-00002.safetensors" for n in names}
    wmap["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


CASES = {
    # name: (how the directory is damaged, what the error must say)
    "missing": (_edit_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                ["the weights lack tensor model.layers.1.mlp.up_proj.weight"]),
    "shape": (_edit_tensors(lambda t: t.update({"model.norm.weight": torch.zeros(40)})),
              ["model.safetensors: tensor model.norm.weight has shape [40], the model expects "
               "[32] (hidden): dim 0 (hidden) is 40 there and 32 here"]),
    "truncated": (_truncate, ["model.safetensors: truncated", "model.norm.weight",
                              "download the file again"]),
    "bin": (_only_bin, ["no model.safetensors or model.safetensors.index.json",
                        "pytorch_model.bin", "safe_serialization=True"]),
    "sharded": (_sharded_missing_file, ["model-00002-of-00002.safetensors: no such file",
                                        "model.norm.weight"]),
    "ints": (_edit_tensors(lambda t: t.update({"model.norm.weight": _ints(t)})),
             ["model.safetensors: tensor model.norm.weight is I32", "hint: give weights saved "
              "as floats (integers would be cast and train silently"]),
}


def _ints(tensors: dict) -> torch.Tensor:
    return tensors["model.norm.weight"].round().to(torch.int32)


def _poisoned(tensors: dict, name: str, value: float, at: int = 7) -> None:
    """Element `at` (flat) of tensor `name` set to `value` (NaN or infinity)."""
    tensors[name].view(-1)[at] = value


def test_bad_weights_stop_run_and_generate_before_launch(llama, tmp_path):
    dirs = {name: _damaged(llama, tmp_path / name, change) for name, (change, _) in
            CASES.items()}
    argvs = []
    for d in dirs.values():
        argvs.append(["run", "examples/llama.par", "--init", f"hf:{d}", "--steps", "1"])
        argvs.append(["generate", "examples/llama.par", "--init", f"hf:{d}", "--dim",
                      "vocab=64", "--prompt", "0", "--tokens", "2"])
    runs = cli(*argvs)
    for i, (name, (_, says)) in enumerate(CASES.items()):
        for r in runs[2 * i:2 * i + 2]:
            assert r["rc"] == 2, (name, r["argv"][0], r["text"])
            assert "Traceback" not in r["text"]
            assert "soapstone run:" not in r["text"], "the check must come before launch"
            for text in says:
                assert text in r["text"], (name, r["argv"][0], text, r["text"])


def test_untied_gpt2_head_without_its_tensor_says_the_fix(tmp_path):
    d = hf_models.save("gpt2", tmp_path / "untied", tie_word_embeddings=False)
    _edit_tensors(lambda t: t.pop("lm_head.weight", None))(d)
    untied = (ROOT / "examples/gpt2.par").read_text().replace("tie linear0", "# tie linear0")
    model = dsl.load(untied, filename="untied.par").model("gpt2")
    with pytest.raises(hf.HFError, match="the weights lack tensor lm_head.weight") as e:
        hf.load(d, model)
    assert "tie_word_embeddings = false" in e.value.hint
    assert "tie linear0.weight = embedding0.table" in e.value.hint


def test_every_rank_stops_alike(llama, tmp_path):
    """tp2: both ranks find the damage from the headers and exit 2 together, one message."""
    d = _damaged(llama, tmp_path / "cut", _truncate)
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", "examples/llama.par", "--parallel", "tp2",
                    "--init", f"hf:{d}", "--steps", "1"], timeout=240)
    assert r.returncode == 2, r.report()
    assert r.stderr.count("model.safetensors: truncated") == 1, r.stderr  # rank 0 for all
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_any_box_read_in_pieces_is_that_box_of_the_full_tensor(tmp_path, kind):
    """Every param's boxes (whole, and cut at odd offsets as tp and ZeRO cut them), read in
    pieces of a few rows (the reader's read_into, what fill_shares calls), equal the same
    region of the full tensor: each layout change of tensor_map inverted on slices."""
    from soapstone.dsl.compile.lower import resolve_ties
    from soapstone.dsl.interop import hf_config
    from soapstone.shard.checkpoint.boxes import Box

    d = hf_models.save(kind, tmp_path / kind)
    model = dsl.load(ROOT / f"examples/{kind}.par").model(kind)
    full = hf.load(d, model)
    sizes = dict(model.dims)
    params = {p.name: (p.type.dims, tuple(sizes[x] for x in p.type.dims))
              for p in resolve_ties(model).params}
    reader = hf.open_weights(d, hf_config.read_config(d), params)
    reader.chunk_bytes = 64  # a few rows per piece
    for name, (_, shape) in params.items():
        for box in (Box((0,) * len(shape), shape),
                    Box(tuple(min(1, s - 1) for s in shape),
                        tuple(max(s - 2, 1) for s in shape))):
            dest = torch.full((box.numel,), float("nan"))
            reader.read_into(f"param/{name}", box, dest)
            want = full[name][tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape,
                                                                     strict=True))]
            assert torch.equal(dest.view(box.shape), want), (name, box)


def test_weights_not_finite_exit_2_naming_the_file_and_tensor(llama, tmp_path):
    """A NaN in a LLaMA weight, an infinity in GPT-2's fused q/k/v: `run` and `generate` with
    --init hf:DIR exit 2 naming the safetensors file, the Hugging Face tensor, the param it
    fills and the fix (what a soapstone checkpoint's NaN says), on the only rank that reads
    it or on every rank alike."""
    nan = _damaged(llama, tmp_path / "nan", _edit_tensors(
        lambda t: _poisoned(t, "model.layers.1.mlp.up_proj.weight", float("nan"))))
    gpt2 = hf_models.save("gpt2", tmp_path / "inf")
    # row 0, column 37: among k's columns (q's are 0..31)
    _edit_tensors(lambda t: _poisoned(t, "transformer.h.0.attn.c_attn.weight", float("inf"),
                                      37))(gpt2)
    says = {nan: "tensor model.layers.1.mlp.up_proj.weight (param/layer.1.mlp0.linear1.weight)",
            gpt2: "tensor transformer.h.0.attn.c_attn.weight (param/layer.0.attention0.wk)"}
    runs = cli(["run", "examples/llama.par", "--init", f"hf:{nan}", "--steps", "1"],
               ["generate", "examples/llama.par", "--init", f"hf:{nan}", "--dim", "vocab=64",
                "--prompt", "0", "--tokens", "2"],
               ["run", "examples/gpt2.par", "--init", f"hf:{gpt2}", "--steps", "1"])
    for d, r in zip((nan, nan, gpt2), runs, strict=True):
        assert r["rc"] == 2, (r["argv"], r["text"])
        assert "Traceback" not in r["text"]
        assert f"error: {d / 'model.safetensors'}: {says[d]} holds NaN or infinity; load " \
            "finite weights: download the file again" in r["text"], (r["argv"], r["text"])
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", "examples/llama.par", "--parallel", "tp2",
                    "--init", f"hf:{nan}", "--steps", "1"], timeout=240)
    assert r.returncode == 2, r.report()
    assert r.stderr.count(f"{says[nan]} holds NaN or infinity") == 1, r.stderr


def test_a_not_finite_expert_names_its_own_tensor(tmp_path):
    """In a stack of experts read from one tensor per expert, the one holding the NaN."""
    from soapstone.dsl.interop import hf_config
    from soapstone.shard.checkpoint import CheckpointError

    d = hf_models.save("mixtral", tmp_path / "mixtral")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    _edit_tensors(lambda t: _poisoned(t, name, float("nan")))(d)
    text = hf.spec_text(hf_config.read_config(d), "moe")
    with pytest.raises(CheckpointError) as e:
        hf.load(d, dsl.load(text, filename="<config>").model())
    assert str(e.value).startswith(f"{d / 'model.safetensors'}: tensor {name} (param/"), e.value


def test_integers_swapped_in_after_the_header_check_name_the_file_and_tensor(llama, tmp_path):
    """The headers are checked before launch; a file replaced by one of integers after that is
    a CheckpointError at the read, naming the file, the tensor and the fix (it was cast)."""
    from soapstone.dsl.compile.lower import resolve_ties
    from soapstone.dsl.interop import hf_config
    from soapstone.shard.checkpoint import CheckpointError
    from soapstone.shard.checkpoint.boxes import Box

    d = tmp_path / "swapped"
    shutil.copytree(llama, d)
    model = dsl.load(ROOT / "examples/llama.par").model("llama")
    sizes = dict(model.dims)
    params = {p.name: (p.type.dims, tuple(sizes[x] for x in p.type.dims))
              for p in resolve_ties(model).params}
    reader = hf.open_weights(d, hf_config.read_config(d), params)
    _edit_tensors(lambda t: t.update({"model.norm.weight": _ints(t)}))(d)
    with pytest.raises(CheckpointError) as e:
        reader.read_into("param/rmsnorm0.gamma", Box((0,), (32,)), torch.zeros(32))
    assert str(e.value) == (f"{d / 'model.safetensors'}: tensor model.norm.weight "
                            "(param/rmsnorm0.gamma) is int32, but the model's rmsnorm0.gamma "
                            "is a float tensor; give weights saved as floats (integers would "
                            "be cast and train silently)")
