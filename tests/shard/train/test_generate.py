"""`soapstone generate` from a checkpoint, on one rank and under layouts (real mpiexec), and
`soapstone tokenize` (bytes; a Hugging Face tokenizer.json through `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpirun import run_mpi

from soapstone.shard.data.errors import DataError
from soapstone.shard.train.errors import SettingError

ROOT = Path(__file__).resolve().parents[3]
CLI = ["-m", "soapstone.dsl.cli"]
BYTES = ["--dim", "vocab=256"]


def corpus() -> str:
    """Sentences of a tiny grammar: spelling to learn, and a free choice of words."""
    import random

    r = random.Random(0)
    nouns, verbs = ("cat", "dog", "bird", "fish", "fox"), ("sees", "likes", "chases", "finds")
    return "".join(f"the {r.choice(nouns)} {r.choice(verbs)} the {r.choice(nouns)}.\n"
                   for _ in range(3000))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """gpt.par trained 150 steps on the corpus's bytes, saved."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "corpus.txt").write_text(corpus())
    r = run_mpi(1, [*CLI, "run", "examples/gpt.par", *BYTES, "--data", str(d / "corpus.txt"),
                    "--steps", "150", "--quiet", "--save", str(d / "run")], timeout=300)
    assert r.ok, r.report()
    return str(d / "run")


def generate(n: int, checkpoint: str, *args: str) -> str:
    spec = "tests/specs/pipe_layouts.par" if "pp2f1b" in args else "examples/gpt.par"
    r = run_mpi(n, [*CLI, "generate", spec, *BYTES, "--init", checkpoint, "--prompt", "the cat",
                    "--tokens", "32", *args], timeout=180)
    assert r.ok, r.report()
    text = r.stdout.removesuffix("\n")
    # rank 0 alone prints: the prompt and 32 new bytes (the corpus is ASCII), once
    assert text.startswith("the cat") and len(text.encode()) == len("the cat") + 32, r.stdout
    return text


def test_greedy_generation_is_identical_under_layouts(checkpoint):
    one = generate(1, checkpoint, "--temperature", "0")
    new = one.removeprefix("the cat")
    # the model learned the corpus: its letters only, and more than one of them
    assert set(new) <= set(corpus()) and len(set(new)) >= 5, one
    assert generate(2, checkpoint, "--parallel", "tp2", "--temperature", "0") == one
    assert generate(2, checkpoint, "--parallel", "pp2f1b", "--temperature", "0") == one


