"""Checksums of checkpoint bytes: zlib's CRC-32 over each 1 MiB chunk of a piece (no torch).

The values are zlib.crc32's, so any reader can check a checkpoint with Python's standard
library. They are computed by python-isal (ISA-L's CRC-32 with carry-less multiply) when it is
installed, about 6x zlib's speed on the same values (BENCHMARKS.md), else by zlib.

A piece's bytes are checked in chunks of CHUNK bytes counted from the piece's start, so a
reader that needs a few rows of a large piece reads and checks only the chunks holding them.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32
except ImportError:  # same values, slower
    from zlib import crc32

CHUNK = 1 << 20
ENGINE = "isal" if crc32 is not zlib.crc32 else "zlib"


def chunk_crcs(data, chunk: int = CHUNK) -> list[int]:
    """The CRC-32 of each `chunk`-byte chunk of `data` (a bytes-like object), in order."""
    view = memoryview(data).cast("B")
    return [crc32(view[i:i + chunk]) for i in range(0, len(view), chunk)]


def chunks(nbytes: int, chunk: int = CHUNK) -> int:
    """How many checksums a piece of `nbytes` bytes has."""
    return -(-nbytes // chunk)
