"""Quantities for people: how show, explain, plan and the commands write a byte count."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """A byte count for people: "512 B", "1.5 KiB", "2.25 MiB", "1.00 GiB" (show, explain)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{int(n)} B"
