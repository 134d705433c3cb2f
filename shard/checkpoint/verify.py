"""Check a checkpoint's files against its index, and read piece bytes checked (no torch).

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
each key's dtype, shape and byte range. `check_files` reads only the headers: each file is the
rank's, step's and model's the index says (the header's metadata), at its size, its header
bytes match their checksum, and it holds exactly the index's pieces of it, with the dtype and
shape the index says, tiling its data. `read_checked` reads a range of a piece's bytes in whole
checksum chunks and checks each; `verify_data` checks every byte of every piece (`ckpt verify`).
`latest` opens the newest usable checkpoint of a --save DIR, passing over broken ones.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import attrs

from soapstone.shard.checkpoint import checksum
from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint.index import DTYPES, CheckpointError
from soapstone.shard.checkpoint.schema import Index, Piece

RESTORE = "restore it or resume from another checkpoint"
# header metadata soapstone writes -> the index field it must equal, and what a mismatch means
METADATA = {"rank": ("rank", "the rank files were swapped or renamed"),
            "step": ("step", "the file is from another save, or the index's step was edited"),
            "model": ("model", "the file is from another model's checkpoint"),
            "optimizer_steps": ("optimizer.steps", "the file is from another save, or the "
                                "index's optimizer.steps was edited")}


@attrs.frozen
class Header:
    """A safetensors file's header: its keys, metadata, where data starts and its CRC-32."""

    path: Path
    keys: dict[str, dict]
    metadata: dict[str, str]
    start: int
    crc32: int
    size: int


def read_header(path: Path) -> Header:
    """A safetensors file's header, its entries checked to lie inside the file (CheckpointError
    when it is not one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:  # caught below: a CheckpointError naming the file
                raise ValueError(f"a header of {n} bytes")
            text = f.read(n)
            size = f.seek(0, 2)
            if len(text) < n:
                raise ValueError(f"it ends at byte {size}, inside its {8 + n}-byte header: "
                                 "a truncated file")
            header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); {RESTORE}") \
            from None
    meta = header.pop("__metadata__", None) or {}
    for key, h in header.items():
        ok = (isinstance(h, dict) and isinstance(h.get("dtype"), str)
              and _ints(h.get("shape")) and _ints(h.get("data_offsets"))
              and len(h["data_offsets"]) == 2 and h["data_offsets"][0] <= h["data_offsets"][1])
        if not ok:
            raise CheckpointError(f"{path}: the header's entry for {key} is malformed "
                                  f"({repr(h)[:80]}); {RESTORE}")
    return Header(path, header, meta if isinstance(meta, dict) else {}, 8 + n,
                  checksum.crc32(head + text), size)


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def check_files(directory: Path, index: Index) -> dict[str, Header]:
    """CheckpointError naming the first file that is not what the index says (see the module
    doc); every file's header by name."""
    return {name: check_file(directory, index, name) for name in index.files}


def check_file(directory: Path, index: Index, name: str) -> Header:
    """One file against the index: metadata, size, header checksum, pieces (module doc)."""
    entry = index.files[name]
    h = read_header(directory / name)
    where = f"{h.path} (step {index.step})"
    if entry.rank is not None:  # a file soapstone wrote: its header says whose it is
        want = {"rank": entry.rank, "step": index.step, "model": index.model,
                "optimizer_steps": index.optimizer.steps}
        for key, value in want.items():
            got = h.metadata.get(key)
            if got != str(value):
                field, why = METADATA[key]
                raise CheckpointError(f"{where}: its header says {key} {got}, the index says "
                                      f"{field} {value} for this file; {why}: {RESTORE}")
    if h.size != entry.bytes:
        raise CheckpointError(f"{where}: {h.size} bytes, the index says {entry.bytes} (a "
                              f"truncated or replaced file); {RESTORE}")
    if entry.header_crc32 is not None and (h.start != entry.header_bytes
                                           or h.crc32 != entry.header_crc32):
        raise CheckpointError(f"{where}: its header ({h.start} bytes) fails its checksum "
                              f"(crc32 {h.crc32:08x}, the index says {entry.header_crc32:08x} "
                              f"over {entry.header_bytes} bytes); the file is damaged: {RESTORE}")
    listed = {}
    for tensor, t in index.tensors.items():
        for p in t.pieces:
            if p.file == name:
                listed[p.key] = (tensor, t, p)
    for key in h.keys:
        if key not in listed:
            raise CheckpointError(f"{where}: holds {key}, which the index does not list; the "
                                  f"file is from another checkpoint: {RESTORE}")
    ranges = []
    for key, (tensor, t, p) in listed.items():
        e = h.keys.get(key)
        if e is None:
            raise CheckpointError(f"{where}: {key} is not in the file, but the index lists it "
                                  f"for {tensor}; the checkpoint is damaged: {RESTORE}")
        code = DTYPES[t.dtype][0]
        if e["dtype"] != code or tuple(e["shape"]) != p.shape:
            raise CheckpointError(f"{where}: {key} holds {e['dtype']} {e['shape']}, the index "
                                  f"says {code} {list(p.shape)} for {tensor}; the file and its "
                                  "index disagree")
        a, b = e["data_offsets"]
        if b - a != math.prod(p.shape) * t.itemsize or h.start + b > h.size:
            raise CheckpointError(f"{where}: {key}'s bytes {a}..{b} do not fit its shape or "
                                  f"end past the end of the file ({h.size} bytes); {RESTORE}")
        ranges.append((a, b))
    at = 0
    for a, b in sorted(ranges):  # every data byte belongs to a piece, so every byte is checked
        if a != at:
            break
        at = b
    if at != h.size - h.start:
        raise CheckpointError(f"{where}: data bytes {at}.. are in no piece the index lists; "
                              f"the file is damaged: {RESTORE}")
    return h


