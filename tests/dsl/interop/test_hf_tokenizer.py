"""`generate` and `tokenize` with a Hugging Face model's own tokenizer.json.

A model of more than 256 ids cannot be decoded as bytes: `generate` without a tokenizer is exit
2 naming --tokenizer. The tokenizer.json beside hf:DIR's weights is used when there is one
(the `tokenizers` package, imported only then), and `--tokenizer DIR` reads DIR/tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import hf_models
import numpy as np
from cli_calls import cli

VOCAB = 300  # more ids than bytes
WORDS = [f"w{i}" for i in range(VOCAB)]


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer.json of VOCAB words (w0 ... w299), written by `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(path))


def test_generate_and_tokenize_use_the_model_directory_tokenizer(tmp_path):
    bare = hf_models.save("llama", tmp_path / "bare", vocab_size=VOCAB)
    withtok = hf_models.save("llama", tmp_path / "withtok", vocab_size=VOCAB)
    _tokenizer(withtok / "tokenizer.json")
    text = tmp_path / "text.txt"
    text.write_text("w1 w299 w7 w7\n")
    gen = ["generate", "examples/llama.par", "--dim", f"vocab={VOCAB}", "--prompt", "w5 w6",
           "--tokens", "4"]
    no_tok, own, tokenized = cli(
        [*gen, "--init", f"hf:{bare}"],
        [*gen, "--init", f"hf:{withtok}"],
        ["tokenize", str(text), "-o", str(tmp_path / "t.bin"), "--tokenizer", str(withtok)])
    assert no_tok["rc"] == 2, no_tok["text"]
    assert "--tokenizer" in no_tok["text"] and f"vocab of {VOCAB}" in no_tok["text"]
    assert "Traceback" not in no_tok["text"]
    assert own["rc"] == 0, own["text"]
    line = own["text"].splitlines()[0]  # the prompt, then the 4 new words decoded
    assert line.startswith("w5 w6"), own["text"]
    new = line[len("w5 w6"):].split()
    assert len(new) == 4 and all(w in WORDS for w in new), own["text"]
    assert tokenized["rc"] == 0, tokenized["text"]
    assert f"vocab {VOCAB}" in tokenized["text"]
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == [1, 299, 7, 7]
