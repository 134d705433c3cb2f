"""SettingError: a training setting that cannot work, in a module of its own so the optimizer,
the lr schedule and the trainer raise one type (a flag's value is checked by the commands
first, naming the flag; this is what the library says for any other way in)."""

from __future__ import annotations

from soapstone.comm.errors import UserError


class SettingError(UserError, ValueError):
    """A training setting (optimizer, ZeRO stage, precision, lr schedule, accumulation) that
    cannot work: names the setting and the values it takes (exit 2)."""
