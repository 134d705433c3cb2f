"""Language-model batches from a flat token file read by offset: any size, never read whole.

The formats people store tokens in:

- `.bin`: raw little-endian ids, no header, as nanoGPT's prepare.py writes them: uint16 by
  default (`--data-dtype uint32` for vocabularies above 65536; `soapstone tokenize` writes
  either and says which);
- `.npy`: a one-dimensional integer array (opened with mmap_mode="r");
- any other file: its bytes are the ids 0..255 (byte-level text).

A step's batch is `rows` windows of seq + 1 tokens at offsets drawn from (seed, step) over the
training region, cut into ids (the first seq) and next-token targets (the last seq), the same
on every layout. Every rank draws all offsets (a few integers) but reads only the windows of its
own rows (`read_rows`, given the rows the executor's stages read: a data-parallel rank its
shard of the batch, a middle pipeline stage none); other rows of the full-shape batch are
zeros, which that rank's forward never looks at. Evaluation windows come from `--val-data`, or
from the file's last `val_fraction` (the training region is the rest): eval batch j's offsets
are drawn from (seed, "eval", j), so every evaluation sees the same held-out batches.
Ids are checked against the vocab: a file up to SCAN_BYTES once when it is opened (in chunks,
so memory stays bounded), before any training; a larger one as its windows are read (a bad id
then ends the job mid-run). Either way a DataError names the file and the offset.
The windows are read with os.pread (shard/data/token_reader.py), never through the memory map
open_tokens checks the file with: a file truncated while the run reads it is then a DataError
(its size now and at opening), where a mapped page past the new end would be SIGBUS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from soapstone.shard.data.errors import DataError
from soapstone.shard.data.tasks import SyntheticTask, input_dtype, input_shape, seeded_generator
from soapstone.shard.data.token_reader import TokenFile, TokenSpan
from soapstone.shard.plan.program import Program

BIN_DTYPES = ("uint16", "uint32", "uint8", "int32", "int64")
VAL_FRACTION = 0.1
SCAN_BYTES = 256 << 20
SCAN_CHUNK = 4 << 20  # ids per chunk of the opening scan


def open_tokens(path: str | Path, dtype: str | None = None, flag: str = "--data") -> np.ndarray:
    """A read-only memory map of a token file's ids (one dimension); DataError if unusable.
    TokenMemmap reads through TokenFile.of_map, not the map (see token_reader.py)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{flag} {path}: no such file")
    try:
        if p.suffix == ".npy":
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
            if not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"{flag} {path}: expected integer token ids, got {arr.dtype}")
            if arr.ndim != 1:  # rows of a 2-D array are not one stream: say so, not flatten
                raise DataError(f"{flag} {path}: token ids are one-dimensional, this array has "
                                f"shape {tuple(arr.shape)}; save it flat "
                                "(np.save(path, ids.reshape(-1)))")
        else:
            name = (dtype or "uint16") if p.suffix == ".bin" else "uint8"
            if name not in BIN_DTYPES:
                raise DataError(f"--data-dtype {name}: use one of {', '.join(BIN_DTYPES)}")
            item = np.dtype(name).itemsize
            size = p.stat().st_size
            if size % item:
                raise DataError(
                    f"{flag} {path}: {size} bytes is not a whole number of {name} ids "
                    f"({item} bytes each); the file is truncated, or it holds another dtype "
                    f"(--data-dtype {'uint32' if name == 'uint16' else 'uint16'}?)")
            if size == 0:
                raise DataError(f"{flag} {path}: the file is empty")
            arr = np.memmap(p, dtype=np.dtype(name).newbyteorder("<"), mode="r")
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"{flag} {path}: cannot read it ({e})") from None
    if arr.size == 0:
        raise DataError(f"{flag} {path}: the file holds no tokens")
    return arr


def check_dtype_applies(dtype: str | None, paths: list[str | Path]) -> None:
    """DataError when --data-dtype is given but no token file is raw .bin ids, the only files
    it is read for: a .npy carries its own dtype and any other file is bytes."""
    if dtype is not None and not any(Path(p).suffix == ".bin" for p in paths):
        given = (f"not to {', '.join(str(p) for p in paths)} (a .npy carries its own dtype, "
                 "any other file is bytes)" if paths else "and no --data file is given")
        raise DataError(f"--data-dtype {dtype}: it applies to raw .bin token files only, "
                        f"{given}; leave it out")


