"""DataError: bad data input, in a module of its own so torch-free code (`soapstone tokenize`)
can raise it without loading shard/data/tasks.py's torch."""

from __future__ import annotations

from soapstone.comm.errors import UserError


class DataError(UserError, ValueError):
    """Bad data input (a missing or unreadable file, ids out of range): one line, exit 2."""
