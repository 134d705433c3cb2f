"""`soapstone generate` with weights it cannot sample from and numbers at their edges: logits
that are NaN or infinite are exit 2 naming --init (were a RuntimeError traceback, and NUL bytes
at --temperature 0), a temperature so small that logits / T overflows samples the limit (was
the same RuntimeError), and the text comes out as it is drawn (a huge --tokens looked hung).
The weights are written here from the spec's parameter shapes: no training run needed."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_calls import cli

ROOT = Path(__file__).resolve().parents[3]
GEN = ["generate", "examples/gpt.par", "--dim", "vocab=256", "--prompt", "hi"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, str]:
    """gpt.par's full parameters (vocab 256) as safetensors: drawn, and with a NaN table."""
    from safetensors.torch import save_file

    from soapstone import dsl
    from soapstone.dsl.compile.lower import resolve_ties

    model = resolve_ties(dsl.load("examples/gpt.par", dims={"vocab": 256}).model())
    sizes = dict(model.dims)
    g = torch.Generator().manual_seed(0)
    good = {p.name: torch.randn(*(sizes[d] for d in p.type.dims), generator=g) * 0.5
            for p in model.params}
    d = tmp_path_factory.mktemp("weights")
    save_file(good, str(d / "good.safetensors"))
    bad = dict(good, **{"embedding0.table": torch.full_like(good["embedding0.table"],
                                                            float("nan"))})
    save_file(bad, str(d / "nan.safetensors"))
    # finite, but past what float32 arithmetic holds: the logits come out NaN or infinite
    save_file({k: v * 1e37 for k, v in good.items()}, str(d / "huge.safetensors"))
    return {"good": str(d / "good.safetensors"), "nan": str(d / "nan.safetensors"),
            "huge": str(d / "huge.safetensors")}


def test_nonfinite_logits_are_exit_2_naming_the_weights(weights):
    """Finite weights whose logits overflow are refused as the first token is drawn; weights
    holding NaN already when they are loaded (shard/checkpoint/load.py)."""
    runs = cli([*GEN, "--init", weights["huge"], "--tokens", "3"],
               [*GEN, "--init", weights["huge"], "--tokens", "3", "--temperature", "0"],
               [*GEN, "--init", weights["nan"], "--tokens", "3"])
    for r in runs:
        assert r["rc"] == 2, r
        assert r["stdout"] == "", r  # no prompt and NUL bytes
        assert "Traceback" not in r["text"] and len(r["stderr"].strip().splitlines()) == 1, r
    for r in runs[:2]:
        assert f"--init {weights['huge']}: the logits of new token 1 are not finite" in \
            r["stderr"], r
    assert f"{weights['nan']}: param/embedding0.table holds NaN" in runs[2]["stderr"], runs


def test_a_vanishing_temperature_samples_the_largest_logit(weights):
    runs = cli(*([*GEN, "--init", weights["good"], "--tokens", "6", "--temperature", t]
                 for t in ("0", "1e-310", "5e-324")))
    assert all(r["rc"] == 0 for r in runs), runs
    greedy = runs[0]["stdout"]
    assert greedy.startswith("hi") and [r["stdout"] for r in runs[1:]] == [greedy] * 2, runs


def test_next_id_at_a_vanishing_temperature():
    from soapstone.shard.train.generate import next_id

    scores = torch.tensor([0.5, 3.0, -2.0, 3.0], dtype=torch.float64)
    for t in (1e-310, 5e-324):  # 3.0 / t overflows
        picks = {next_id(scores, t, None, torch.Generator().manual_seed(s)) for s in range(40)}
        assert picks == {1, 3}, picks  # the tied largest, drawn evenly
        assert next_id(scores, t, 1, torch.Generator().manual_seed(0)) in (1, 3)


def test_text_stream_prints_what_decode_prints(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from soapstone.dsl.commands.generate import TextStream
    from soapstone.shard.data.tokenizer import ByteTokenizer, load_tokenizer

    text = "héllo wörld, the cat sat on the mat\n€ the dog\n"
    ids = list(text.encode()) + [0xE2, 0x82]  # a character cut short at the very end
    bytes_tok = ByteTokenizer()
    stream = TextStream(bytes_tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.end() == bytes_tok.decode(ids)
    assert pieces[1] == "" and pieces[2] == "é"  # é waits for its second byte

    (tmp_path / "t.txt").write_text(text * 20)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(tmp_path / "t.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel
        .alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    ids = hf.encode(text)
    stream = TextStream(hf)
    out = "".join(stream.push(i) for i in ids) + stream.end()
    assert out == hf.decode(ids) == text
    assert len(stream.ids) < 8  # a few ids of context, whatever the length


def test_a_huge_token_count_streams(weights):
    """--tokens 10**20 prints its text as it goes (it ran silently to the end: hung)."""
    p = subprocess.Popen([sys.executable, "-m", "soapstone.dsl.cli", *GEN, "--init",
                          weights["good"], "--tokens", str(10 ** 20), "--temperature", "0"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    got, deadline = b"", time.monotonic() + 120
    try:  # the prompt and 8 bytes drawn, long before the end
        while len(got) < 10 and time.monotonic() < deadline:
            if select.select([p.stdout], [], [], 1)[0]:
                more = os.read(p.stdout.fileno(), 64)
                if not more:
                    break  # it ended: the assert says so
                got += more
    finally:
        p.kill()
        p.wait(timeout=60)
    assert got.startswith(b"hi") and len(got) >= 10, got
