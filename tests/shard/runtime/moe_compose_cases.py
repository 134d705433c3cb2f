"""MoE composed with the other techniques under mpiexec (tests/shard/runtime/test_moe_compose.py),
on tests/specs/moe_compose.par (two blocks of SwiGLU experts plus a shared expert, with drops):

- tensor parallel inside an expert (ep2tp2) and ZeRO 1/2/3 with the experts over another axis
  than the data (dp2ep2z1..3) or over the data axis itself (dpepz3) reproduce the plain
  single-rank run;
- pipelines (pp2, pp2ep2 with the experts split in each stage, pp2dp2 with each microbatch's
  tokens routed over data) reproduce the single-rank run with the same microbatching (acc2:
  gradient accumulation on one rank), since a moe layer's capacity and balance loss count
  the tokens of one microbatch;
- explain's figures equal the counters of a real step and the flight recorder holds the
  plan's calls (measure.measure) for the ZeRO-3 layouts, whose expert weights ZeRO
  shards over data only where they are replicated over it.

Each rank records the single-rank runs itself (2 steps) into a temporary directory.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mpirun import ranks

from soapstone.comm import init
from soapstone.dsl.testing import assert_matches_golden, record_golden

sys.path.insert(0, str(Path(__file__).parent))
from measure import measure  # noqa: E402  (explain vs counters, flight recorder order)

ROOT = Path(__file__).resolve().parents[3]
SPEC = str(ROOT / "tests/specs/moe_compose.par")
W = init("mpi")
# layout -> the one-rank run it reproduces (None: the plain model, whole batches)
REFERENCE = {2: {"pp2": "acc2", "dpepz3": None},
             4: {"ep2tp2": None, "pp2ep2": "acc2", "pp2dp2": "acc2", "dp2ep2z1": None,
                 "dp2ep2z2": None, "dp2ep2z3": None}}
MEASURE = {2: ("dpepz3",), 4: ("dp2ep2z3",)}


@ranks(2, 4)
def case_moe_layouts_reproduce_their_single_rank_runs():
    with tempfile.TemporaryDirectory() as tmp:
        records = {}
        for layout, ref in REFERENCE[W.size].items():
            if ref not in records:
                records[ref] = str(Path(tmp) / f"{ref or 'plain'}.{W.rank}.npz")
                record_golden(SPEC, records[ref], steps=2, parallel=ref)
            assert_matches_golden(SPEC, layout, records[ref])


@ranks(2, 4)
def case_moe_zero_explain_matches_counters():
    for layout in MEASURE[W.size]:
        measure(SPEC, layout, "adamw")
