"""Model texts the plan tests share."""

from __future__ import annotations

from pathlib import Path


def gpt(layers: int) -> str:
    """examples/gpt.par's model with `layers` blocks (no parallel blocks)."""
    text = Path("examples/gpt.par").read_text().split("parallel single")[0]
    return text.replace("repeat 4 as layer", f"repeat {layers} as layer")
