"""UserError: the one base class of bad input, for every layer of soapstone.

A spec, a flag, a file or a launch that cannot work raises a subclass of UserError (SpecError,
BadInput, DataError, GoldenError, CommError, ShapeMismatch, ...). Commands catch UserError once:
they print `e.format()` (no traceback) and exit 2. It lives in comm, the lowest layer, because
dependencies go one way (dsl -> shard -> comm) and every layer raises one.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (a spec, a flag, a file, a launch): exit 2; the message names the place and
    the fix."""

    def format(self) -> str:
        """The text a command prints for this error (no traceback)."""
        return f"error: {self}"


class CommError(UserError, ValueError):
    """Wrong input to a collective (or ranks that disagree): names the op, the argument, the fix."""
