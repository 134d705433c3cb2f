"""`soapstone tokenize TEXT... -o OUT.bin [--tokenizer tokenizer.json]`: text to a token file.

Byte-level by default (ids 0..255, vocab 256); with a Hugging Face tokenizer.json, its ids
(the `tokenizers` library, an optional extra). Writes nanoGPT's flat .bin (uint16, or uint32
for vocabularies above 65536) and prints the `run` flags that read it.
"""

from __future__ import annotations

import argparse

from soapstone.comm.errors import UserError
from soapstone.dsl.commands import fail


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
        n, dtype = write_token_file(args.texts, args.output, tok)
    except UserError as e:
        return fail(e)
    vocab = tok.vocab_size
    flags = f"--data {args.output} --dim vocab={vocab}"
    if dtype != "uint16":
        flags += f" --data-dtype {dtype}"
    print(f"{args.output}: {n:,} tokens ({tok.name}, vocab {vocab}, {dtype})\n"
          f"train on it: soapstone run SPEC {flags}")
    return 0
