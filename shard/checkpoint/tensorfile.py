"""safetensors files: a streaming writer (no copy of the tensors, no pickle) and a box reader.

The writer lays out the format itself (8-byte little-endian header length, the JSON header,
the raw bytes in header order), so it can write views of live buffers that share storage,
which safetensors' own save refuses, without copying them first. The reader is the
safetensors library's `safe_open`: `get_slice` reads only the rows a box needs.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import torch

from soapstone.shard.checkpoint.boxes import Box
from soapstone.shard.checkpoint.index import DTYPES, CheckpointError

# torch dtype <-> the index's dtype name (index.DTYPES gives its safetensors code)
NAMES = {getattr(torch, name): name for name in DTYPES}
BY_NAME = {name: t for t, name in NAMES.items()}


def write(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str],
          slow=None) -> int:
    """Write `tensors` (key, contiguous tensor) as a safetensors file via a temp file, fsync
    and rename; the bytes written. `slow(i)` is called after the i-th tensor (a test hook)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[NAMES[t.dtype]][0], "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for i, (_, t) in enumerate(tensors):
            if t.numel():
                f.write(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().data)
            if slow is not None:
                slow(i)
        if slow is not None and not tensors:
            slow(0)  # a rank that writes nothing is slowed too
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(text) + offset


class Reader:
    """Reads boxes of a checkpoint's tensors from its files (each opened once, lazily)."""

    def __init__(self, directory: Path, index: dict):
        self.dir, self.index = Path(directory), index
        self.files: dict[str, object] = {}
        self.bytes_read = 0

    def _open(self, name: str):
        f = self.files.get(name)
        if f is None:
            from safetensors import SafetensorError, safe_open

            try:
                f = self.files[name] = safe_open(str(self.dir / name), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.dir / name}: not a readable safetensors file "
                                      f"({e}); restore it or resume from another checkpoint") \
                    from None
        return f

    def read(self, tensor: str, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The region `box` of checkpoint tensor `tensor`, as `dtype`, from every saved piece
        it overlaps (only those bytes are read)."""
        meta = self.index["tensors"][tensor]
        out = torch.empty(box.shape, dtype=dtype)
        got = 0
        for p in meta["pieces"]:
            saved = Box(tuple(p["offset"]), tuple(p["shape"]))
            common = saved.intersect(box)
            if common is None:
                continue
            piece = self._piece(p, meta, tensor)
            part = piece[common.within(saved)]
            self.bytes_read += part.numel() * part.element_size()
            out[common.within(box)] = part.to(dtype)
            got += common.numel
        if got != box.numel:
            raise CheckpointError(f"{self.dir / 'index.json'}: the pieces of {tensor} cover "
                                  f"{got} of the {box.numel} elements needed; the index is "
                                  "damaged")
        return out

    def _piece(self, p: dict, meta: dict, tensor: str):
        f = self._open(p["file"])
        where = f"{self.dir / p['file']}: {p['key']}"
        try:
            sl = f.get_slice(p["key"])
        except Exception:  # safetensors raises its own error types for a missing key
            raise CheckpointError(f"{where}: not in the file, but the index lists it for "
                                  f"{tensor}; the checkpoint is damaged") from None
        shape, code = list(sl.get_shape()), sl.get_dtype()
        want = DTYPES.get(meta["dtype"], ("?",))[0]
        if shape != list(p["shape"]) or code != want:
            raise CheckpointError(f"{where}: holds {code} {shape}, the index says "
                                  f"{want} {list(p['shape'])} for "
                                  f"{tensor}; the file and its index disagree")
        return _Sliced(sl)


class _Sliced:
    """A safetensors slice indexed with a tuple of slices (read lazily by the library)."""

    def __init__(self, sl):
        self.sl = sl

    def __getitem__(self, where: tuple[slice, ...]) -> torch.Tensor:
        return self.sl[where] if where else self.sl[:]


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
