"""The malformed-spec corpus: each tests/bad_specs/*.par declares in its header the error it
must produce and where:

    # error: <a fragment of the first error's message>
    # at: LINE:COL
    # file: inc/other.par      (optional: the error is in an included file)

Files under tests/bad_specs/inc/ are helpers, not cases.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from soapstone.dsl import SpecError, load

CORPUS = Path(__file__).resolve().parents[1] / "bad_specs"
CASES = sorted(CORPUS.glob("*.par"))


def _header(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*(error|at|file):\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def test_corpus_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_bad_spec(path: Path):
    want = _header(path)
    assert "error" in want and "at" in want, f"{path.name}: header needs '# error:' and '# at:'"
    with pytest.raises(SpecError) as e:
        load(path)
    d = e.value.diagnostics[0]
    line, col = (int(x) for x in want["at"].split(":"))
    assert want["error"] in d.message, d.format()
    assert (d.line, d.col) == (line, col), d.format()
    expect_file = (CORPUS / want.get("file", path.name)).resolve()
    assert Path(d.file).resolve() == expect_file, d.format()
    # the formatted report quotes the line and puts a caret under the column
    text = d.format()
    assert text.startswith(f"{d.file}:{line}:{col}: error: ")
    src, caret = text.splitlines()[1:3]
    assert src.strip() and caret.strip().startswith("^") and caret.index("^") == col + 3
