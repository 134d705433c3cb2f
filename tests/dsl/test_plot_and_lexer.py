"""`soapstone plot` (matplotlib, from run's metrics files) and the `.par` Pygments lexer
(found through the package's entry point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_plot_writes_a_png_and_refuses_other_files(tmp_path):
    from cli_calls import cli

    rows = [{"step": i, "loss": 4 - i / 10, "lr": 1e-3, "step_time_s": 0.1,
             "tokens_per_s": 1000 + i, "max_rss_bytes": 1} for i in range(10)]
    rows.insert(5, {"step": 4, "eval_loss": 3.7, "eval_batches": 2, "eval_perplexity": 40.4})
    good = tmp_path / "run.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "loss": 1}\nnot json\n')
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    png = tmp_path / "loss.png"
    ok, bad, other, missing = cli(["plot", str(good), "-o", str(png)],
                                  ["plot", str(tmp_path / "bad.jsonl"), "-o", str(png)],
                                  ["plot", str(tmp_path / "other.jsonl"), "-o", str(png)],
                                  ["plot", str(tmp_path / "none.jsonl"), "-o", str(png)])
    assert ok["rc"] == 0, ok
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for r, needle in ((bad, "bad.jsonl:2: not a JSON line"),
                      (other, "other.jsonl:1: not a metrics line"),
                      (missing, "none.jsonl: no such file")):
        assert r["rc"] == 2 and needle in r["text"] and "Traceback" not in r["text"], r


def test_lexer_is_found_by_pygments_and_lexes_every_example():
    pytest.importorskip("pygments")
    from pygments import lex
    from pygments.lexers import get_lexer_by_name, get_lexer_for_filename
    from pygments.token import Error, Keyword, Name, Number

    from soapstone.dsl.lang.lexer import ParLexer

    assert isinstance(get_lexer_for_filename("examples/gpt.par"), ParLexer)
    assert isinstance(get_lexer_by_name("par"), ParLexer)
    for spec in sorted(ROOT.glob("examples/*.par")):
        toks = list(lex(spec.read_text(), ParLexer()))
        assert not [t for t in toks if t[0] in Error], spec
    toks = list(lex((ROOT / "examples/gpt.par").read_text(), ParLexer()))
    assert (Keyword.Declaration, "sample") in toks and (Keyword.Type, "i64") in toks
    assert (Name.Class, "gpt8") in toks and (Name.Function, "attention") in toks
    assert (Name.Builtin, "1f1b") in toks and (Number.Integer, "16") in toks