class TokenMemmap(SyntheticTask):
    """Batches of windows cut from a memory-mapped token file (see the module doc)."""

    def __init__(self, program: Program, path: str | Path, seed: int = 0,
                 val_path: str | Path | None = None, dtype: str | None = None,
                 val_fraction: float = VAL_FRACTION):
        super().__init__(program, seed)
        if not self.lm:
            raise DataError(f"--data {path}: model {program.model} has no token input and "
                            "next-token targets of the same shape to feed from a token file")
        self.path, self.val_path = str(path), str(val_path) if val_path else None
        # with a .bin and another file, the dtype is read for the .bin: refused only when
        # no file reads it
        check_dtype_applies(dtype, [path] + ([val_path] if val_path else []))
        tokens = TokenFile.of_map(open_tokens(path, dtype), "--data")
        ids, _, self.vocab = self.lm
        self.seq = input_shape(program, ids)[-1]
        whole = tokens.span(0, tokens.size)
        if val_path:
            val = TokenFile.of_map(open_tokens(val_path, dtype, "--val-data"), "--val-data")
            self.train, self.val = whole, val.span(0, val.size)
        else:
            cut = tokens.size - int(tokens.size * val_fraction)
            self.train, self.val = tokens.span(0, cut), tokens.span(cut, tokens.size)
        for what, arr, where in (("training", self.train, f"--data {path}"),
                                 ("held-out", self.val, f"--val-data {val_path}" if val_path
                                  else f"--data {path} (its last {val_fraction:.0%})")):
            if arr.size < self.seq + 1:
                raise DataError(f"{where}: {arr.size} {what} tokens, fewer than the "
                                f"{self.seq + 1} one sequence needs"
                                + ("" if val_path or what == "training" else
                                   "; give a longer file or --val-data"))
        for arr, where in ((whole, self.path), (self.val if val_path else None, val_path)):
            # a dtype whose ids all fit needs no scan, but a signed one can still hold a
            # negative id (an int8 .npy)
            if arr is not None and arr.nbytes <= SCAN_BYTES \
                    and (np.iinfo(arr.dtype).max >= self.vocab or np.iinfo(arr.dtype).min < 0):
                self._scan(arr, where)
        self.rows: list[int] | None = None  # None: every row of the batch
        self.inputs: dict[str, list[int] | None] = {}
        self.last_read: list[int] = []  # rows the last batch read (what the tests check)

    def read_rows(self, rows: dict[str, list[int] | None]) -> None:
        """Read only these rows of each input (Executor.input_rows); an input absent from
        `rows` is read by no stage on this rank."""
        ids, targets, _ = self.lm
        self.inputs = {n: rows[n] for n in (ids, targets) if n in rows}
        if any(r is None for r in self.inputs.values()):
            self.rows = None
        else:
            self.rows = sorted(set().union(*self.inputs.values())) if self.inputs else []

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """Training batch `step`: windows at offsets drawn from (seed, step)."""
        return self._cut(self.train, seeded_generator(self.seed, "data", step), step,
                         self.path)

    def eval_batch(self, j: int) -> dict[str, torch.Tensor]:
        """Held-out batch j (the same j, the same windows, at every evaluation)."""
        return self._cut(self.val, seeded_generator(self.seed, "eval", j), -1 - j,
                         self.val_path or self.path)

    def _cut(self, data: TokenSpan, g: torch.Generator, step: int, name: str):
        ids, targets, _ = self.lm
        shape = input_shape(self.program, ids)
        nrows, seq = int(np.prod(shape[:-1])), self.seq
        starts = torch.randint(0, data.size - seq, (nrows,), generator=g).numpy()
        rows = list(range(nrows)) if self.rows is None else self.rows
        win = np.zeros((nrows, seq + 1), dtype=np.int64)
        if rows:
            picked = starts[rows]
            win[rows] = data.windows(picked, seq + 1)
            self._check(win[rows], picked, name)
        self.last_read = rows
        win_t = torch.from_numpy(win)
        others = [n for n in self.roles if n not in (ids, targets)]
        # other inputs (rare) from the synthetic task; never its Markov chain for these two
        out = {n: v for n, v in super().batch(step).items() if n in others} if others else {}
        out[ids] = win_t[:, :-1].reshape(shape).to(input_dtype(self.program, ids))
        out[targets] = win_t[:, 1:].reshape(shape).to(input_dtype(self.program, targets))
        return out

    def _scan(self, arr: TokenSpan, name: str) -> None:
        for at in range(0, arr.size, SCAN_CHUNK):
            chunk = arr.ids(at, SCAN_CHUNK)
            self._check(chunk[None, :], np.array([at]), name)

    def _check(self, win: np.ndarray, starts: np.ndarray, name: str) -> None:
        top = int(win.max())
        if top >= self.vocab or int(win.min()) < 0:
            r, c = np.argwhere((win >= self.vocab) | (win < 0))[0]
            bad = int(win[r, c])
            where = f"{name}: token id {bad} at token offset {int(starts[r]) + int(c)}"
            if bad < 0:  # no vocab fits a negative id: the file's ids are wrong, not the model
                raise DataError(f"{where} is negative; token ids run from 0 to "
                                f"{self.vocab - 1}: the file was written with a signed dtype "
                                "that overflowed, or holds something other than token ids")
            raise DataError(f"{where} does not fit the vocab of {self.vocab}; raise it (e.g. "
                            f"--dim vocab={_pow2(max(bad, top) + 1)}) or check --data-dtype")


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
