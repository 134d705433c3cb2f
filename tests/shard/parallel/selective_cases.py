"""Selective recompute under mpiexec (tests/shard/parallel/test_selective.py).

- golden: gpt.par's model under `recompute selective` in tests/specs/selective_layouts.par
  (data, tensor, sequence parallel, a 2-stage 1F1B pipeline, ZeRO-3) reproduces gpt.par's
  single-rank record, as the same layouts without it do;
- explain vs counters (measure.measure): rebuilding a dropped value makes no collective, so
  under sequence parallel and ZeRO-3 the communicators' `stats` over one step still equal
  explain's figures, and each flight recorder the plan's calls in order;
- dropout: a model whose dropped values include a dropout's output trains bitwise as without
  selective recompute, in a 1F1B pipeline and under gpipe accumulation;
- `recompute ops` (tests/specs/op_policy_layouts.par, llama.par's model): ZeRO-3 and tensor
  parallel reproduce llama.par's record; under ZeRO-3 it trains bitwise as without it,
  gathering each bucket as often (the rebuilt matmuls use backward's own gather), and the
  counters equal explain's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpirun import ranks

from soapstone.comm import Mesh, init
from soapstone.dsl.testing import assert_matches_golden

sys.path.insert(0, str(Path(__file__).parent))
from measure import measure  # noqa: E402  (the explain cases' step measurement)
from recompute_cases import train_twice  # noqa: E402  (two SGD steps of a layout)

ROOT = Path(__file__).resolve().parents[3]
SPEC = str(ROOT / "tests/specs/selective_layouts.par")
RECORD = str(ROOT / "tests/golden/runs/gpt.npz")
OPS_SPEC = str(ROOT / "tests/specs/op_policy_layouts.par")
W = init("mpi")


@ranks(2)
def case_selective_reproduces_the_single_rank_run():
    for layout in ("sel_dp2", "sel_tp2", "sel_sp2", "sel_pp2", "sel_zero3"):
        assert_matches_golden(SPEC, layout, RECORD)


@ranks(2)
def case_selective_explain_matches_counters():
    for layout in ("sel_sp2", "sel_zero3"):
        measure(SPEC, layout, "adamw")


@ranks(2)
def case_selective_redraws_the_same_dropout_masks():
    """1F1B runs other microbatches' forwards before a value is rebuilt, gpipe accumulation
    both forwards before either backward: the rebuilt dropout still draws its own mask
    (bitwise the same training as without selective recompute)."""
    for plain, mesh in (("dropsel_pp2", Mesh(W, pipe=2)), ("dropsel_acc2", None)):
        want = train_twice(plain, mesh, SPEC)
        got = train_twice(f"{plain}_sel", mesh, SPEC)
        assert got[0] == want[0], (plain, got[0], want[0])
        for name, t in want[1].items():
            assert got[1][name].equal(t), (plain, name)


@ranks(2)
def case_op_policy_under_zero3_trains_as_without_it():
    for layout in ("ops_zero3", "ops_tp2"):
        assert_matches_golden(OPS_SPEC, layout, str(ROOT / "tests/golden/runs/llama.npz"))
    runs = [train_twice(layout, Mesh(W, data=2), OPS_SPEC, gathers=True)
            for layout in ("plain_zero3", "ops_zero3")]
    (want, want_params, want_gathers), (got, got_params, got_gathers) = runs
    assert got == want, (got, want)
    for name, t in want_params.items():
        assert got_params[name].equal(t), name
    assert got_gathers == want_gathers > 0, (got_gathers, want_gathers)
    measure(OPS_SPEC, "ops_zero3", "adamw")
