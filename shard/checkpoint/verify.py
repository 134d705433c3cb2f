"""Check a checkpoint's files against its index without reading any tensor data (no torch).

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
each key's dtype, shape and byte range; every piece the index lists must be there with the
dtype and shape the index says, inside the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from soapstone.shard.checkpoint.index import DTYPES, CheckpointError


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts (CheckpointError when it is
    not one)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:  # caught below: a CheckpointError naming the file
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); restore it or "
                              "resume from another checkpoint") from None
    return header, 8 + n


def verify(directory: Path, index: dict) -> None:
    """CheckpointError naming the first piece whose file lacks it or disagrees with the index
    (dtype, shape, or bytes past the end of the file)."""
    headers = {name: (read_header(directory / name), (directory / name).stat().st_size)
               for name in index["files"]}
    for tensor, meta in index["tensors"].items():
        for p in meta["pieces"]:
            where = f"{directory / p['file']}: {p['key']}"
            (header, start), size = headers[p["file"]]
            h = header.get(p["key"])
            if h is None:
                raise CheckpointError(f"{where}: not in the file, but the index lists it for "
                                      f"{tensor}; the checkpoint is damaged")
            want = DTYPES.get(meta["dtype"], ("?",))[0]
            if h["dtype"] != want or list(h["shape"]) != list(p["shape"]):
                raise CheckpointError(f"{where}: holds {h['dtype']} {h['shape']}, the index "
                                      f"says {want} {list(p['shape'])} for {tensor}; the file "
                                      "and its index disagree")
            if start + h["data_offsets"][1] > size:
                raise CheckpointError(f"{where}: its bytes end past the end of the file "
                                      f"({size} bytes); the file is truncated")
