"""Fuzz the front end: mutated valid specs and random text may only raise SpecError, and every
diagnostic must point inside the file it names. A mutated spec that loads has each of its
parallel blocks compiled too (lower, or lower_pipeline for blocks with pipeline stages): the
checker must let through only what the compiler accepts or rejects with a located SpecError
(LoweringError is one)."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from soapstone.dsl import SpecError, load
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SOURCES = [(EXAMPLES / n).read_text() for n in ("gpt.par", "mlp.par")]
TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_]\w*|\d+(?:\.\d+)?|->|\.\.|\S|\s+')
TOKENS = [TOKEN.findall(s) for s in SOURCES]
VOCAB = sorted({t for ts in TOKENS for t in ts if not t.isspace()}) + ["include", '"x.par"', "@"]


def _located(e: SpecError, text: str) -> None:
    lines = text.splitlines()
    assert e.diagnostics
    for d in e.diagnostics:
        if d.file == "fuzz.par":
            assert 1 <= d.line <= max(len(lines), 1) + 1, d.format()
            assert d.col >= 1, d.format()
        d.format()


def _check(text: str) -> None:
    try:
        spec = load(text, filename="fuzz.par")
    except SpecError as e:
        _located(e, text)
        return
    for par in spec.parallels.values():
        model = spec.models[par.model]
        try:
            (lower_pipeline if par.operator else lower)(model, par)
        except SpecError as e:
            _located(e, text)
            assert all(d.file == "fuzz.par" and d.line >= 1 for d in e.diagnostics), e.format()


@st.composite
def mutated(draw):
    toks = list(draw(st.sampled_from(TOKENS)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(toks) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "replace", "insert"]))
        if op == "delete":
            del toks[i]
        elif op == "duplicate":
            toks.insert(i, toks[i])
        elif op == "swap" and i + 1 < len(toks):
            toks[i], toks[i + 1] = toks[i + 1], toks[i]
        elif op == "replace":
            toks[i] = draw(st.sampled_from(VOCAB))
        else:
            toks.insert(i, " " + draw(st.sampled_from(VOCAB)) + " ")
        if not toks:
            break
    return "".join(toks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_specs_raise_only_spec_errors(text):
    _check(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_raises_only_spec_errors(text):
    _check(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(VOCAB + [" ", "\n"]), max_size=60))
def test_random_token_soup_raises_only_spec_errors(toks):
    _check(" ".join(toks))
