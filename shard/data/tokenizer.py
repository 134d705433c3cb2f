"""Text <-> token ids for token files and generation: bytes always, or a Hugging Face
`tokenizer.json` through the `tokenizers` library (an optional extra, imported only when a
tokenizer file is given).

`write_token_file` streams text files into one flat `.bin` of ids, the format nanoGPT's
prepare.py writes and shard/data/token_memmap.py maps: uint16 when the vocabulary fits (<= 65536
ids), else uint32. Memory stays bounded by one chunk, whatever the size of the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import numpy as np

from soapstone.shard.data.errors import DataError

CHUNK_BYTES = 1 << 20


@attrs.frozen
class ByteTokenizer:
    """UTF-8 bytes are the ids (vocab 256); decoding replaces broken sequences."""

    vocab_size: int = 256
    name: str = "bytes"

    def encode(self, text: str) -> list[int]:
        """The ids of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@attrs.frozen
class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a tokenizer.json."""

    tok: object
    vocab_size: int
    name: str

    def encode(self, text: str) -> list[int]:
        """The ids of `text`."""
        return self.tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(path: str | None, flag: str = "--tokenizer") -> ByteTokenizer | HFTokenizer:
    """Bytes without a path; else the tokenizer.json at `path`, or in the directory `path`
    (a save_pretrained directory) (DataError if unusable)."""
    if not path:
        return ByteTokenizer()
    if Path(path).is_dir():
        if not (Path(path) / "tokenizer.json").is_file():
            raise DataError(f"{flag} {path}: the directory has no tokenizer.json; give the "
                            "tokenizer.json file itself")
        path = str(Path(path) / "tokenizer.json")
    if not Path(path).is_file():
        raise DataError(f"{flag} {path}: no such file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(f"{flag} {path}: needs the tokenizers package; "
                        "pip install 'soapstone[tokenizers]'") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad JSON
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{flag} {path}: not a Hugging Face tokenizer.json ({first}); "
                        "give the tokenizer.json a `save_pretrained` directory holds") from None
    return HFTokenizer(tok, tok.get_vocab_size(with_added_tokens=True), Path(path).name)


def token_dtype(vocab_size: int) -> str:
    """The smallest .bin id type for a vocabulary: uint16 up to 65536 ids, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _chunks(path: Path, binary: bool):
    with open(path, "rb" if binary else "r", encoding=None if binary else "utf-8",
              errors=None if binary else "replace") as f:
        if binary:
            while block := f.read(CHUNK_BYTES):
                yield block
            return
        lines, size = [], 0
        for line in f:  # whole lines, so no token is cut at a chunk boundary
            lines.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                yield "".join(lines)
                lines, size = [], 0
        if lines:
            yield "".join(lines)


def write_token_file(texts: list[str], out: str, tokenizer) -> tuple[int, str]:
    """Encode text files, in order, into the flat token file `out`; (ids written, dtype)."""
    if not out.endswith(".bin"):
        raise DataError(f"-o {out}: token files are written as .bin (nanoGPT's format)")
    if not Path(out).resolve().parent.is_dir():
        raise DataError(f"-o {out}: the directory {Path(out).parent} does not exist")
    for t in texts:
        if not Path(t).is_file():
            raise DataError(f"{t}: no such file")
    dtype = np.dtype(token_dtype(tokenizer.vocab_size)).newbyteorder("<")
    binary = isinstance(tokenizer, ByteTokenizer)
    total = 0
    with open(out, "wb") as f:
        for t in texts:
            for chunk in _chunks(Path(t), binary):
                ids = np.frombuffer(chunk, dtype=np.uint8) if binary \
                    else np.asarray(tokenizer.encode(chunk))
                f.write(ids.astype(dtype).tobytes())
                total += ids.size
    return total, dtype.name
