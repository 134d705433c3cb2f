"""A token file's ids read at offsets (os.pread), never through a memory map.

A mapped page that the file no longer holds (the file truncated while a run reads it) kills
the process that touches it with SIGBUS, which no Python code can turn into an error, and
checking the size (fstat) before touching the map only narrows the window between check and
touch. A read has no such window: past the end it comes back short, and a short read is a
DataError naming the file and its size now and when it was opened. The size is also checked
before each batch's reads, so a shrunk file is reported at the first batch a rank reads after
it shrank, not only when a window happens to fall past the new end (a rank that reads no rows
checks nothing: the reading ranks' error ends the job).

Not detected: a file whose bytes change while its size stays (nothing cheap tells); its ids
are still range-checked wherever token_memmap.py checks them. A file replaced by rename is
not seen either: the open descriptor keeps reading the file as it was.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from soapstone.shard.data.errors import DataError


class TokenFile:
    """One token file's `size` ids of `dtype` from byte `offset` on, read by offset."""

    def __init__(self, path: str, dtype: np.dtype, offset: int, size: int, flag: str):
        self.path, self.flag, self.dtype = str(path), flag, np.dtype(dtype)
        self.offset, self.size = offset, size
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise DataError(f"{flag} {path}: cannot read it ({e})") from None
        weakref.finalize(self, os.close, self.fd)
        self.opened = self._size_now()
        need = offset + size * self.dtype.itemsize
        if self.opened < need:  # shrank since open_tokens sized it
            raise self._short(None, self.opened, need)

    @classmethod
    def of_map(cls, arr: np.memmap, flag: str) -> TokenFile:
        """The file under open_tokens' map, to read by offset (the map itself is not read)."""
        return cls(arr.filename, arr.dtype, arr.offset, arr.size, flag)

    def span(self, lo: int, hi: int) -> TokenSpan:
        """Ids lo..hi-1 of the file, offsets within it counted from lo."""
        return TokenSpan(self, lo, hi - lo)

    def windows(self, starts: np.ndarray, n: int) -> np.ndarray:
        """n ids at each id offset in `starts`, (len(starts), n); DataError if the file shrank."""
        now = self._size_now()
        if now < self.opened:  # shrank: say so now, whether or not these windows reach the end
            raise self._short(None, now)
        want, fd, pread = n * self.dtype.itemsize, self.fd, os.pread
        at = (np.asarray(starts, dtype=np.int64) * self.dtype.itemsize + self.offset).tolist()
        # one os.pread per window, joined: cheaper per row than preadv into the array or a
        # method call per read (measured), which is what a small batch's read time is made of
        try:
            parts = [pread(fd, want, a) for a in at]
        except OSError as e:
            raise DataError(f"{self.flag} {self.path}: cannot read it ({e})") from None
        data = b"".join(parts)
        if len(data) != want * len(at):
            data = b"".join(self._rest(p, want, a) for p, a in zip(parts, at, strict=True))
        return np.frombuffer(data, self.dtype).reshape(len(at), n)

    def _rest(self, part: bytes, want: int, at: int) -> bytes:
        # a regular file reads short only at its end, but a short read is retried before it
        # is called one
        while len(part) < want:
            more = self._read(want - len(part), at + len(part))
            if not more:
                raise self._short((at - self.offset) // self.dtype.itemsize)
            part += more
        return part

    def _read(self, n: int, at: int) -> bytes:
        try:
            return os.pread(self.fd, n, at)
        except OSError as e:
            raise DataError(f"{self.flag} {self.path}: cannot read it ({e})") from None

    def _size_now(self) -> int:
        try:
            return os.fstat(self.fd).st_size
        except OSError as e:
            raise DataError(f"{self.flag} {self.path}: cannot read it ({e})") from None

    def _short(self, start: int | None = None, now: int | None = None,
               then: int | None = None) -> DataError:
        now = self._size_now() if now is None else now
        past = "" if start is None else f" (the window at token offset {start} runs past its end)"
        return DataError(
            f"{self.flag} {self.path}: the file is {now:,} bytes now, "
            f"{self.opened if then is None else then:,} when the run opened it: it was "
            f"truncated while the run reads it{past}; rewrite it and start again")


class TokenSpan:
    """`size` ids of a TokenFile from id `lo` on (the training or held-out region)."""

    def __init__(self, file: TokenFile, lo: int, size: int):
        self.file, self.lo, self.size = file, lo, size
        self.dtype = file.dtype
        self.nbytes = size * file.dtype.itemsize

    def windows(self, starts: np.ndarray, n: int) -> np.ndarray:
        """n ids from each offset in `starts` (within the span): (len(starts), n)."""
        return self.file.windows(starts + self.lo, n)

    def ids(self, at: int, n: int) -> np.ndarray:
        """Ids at..at+n-1 of the span (clipped at its end), one dimension."""
        return self.windows(np.array([at], dtype=np.int64), min(n, self.size - at))[0]
