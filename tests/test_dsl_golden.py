"""Golden files: `soapstone show` text for every example spec and each of its parallel blocks.

Regenerate (then review the diff like code):
    SOAPSTONE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_dsl_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from soapstone.dsl import custom, load
from soapstone.dsl.show_text import render

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("SOAPSTONE_UPDATE_GOLDEN") == "1"
PLUGINS = {"swiglu.par": EXAMPLES / "custom_layer.py"}


def _cases():
    out = []
    for spec in sorted(EXAMPLES.glob("*.par")):
        out.append((spec.name, None))
        text = spec.read_text()
        for line in text.splitlines():
            if line.startswith("parallel "):
                out.append((spec.name, line.split()[1]))
    return out


@pytest.fixture
def plugin(request):
    spec_name = request.node.callspec.params["spec_name"]
    if spec_name in PLUGINS:
        custom.load_plugin(str(PLUGINS[spec_name]))
        yield
        for name in custom.registered():
            custom.unregister(name)
    else:
        yield


@pytest.mark.parametrize("spec_name,parallel", _cases(),
                         ids=[f"{s}:{p or 'model'}" for s, p in _cases()])
def test_show_golden(spec_name, parallel, plugin):
    spec = load(EXAMPLES / spec_name)
    text = render(spec, parallel=parallel)
    stem = Path(spec_name).stem
    golden = GOLDEN / (f"{stem}.{parallel}.txt" if parallel else f"{stem}.txt")
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with SOAPSTONE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden} differs; review, then regenerate"


def test_every_golden_file_has_a_case():
    names = {f"{Path(s).stem}.{p}.txt" if p else f"{Path(s).stem}.txt" for s, p in _cases()}
    stale = sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in names)
    assert not stale, f"golden files with no example: {stale}"
