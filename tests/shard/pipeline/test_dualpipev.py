"""DualPipeV as data (its V placement, each F/B/W once per stage, F and B of different
microbatches back to back, its bubble against its closed form, its peak of 2P+1
microbatch-chunks, NCCL-safe grouping proven, its least microbatches) and its runs under
mpiexec (tests/shard/pipeline/zbv_cases.py, the V schedules' cases)."""

from __future__ import annotations

import pytest
from mpirun import case_names, case_params

from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis.in_flight import walk_in_flight
from soapstone.shard.plan.verify import p2p_proof

CASES = "tests/shard/pipeline/zbv_cases.py"
SIZES = [(2, 4), (2, 5), (3, 6), (3, 9), (4, 8), (4, 11), (8, 16)]


@pytest.mark.parametrize("p,m", SIZES)
def test_dualpipev_runs_each_f_b_w_once_and_its_bubble_is_its_closed_form(p, m):
    s = schedules.build("dualpipev", p, m)
    assert s.chunks == 2 and s.rank_of(0) == s.rank_of(2 * p - 1) == 0
    for r in range(p):
        acts = s.ranks[r]
        mine = (r, 2 * p - 1 - r)
        assert sorted((a.kind, a.mb, a.stage) for a in acts) == sorted(
            (k, i, v) for k in "FBW" for i in range(m) for v in mine)
        # the steady state: a forward of one chunk and a backward of the other chunk, of
        # another microbatch, back to back (DualPipe's overlapped F&B)
        pairs = [(a, b) for a, b in zip(acts, acts[1:], strict=False)
                 if a.kind == "F" and b.kind == "B" and a.stage != b.stage and a.mb != b.mb]
        assert len(pairs) >= m - 2 * p + r + 1
    assert s.simulated_bubble() == pytest.approx(s.theory_bubble(), abs=1e-12)
    assert s.theory_bubble() == pytest.approx((p - 1) / (6 * m + p - 1))
    assert s.theory_bubble() < schedules.build("zb1p", p, m).theory_bubble()
    assert p2p_proof.choose(s) is not None, p2p_proof.unproven(s)


def test_dualpipev_holds_2p_plus_1_microbatch_chunks_and_a_walk_of_2p_has_its_peaks():
    for p in (2, 3, 4):
        for acts in schedules.build("dualpipev", p, 4 * p).ranks:
            live = peak = 0
            for a in acts:
                live += {"F": 1, "W": -1}.get(a.kind, 0)
                peak = max(peak, live)
            assert peak == 2 * p + 1  # the published PP + 1, PP = 2P stages
        for r in range(p):
            want = walk_in_flight("dualpipev", p, 2 * p, 2, r)
            assert walk_in_flight("dualpipev", p, 5 * p, 2, r) == want


def test_dualpipev_needs_two_microbatches_per_stage():
    """(The checker's located message: tests/bad_specs/dualpipev_microbatches.par.)"""
    with pytest.raises(schedules.ScheduleError, match="microbatches >= 8 at pipe 4"):
        schedules.build("dualpipev", 4, 7)


def test_dualpipev_drawn():
    text = schedules.build("dualpipev", 2, 4).format()
    assert "dualpipev: pipe=2 microbatches=4 chunks=2  bubble 4.0% (fwd:bwd 1:2), theory " \
        "4.0%" in text, text
    assert "rank 0 | F0:0 F1:0 F2:0 F0:1 B0:1 W0:1 F1:1 F3:0 B1:1 W1:1" in text, text


@pytest.mark.parametrize("case,n", case_params(CASES, [c for c in case_names(CASES)
                                                      if c.startswith("case_dualpipev")]))
def test_dualpipev_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
