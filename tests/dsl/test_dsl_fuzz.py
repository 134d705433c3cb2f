"""Fuzz the front end: mutated valid specs and random text may only raise SpecError, and every
diagnostic must point inside the file it names. A mutated spec that loads has each of its
parallel blocks compiled too (lower, or lower_pipeline for blocks with pipeline stages): the
checker must let through only what the compiler accepts or rejects with a located SpecError
(LoweringError is one). The deep checks go on through what the commands do with a spec that
compiles: `show`'s text, `explain`'s estimate and checkpoint bytes, and the proof before
launch (`check --verify`, `run`): any failure must be a UserError (exit 2), never a traceback.

The mutations: token edits (delete, duplicate, swap, replace with or insert any token of the
corpus) and numbers swapped for absurd ones (0, negatives, 1e20, NaN, ...), over every example
and every self-contained test spec. Besides hypothesis' examples, a fixed corpus of 156 seeded
mutations (as many as the issue's run, which found a traceback) runs the deep checks every
time, and tests/fuzz_regressions/ keeps what wider runs found.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from soapstone.comm.errors import UserError
from soapstone.dsl import SpecError, load
from soapstone.dsl.app.show_text import render
from soapstone.dsl.compile.layout_proof import prove_layout
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_graph, lower_pipeline
from soapstone.dsl.layers.custom import load_plugin
from soapstone.shard.plan.analysis.checkpoint_size import checkpoint_bytes
from soapstone.shard.plan.analysis.explain import estimate, estimate_pipeline

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
load_plugin(str(EXAMPLES / "custom_layer.py"))  # examples/swiglu.par's layer
FILES = sorted(EXAMPLES.glob("*.par")) + sorted(
    p for p in (ROOT / "tests/specs").glob("*.par") if "include" not in p.read_text())
SOURCES = [p.read_text() for p in FILES]
TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_]\w*|\d+(?:\.\d+)?|->|\.\.|\S|\s+')
TOKENS = [TOKEN.findall(s) for s in SOURCES]
VOCAB = sorted({t for ts in TOKENS for t in ts if not t.isspace()}) + ["include", '"x.par"', "@"]
NUMBERS = ["0", "1", "2", "3", "7", "-1", "0.0", "-0.5", "1e30", "65536", "1000000007",
           "99999999999999999999", "nan", "inf"]
OPS = ["delete", "duplicate", "swap", "replace", "insert", "number"]
REGRESSIONS = sorted((ROOT / "tests/fuzz_regressions").glob("*.par"))


def _located(e: SpecError, text: str) -> None:
    lines = text.splitlines()
    assert e.diagnostics
    for d in e.diagnostics:
        if d.file == "fuzz.par":
            assert 1 <= d.line <= max(len(lines), 1) + 1, d.format()
            assert d.col >= 1, d.format()
        d.format()


def _check(text: str):
    """Load and compile every layout; the spec, or None when it is (rightly) refused."""
    try:
        # A trailing newline keeps a generated text such as ".par" from being read as a path.
        spec = load(text + "\n", filename="fuzz.par")
    except SpecError as e:
        _located(e, text)
        return None
    for par in spec.parallels.values():
        model = spec.models[par.model]
        try:
            (lower_pipeline if par.operator else lower)(model, par)
        except SpecError as e:
            _located(e, text)
            assert all(d.file == "fuzz.par" and d.line >= 1 for d in e.diagnostics), e.format()
    return spec


def _deep(text: str) -> None:
    """_check, then what show, explain and the proof do with each layout: UserErrors only."""
    spec = _check(text)
    if spec is None:
        return
    for name in spec.models:
        render(spec, name, None)
    for name, par in spec.parallels.items():
        try:
            render(spec, None, name)
            model = spec.models[par.model]
            graph = lower_graph(model, par)
            if len(graph.stages) == 1 and graph.microbatches == 1:
                estimate(graph.program, zero=par.zero)
            else:
                estimate_pipeline(graph, zero=par.zero)
            checkpoint_bytes(graph)
            prove_layout(model, graph)
        except UserError as e:
            e.format()  # printable: what the command would say


def mutate(toks: list[str], edits: list[tuple[str, int, str]]) -> str:
    """Apply (operation, position, token) edits to a token list; the spec's text."""
    toks = list(toks)
    for op, at, tok in edits:
        if not toks:
            break
        i = at % len(toks)
        if op == "delete":
            del toks[i]
        elif op == "duplicate":
            toks.insert(i, toks[i])
        elif op == "swap" and i + 1 < len(toks):
            toks[i], toks[i + 1] = toks[i + 1], toks[i]
        elif op == "replace":
            toks[i] = tok
        elif op == "insert":
            toks.insert(i, " " + tok + " ")
        elif op == "number":
            numbers = [j for j, t in enumerate(toks) if re.fullmatch(r"\d+(?:\.\d+)?", t)]
            if numbers:
                toks[numbers[at % len(numbers)]] = tok
    return "".join(toks)


@st.composite
def mutated(draw):
    toks = draw(st.sampled_from(TOKENS))
    edits = []
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(OPS))
        tok = draw(st.sampled_from(NUMBERS if op == "number" else VOCAB))
        edits.append((op, draw(st.integers(0, 10**6)), tok))
    return mutate(toks, edits)


def corpus(n: int = 156, seed: int = 29) -> list[str]:
    """n mutated specs from a fixed seed (the same every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = rng.choice(TOKENS)
        edits = []
        for _ in range(rng.randint(1, 6)):
            op = rng.choice(OPS)
            edits.append((op, rng.randrange(10**6),
                          rng.choice(NUMBERS if op == "number" else VOCAB)))
        out.append(mutate(toks, edits))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_specs_raise_only_spec_errors(text):
    _check(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_specs_show_explain_and_prove_or_raise_user_errors(text):
    _deep(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_raises_only_spec_errors(text):
    _check(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(VOCAB + [" ", "\n"]), max_size=60))
def test_random_token_soup_raises_only_spec_errors(toks):
    _check(" ".join(toks))


def test_the_156_mutation_corpus():
    texts = corpus()
    assert len(texts) == 156 and len(set(texts)) > 140
    for text in texts:
        _deep(text)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_what_wider_fuzzing_found(path):
    _deep(path.read_text())


def test_the_sources_are_every_example():
    assert {p.name for p in EXAMPLES.glob("*.par")} <= {p.name for p in FILES}
    assert len(REGRESSIONS) >= 3
