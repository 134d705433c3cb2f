"""`soapstone tokenize TEXT... -o OUT.bin [--tokenizer tokenizer.json]`: text to a token file.

Byte-level by default (ids 0..255, vocab 256); with a Hugging Face tokenizer.json, its ids
(the `tokenizers` library, an optional extra). Writes nanoGPT's flat .bin (uint16, or uint32
for vocabularies above 65536) and prints the `run` flags that read it. An output that is one
of the texts or the tokenizer, or cannot be written, and texts that give no token (a run
cannot train on 0 tokens) are bad input (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.app.outputs import cannot_write, check_file, writes_to
from soapstone.dsl.commands import fail
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """TEXT..., -o, --tokenizer."""
    parser.add_argument("texts", nargs="+", metavar="TEXT", help="text files, in order")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.bin",
                        help="the token file to write")
    parser.add_argument("--tokenizer", metavar="tokenizer.json",
                        help="a Hugging Face tokenizer.json (default: UTF-8 bytes, vocab 256)")


def main(args: argparse.Namespace) -> int:
    """Encode the texts; print what was written and how to train on it."""
    from soapstone.shard.data.tokenizer import load_tokenizer, write_token_file

    try:
        tok = load_tokenizer(args.tokenizer)
        check_file(args.output, "-o", "tokens.bin", [("the text", t) for t in args.texts]
                   + [("--tokenizer", args.tokenizer)])
        if all(Path(t).is_file() and Path(t).stat().st_size == 0 for t in args.texts):
            raise BadInput(f"{' '.join(args.texts)}: empty; a file of 0 tokens cannot train: "
                           "give some text")
        try:
            n, dtype = write_token_file(args.texts, args.output, tok)
        except OSError as e:
            if not writes_to(e, args.output):
                raise
            raise cannot_write("-o", args.output, e) from None
        if n == 0:  # text the tokenizer maps to nothing: no file to train on
            Path(args.output).unlink(missing_ok=True)
            raise BadInput(f"{' '.join(args.texts)}: no tokens ({tok.name}); a file of 0 "
                           f"tokens cannot train; removed -o {args.output}")
    except UserError as e:
        return fail(e)
    vocab = tok.vocab_size
    flags = f"--data {args.output} --dim vocab={vocab}"
    if dtype != "uint16":
        flags += f" --data-dtype {dtype}"
    print(f"{args.output}: {n:,} tokens ({tok.name}, vocab {vocab}, {dtype})\n"
          f"train on it: soapstone run SPEC {flags}")
    return 0