def test_sampled_generation_is_identical_under_tp2(checkpoint):
    """A draw from the whole distribution: any difference in the logits could show."""
    sampled = ["--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    one = generate(1, checkpoint, *sampled)
    assert generate(2, checkpoint, "--parallel", "tp2", *sampled) == one
    assert one != generate(1, checkpoint, "--temperature", "0")


def test_next_id():
    import torch

    from soapstone.shard.train.generate import next_id

    scores = torch.tensor([0.0, 3.0, 1.0, 2.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    assert next_id(scores, 0.0, None, g) == 1
    assert {next_id(scores, 1.0, 2, g) for _ in range(200)} == {1, 3}  # top-2 only
    draws = [next_id(scores, 1.0, None, torch.Generator().manual_seed(s)) for s in range(50)]
    assert len(set(draws)) > 1


@pytest.mark.parametrize("args,error,said", [
    ({"prompt": []}, DataError, "prompt=[]: give a non-empty list of token ids >= 0"),
    ({"prompt": "the cat"}, DataError, "prompt='the cat': give a non-empty list"),
    ({"prompt": [1.5]}, DataError, "prompt=[1.5]: give a non-empty list"),
    ({"prompt": [70]}, DataError, "prompt: id 70 does not fit the model's 64 ids; give ids "
                                  "below 64"),
    ({"prompt": np.array([1.5])}, DataError, "prompt=[1.5]: give a non-empty list"),
    ({"tokens": 0}, SettingError, "tokens=0: give at least 1"),
    ({"temperature": -1.0}, SettingError, "temperature=-1.0: give 0 (greedy) or more"),
    ({"temperature": float("nan")}, SettingError, "temperature=nan: give 0"),
    ({"top_k": 0}, SettingError, "top_k=0: give at least 1, or None for every id"),
])
def test_the_python_api_refuses_what_the_flags_refuse(args, error, said):
    """generate()'s own arguments, checked at the call on every rank alike (the command
    checks its flags first): an empty prompt read the logits at position -1 of the padding,
    a negative temperature favoured the least likely ids, top_k 0 was an IndexError."""
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.dsl.model.language_model import language_model
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.train import generate as gen

    lm = language_model(dsl.load(ROOT / "examples/gpt.par").model(), "examples/gpt.par")
    ex = Executor(lower_graph(lm.model, None), None, seed=0)
    kw = {"prompt": [1, 2], "tokens": 2, **args}
    with pytest.raises(error) as e:
        gen.generate_ids(ex, lm.ids, lm.targets, lm.logits_output, kw.pop("prompt"),
                         kw.pop("tokens"), shape=(8, lm.seq), classes=lm.real, **kw)
    assert str(e.value).startswith(said), str(e.value)
    drawn = [gen.generate(ex, lm.ids, lm.targets, lm.logits_output, p, 2, shape=(8, lm.seq),
                          classes=lm.real) for p in ([1, 2], np.array([1, 2]))]
    assert len(drawn[0]) == 2 and drawn[0] == drawn[1]  # a numpy prompt is its list


BAD = [
    (["generate", "examples/mlp.par", "--prompt", "x"],
     ["model 'mlp' is not a language model", "like examples/gpt.par"]),
    (["generate", "examples/gpt.par", "--prompt", "x"],
     ["id 120 (bytes) does not fit model 'gpt''s vocab of 64", "--dim vocab=256"]),
    (["generate", "examples/gpt.par", *BYTES, "--prompt", "x", "--tokens", "0"], ["--tokens 0"]),
    (["generate", "examples/gpt.par", *BYTES, "--prompt", "x", "--temperature", "inf"],
     ["--temperature inf"]),
    (["generate", "examples/gpt.par", *BYTES, "--prompt", "x", "--temperature", "nan"],
     ["--temperature nan"]),
    (["generate", "examples/gpt.par", *BYTES, "--prompt", "x", "--tokenizer", "{bad}"],
     ["not a Hugging Face tokenizer.json"]),
    (["tokenize", "{text}", "-o", "{out}", "--tokenizer", "{bad}"],
     ["not a Hugging Face tokenizer.json"]),
    (["tokenize", "{text}", "-o", "{out}", "--tokenizer", "{bad2}"],
     ["not a Hugging Face tokenizer.json"]),
]


def test_bad_input_exit_2(checkpoint, tmp_path):
    """One clear line and exit 2 each (one process runs them all: test_checkpoint's cli)."""
    from cli_calls import cli

    (tmp_path / "bad.json").write_text('{"model": ')
    (tmp_path / "bad2.json").write_text('{"version": "1.0", "model": 7}')
    (tmp_path / "t.txt").write_text("x")
    names = {"bad": tmp_path / "bad.json", "bad2": tmp_path / "bad2.json",
             "text": tmp_path / "t.txt", "out": tmp_path / "t.bin"}
    argvs = [[a.format(**names) for a in args] for args, _ in BAD]
    argvs = [a + ["--init", checkpoint] if a[0] == "generate" else a for a in argvs]
    for (_, needles), r in zip(BAD, cli(*argvs), strict=True):
        assert r["rc"] == 2, r
        assert "Traceback" not in r["text"] and len(r["text"].strip().splitlines()) == 1, r
        assert all(n in r["text"] for n in needles), (needles, r)


def test_tokenize_bytes(tmp_path):
    from cli_calls import cli

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("héllo\n")
    b.write_bytes(bytes(range(256)))
    (r,) = cli(["tokenize", str(a), str(b), "-o", str(tmp_path / "t.bin")])
    assert r["rc"] == 0, r
    ids = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    assert ids.tolist() == list("héllo\n".encode()) + list(range(256))
    assert "--data" in r["text"] and "--dim vocab=256" in r["text"]


def test_tokenize_with_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from soapstone.shard.data.tokenizer import load_tokenizer, write_token_file

    text = "the cat sat on the mat\nthe dog sat on the log\n" * 50
    (tmp_path / "t.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(tmp_path / "t.txt")], trainers.BpeTrainer(vocab_size=300,
                                                             special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    mine = load_tokenizer(str(tmp_path / "tokenizer.json"))
    n, dtype = write_token_file([str(tmp_path / "t.txt")], str(tmp_path / "t.bin"), mine)
    ids = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    assert dtype == "uint16" and n == ids.size and ids.tolist() == tok.encode(text).ids
    assert mine.vocab_size == tok.get_vocab_size()
    assert mine.decode(ids[:6]) == "the cat sat on the mat"


def test_tokenize_needs_no_torch(tmp_path):
    from no_torch import run_without_torch as _run

    r = _run("tokenize", "README.md", "-o", str(tmp_path / "t.bin"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.bin").stat().st_size == 2 * (ROOT / "README.md").stat().st_size
