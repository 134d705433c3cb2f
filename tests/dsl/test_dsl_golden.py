"""Golden files: `soapstone show` text for every example model (tests/golden/<spec>.txt) and,
apart from it, each layout's part (tests/golden/<spec>.<layout>.txt); see
tests/support/golden_show.py.

This test only compares. After a deliberate change, rewrite them (then review the diff like
code): `make golden`, or `.venv/bin/python tests/update_golden.py`.
"""

from __future__ import annotations

import pytest
from golden_show import golden_shows, stale_files

FIX = "rewrite with `make golden` and review the diff"
SHOWS = golden_shows()


@pytest.mark.parametrize("golden", SHOWS, ids=[g.path.name for g in SHOWS])
def test_show_matches_golden(golden):
    assert golden.path.exists(), f"missing {golden.path}; {FIX}"
    assert golden.text() == golden.path.read_text(), f"{golden.path} differs; {FIX}"


def test_every_golden_file_has_an_example():
    assert not stale_files(), f"golden files no example makes: {stale_files()}; {FIX}"
