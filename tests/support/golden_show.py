"""The golden `soapstone show` files under tests/golden/, one per example model and one per layout.

- `<spec>.txt`: the model's IR, what `show examples/<spec>.par` prints.
- `<spec>.<layout>.txt`: only what `show --parallel <layout>` prints after that IR: the parallel
  block, the Program (or the stage graph and schedule) and the collective totals.

tests/dsl/test_dsl_golden.py compares them with what show prints now; tests/update_golden.py
rewrites them (never a test run). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from soapstone.dsl import load
from soapstone.dsl.app.show_text import render
from soapstone.dsl.layers import custom

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden"
# every example may call the example custom layer (swiglu.par does)
PLUGIN = EXAMPLES / "custom_layer.py"


@attrs.frozen
class GoldenShow:
    """One golden file: the example spec it shows and the layout (None: the model's IR)."""

    spec: Path
    layout: str | None

    @property
    def path(self) -> Path:
        """tests/golden/<spec>.txt or tests/golden/<spec>.<layout>.txt."""
        stem = self.spec.stem if self.layout is None else f"{self.spec.stem}.{self.layout}"
        return GOLDEN / f"{stem}.txt"

    def text(self) -> str:
        """What the file must hold: what show prints now (the layout's part only)."""
        spec = _load(self.spec)
        (model,) = _one_model(spec, self.spec)
        model_text = render(spec, model)
        if self.layout is None:
            return model_text
        full = render(spec, parallel=self.layout)
        # show prints the model's IR, a blank line, then the layout's part
        head = model_text + "\n"
        assert full.startswith(head), f"show --parallel {self.layout} does not start with the IR"
        return full[len(head):]


def _load(spec: Path):
    layers = custom.LayerRegistry()
    custom.load_plugin(str(PLUGIN), layers=layers)
    return load(spec, layers=layers)


def _one_model(spec, path: Path) -> list[str]:
    names = list(spec.models)
    if len(names) != 1:
        raise ValueError(f"{path}: the golden files name one model per example, not {names}")
    return names


def golden_shows() -> list[GoldenShow]:
    """Every golden show file: each example's model, then each of its layouts."""
    out = []
    for path in sorted(EXAMPLES.glob("*.par")):
        spec = _load(path)
        _one_model(spec, path)
        out.append(GoldenShow(path, None))
        out += [GoldenShow(path, name) for name in spec.parallels]
    return out


def stale_files() -> list[Path]:
    """Golden .txt files that no example and layout make any more."""
    wanted = {g.path for g in golden_shows()}
    return sorted(p for p in GOLDEN.glob("*.txt") if p not in wanted)
