"""Spec errors: every problem with a .par file is a Diagnostic with a location and a hint.

Both error classes here are UserErrors (soapstone.comm.errors): bad input, exit 2, no traceback.

`SpecError` carries one or more diagnostics; `str(err)` is the compiler-style report:

    examples/bad.par:7:13: error: unknown name 'xx'
        x = mlp(xx, ffn)
                ^^
    hint: did you mean 'x'?
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import attrs

from soapstone.comm.errors import UserError


@attrs.frozen
class Diagnostic:
    """One error at FILE:LINE:COL (1-based; line 0 means "the file as a whole")."""

    file: str
    line: int
    col: int
    message: str
    hint: str | None = None
    source_line: str | None = None
    end_col: int | None = None  # exclusive; the caret line spans col..end_col

    def format(self) -> str:
        """The multi-line, compiler-style text of this diagnostic."""
        where = f"{self.file}:{self.line}:{self.col}" if self.line > 0 else self.file
        out = [f"{where}: error: {self.message}"]
        if self.source_line is not None and self.line > 0:
            src = self.source_line.rstrip("\n").expandtabs(1)
            width = 1
            if self.end_col is not None and self.end_col > self.col:
                width = self.end_col - self.col
            out.append("    " + src)
            out.append("    " + " " * (self.col - 1) + "^" * width)
        if self.hint:
            out.append(f"hint: {self.hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()


class SpecError(UserError):
    """A spec (or a flag naming things in it) is invalid; `.diagnostics` lists every problem."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.format())

    def format(self) -> str:
        """Every diagnostic, compiler-style (FILE:LINE:COL, caret line, hint)."""
        return "\n".join(d.format() for d in self.diagnostics)

    def __str__(self) -> str:
        return self.format()


class BadInput(UserError):
    """A flag, file or launch that cannot work (not a place in a spec): one line, exit 2."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest candidate(s), or None."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=2, cutoff=0.6)
    if not close:
        return None
    if len(close) == 1:
        return f"did you mean '{close[0]}'?"
    return f"did you mean '{close[0]}' or '{close[1]}'?"


def nearest_divisible(size: int, by: int) -> str:
    """A hint for `size` not dividing over `by` ranks: the nearest sizes that do."""
    lo = (size // by) * by
    hi = lo + by
    if lo <= 0:
        return f"use a multiple of {by}, e.g. {hi}"
    if size - lo <= hi - size:
        return f"use {lo} (or {hi}), the nearest multiple of {by}"
    return f"use {hi} (or {lo}), the nearest multiple of {by}"