def read_checked(f, h: Header, piece: Piece, nbytes: int, lo: int, hi: int, chunk: int,
                 what: str, alloc=bytearray):
    """Bytes lo..hi of `piece` (nbytes long) from the open file `f` (header `h`), read in whole
    checksum chunks, each checked: (the bytes read, in a buffer `alloc(n)` gives, and where lo
    is in them). CheckpointError naming the file, `what` (tensor and step) and the bytes that
    fail."""
    a = lo // chunk * chunk
    b = min(-(-hi // chunk) * chunk, nbytes)
    base = h.start + h.keys[piece.key]["data_offsets"][0]
    buf = alloc(b - a)
    f.seek(base + a)
    got = f.readinto(buf)
    if got != len(buf):
        raise CheckpointError(f"{h.path}: {piece.key} ({what}) ends early ({got} of "
                              f"{len(buf)} bytes at offset {base + a}); {RESTORE}")
    if piece.crc32 is not None:
        view = memoryview(buf)
        for i in range(a // chunk, -(-b // chunk)):
            s = i * chunk - a
            c = checksum.crc32(view[s:s + chunk])
            if c != piece.crc32[i]:
                raise CheckpointError(
                    f"{h.path}: {piece.key} ({what}): bytes {base + s + a}.."
                    f"{base + min(s + a + chunk, b)} of the file fail their checksum (crc32 "
                    f"{c:08x}, the index says {piece.crc32[i]:08x}); the file is damaged: "
                    f"{RESTORE}")
    return buf, lo - a


@attrs.frozen
class Report:
    """What `verify_data` checked."""

    files: int
    pieces: int
    bytes: int


def verify_data(directory: Path, index: Index, problems: list[str], most: int = 10) -> Report:
    """Check every byte of every piece against its checksums (and every file against the index
    first); append each problem's message to `problems` (at most `most`)."""
    headers = {}
    for name in index.files:
        try:
            headers[name] = check_file(directory, index, name)
        except CheckpointError as e:
            problems.append(str(e))
    pieces = nbytes = 0
    opened = {}
    try:
        for tensor, t in index.tensors.items():
            for p in t.pieces:
                if p.file not in headers or len(problems) >= most:
                    continue
                f = opened.get(p.file) or opened.setdefault(p.file, open(directory / p.file, "rb"))
                size = math.prod(p.shape) * t.itemsize
                step = 64 * index.chunk_bytes  # bounded memory for large pieces
                try:
                    for lo in range(0, size, step):
                        read_checked(f, headers[p.file], p, size, lo, min(lo + step, size),
                                     index.chunk_bytes, f"{tensor}, step {index.step}")
                except CheckpointError as e:
                    problems.append(str(e))
                pieces += 1
                nbytes += size
    finally:
        for f in opened.values():
            f.close()
    return Report(len(index.files), pieces, nbytes)


def latest(path: str | Path) -> tuple[Path, Index, list[tuple[Path, str]]]:
    """The checkpoint `path` names, opened and its files checked (headers only): a step dir,
    or the newest usable checkpoint of a --save DIR, passing over newer ones whose index or
    files are broken (with why, among the directories passed over)."""
    candidates, skipped = ix.find(path)
    first = None
    for d in candidates:
        try:
            index = ix.read(d)
            check_files(d, index)
            return d, index, skipped
        except CheckpointError as e:
            if len(candidates) == 1:
                raise
            first = first or e
            skipped.append((d, str(e).splitlines()[0]))
    raise CheckpointError(f"checkpoint {path}: no usable checkpoint in it; the newest: "
                          f"{first}")
