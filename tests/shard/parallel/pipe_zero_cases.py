"""ZeRO 2 and 3 inside pipeline stages under mpiexec (tests/shard/parallel/test_pipe_zero.py), on
tests/specs/pipe_zero_layouts.par (2-stage 1F1B x data parallel 2):

- golden: ZeRO-2, ZeRO-3 and ZeRO-3 with `recompute layer` reproduce gpt.par's single-rank
  record (tests/golden/runs/gpt.npz);
- explain vs counters (measure.measure_pipeline; ZeRO-3 with recompute too): every rank's
  communicator counters over one step equal explain's figures for its pipe rank, each flight
  recorder holds the plan's calls in order (shard/plan/verify/sequence.py), and param/grad/optimizer
  memory is within 10%;
- tied weights (tests/specs/pipe_zero_tied.par, gpt2.par's head tied to its embedding): both,
  against gpt2.par's record.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpirun import ranks

from soapstone.dsl.testing import assert_matches_golden

sys.path.insert(0, str(Path(__file__).parent))
from measure import measure_pipeline  # noqa: E402  (the explain cases' step measurement)

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "tests/specs/pipe_zero_layouts.par"
TIED = ROOT / "tests/specs/pipe_zero_tied.par"


@ranks(4)
def case_pipeline_zero_reproduces_the_single_rank_run():
    for layout in ("pp2dp2z2", "pp2dp2z3", "pp2dp2z3rc"):
        assert_matches_golden(str(SPEC), layout, str(ROOT / "tests/golden/runs/gpt.npz"))


@ranks(4)
def case_pipeline_zero_explain_matches_counters():
    for layout in ("pp2dp2z2", "pp2dp2z3", "pp2dp2z3rc"):
        measure_pipeline(SPEC, layout, "adamw")


@ranks(4)
def case_pipeline_zero2_tied_weights_reproduce_and_match_counters():
    """A weight tied across the stages is reduce-scattered once per step, not per microbatch:
    explain counted it per microbatch before (4 KiB a rank the runtime never sent)."""
    assert_matches_golden(str(TIED), "pp2dp2z2tied", str(ROOT / "tests/golden/runs/gpt2.npz"))
    measure_pipeline(TIED, "pp2dp2z2tied", "adamw")
