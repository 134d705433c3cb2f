"""safetensors files: a streaming writer (no copy of the tensors, no pickle) and a box reader.

The writer lays out the format itself (8-byte little-endian header length, the JSON header,
the raw bytes in header order), so it can write views of live buffers that share storage,
which safetensors' own save refuses, without copying them first; it takes the CRC-32 of each
1 MiB chunk of every tensor's bytes as it writes them (checksum.py). The reader reads, for a
box, the rows of each saved piece it overlaps, in whole checksum chunks, and checks each
chunk before any byte is used (verify.read_checked).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import attrs
import torch

from soapstone.shard.checkpoint import checksum
from soapstone.shard.checkpoint.boxes import Box
from soapstone.shard.checkpoint.index import DTYPES, CheckpointError
from soapstone.shard.checkpoint.schema import Index, Piece, Tensor
from soapstone.shard.checkpoint.verify import Header, check_file, read_checked

# torch dtype <-> the index's dtype name (index.DTYPES gives its safetensors code)
NAMES = {getattr(torch, name): name for name in DTYPES}
BY_NAME = {name: t for t, name in NAMES.items()}


@attrs.define
class Tally:
    """Bytes written so far: after a failed write, how far it got."""

    bytes: int = 0


@attrs.frozen
class Written:
    """A written file: its size, its header's size and CRC-32, each key's chunk CRC-32s."""

    bytes: int
    header_bytes: int
    header_crc32: int
    crc32: dict[str, list[int]]


def write(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str],
          slow=None, tally: Tally | None = None) -> Written:
    """Write `tensors` (key, contiguous tensor) as a safetensors file via a temp file, fsync
    and rename. `slow(i)` is called after the i-th tensor (a test hook); `tally` counts the
    bytes as they are written. An OSError (a full disk) removes the temp file and propagates."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[NAMES[t.dtype]][0], "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    head = struct.pack("<Q", len(text)) + text
    tally = tally if tally is not None else Tally()
    crcs: dict[str, list[int]] = {}
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb", buffering=0) as f:
            write_all(f, head, tally)
            for i, (key, t) in enumerate(tensors):
                crcs[key] = []
                if t.numel():
                    data = memoryview(t.detach().reshape(-1).cpu().view(torch.uint8).numpy())
                    for at in range(0, len(data), checksum.CHUNK):
                        chunk = data[at:at + checksum.CHUNK]  # checksum while it is in cache
                        crcs[key].append(checksum.crc32(chunk))
                        write_all(f, chunk, tally)
                if slow is not None:
                    slow(i)
            if slow is not None and not tensors:
                slow(0)  # a rank that writes nothing is slowed too
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return Written(len(head) + offset, len(head), checksum.crc32(head), crcs)


def write_all(f, data, tally: Tally) -> None:
    """All of `data` to the unbuffered file `f` (a write may take part of it), counted."""
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        tally.bytes += n
        view = view[n:]


def _uninitialised(n: int):
    """n bytes to read into (numpy, which readinto fills; no zeroing pass first)."""
    return torch.empty(n, dtype=torch.uint8).numpy()


class Reader:
    """Reads boxes of a checkpoint's tensors from its files (each opened and its header
    checked once, lazily); every byte it reads is checked against its checksum."""

    def __init__(self, directory: Path, index: Index):
        self.dir, self.index = Path(directory), index
        self.files: dict[str, tuple[object, Header]] = {}
        self.bytes_read = 0

    def _open(self, name: str):
        got = self.files.get(name)
        if got is None:
            h = check_file(self.dir, self.index, name)
            try:
                f = open(self.dir / name, "rb")  # noqa: SIM115 (closed by close())
            except OSError as e:
                raise CheckpointError(f"{self.dir / name}: cannot open it ({e.strerror}); "
                                      "restore it or resume from another checkpoint") from None
            got = self.files[name] = (f, h)
        return got

    def close(self) -> None:
        """Close the files."""
        for f, _ in self.files.values():
            f.close()
        self.files.clear()

    def read(self, tensor: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The region `box` of checkpoint tensor `tensor`, as `dtype`, from every saved piece
        it overlaps (only the rows it needs, in whole checksum chunks, checked)."""
        meta = self.index.tensors[tensor]
        out = None
        got = 0
        for p in meta.pieces:
            common = p.box.intersect(box)
            if common is None:
                continue
            part = self._part(p, meta, common)
            if common == box:  # one piece holds it all (a resume in the saved layout)
                return part.to(dtype)
            if out is None:
                out = torch.empty(box.shape, dtype=dtype)
            out[common.within(box)] = part
            got += common.numel
        if got != box.numel:
            raise CheckpointError(f"{self.dir / 'index.json'}: the pieces of {tensor} cover "
                                  f"{got} of the {box.numel} elements needed; the index is "
                                  "damaged")
        return out

    def read_into(self, tensor: str, box: Box, dest: torch.Tensor) -> None:
        """read(tensor, box) into the contiguous `dest` (box.numel elements). When one saved
        piece is exactly the box (a resume in the saved layout) its bytes are read straight
        into a CPU `dest` and checked there: no copy."""
        meta = self.index.tensors[tensor]
        whole = [p for p in meta.pieces if p.box == box]
        if not (whole and dest.device.type == "cpu" and dest.dtype == BY_NAME[meta.dtype]
                and dest.is_contiguous()):
            dest.copy_(self.read(tensor, box, dest.dtype).reshape(-1))
            return
        (p,) = whole
        f, h = self._open(p.file)
        n = box.numel * meta.itemsize
        raw = dest.view(torch.uint8).numpy()
        read_checked(f, h, p, n, 0, n, self.index.chunk_bytes,
                     f"{meta.name}, step {self.index.step}", lambda _: raw)
        self.bytes_read += n

    def _part(self, p: Piece, meta: Tensor, common: Box) -> torch.Tensor:
        """The region `common` of piece `p`: its rows read whole, checked, then sliced."""
        f, h = self._open(p.file)
        local = common.within(p.box)
        nbytes = p.box.numel * meta.itemsize
        if local:
            row = p.box.numel // p.shape[0] * meta.itemsize
            rows = (local[0].start, local[0].stop)
        else:  # a 0-d tensor: its one element
            row, rows = nbytes, (0, 1)
        lo, hi = rows[0] * row, rows[1] * row
        buf, at = read_checked(f, h, p, nbytes, lo, hi, self.index.chunk_bytes,
                               f"{meta.name}, step {self.index.step}", _uninitialised)
        self.bytes_read += len(buf)
        t = torch.from_numpy(buf)[at:at + hi - lo].view(BY_NAME[meta.dtype])
        t = t.reshape((rows[1] - rows[0], *p.shape[1:]) if local else ())
        return t[(slice(None), *local[1:])] if local else t


def slow_hook(step: int, rank: int):
    """The test hook SOAPSTONE_CKPT_TEST_SLOW="STEP:SECONDS:PIDFILE": in the save of step
    STEP, after its first tensor, a rank appends `RANK PID` to PIDFILE and sleeps SECONDS per
    tensor (so a test can kill -9 it mid-save). None when unset or another step."""
    spec = os.environ.get("SOAPSTONE_CKPT_TEST_SLOW")
    if not spec:
        return None
    at, seconds, pidfile = spec.split(":", 2)
    if int(at) != step:
        return None

    def slow(i: int) -> None:
        if i == 0:
            with open(pidfile, "a") as f:
                f.write(f"{rank} {os.getpid()}\n")
        time.sleep(float(seconds))

    return slow
