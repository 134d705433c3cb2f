"""The zero-bubble schedule zb1p (ZB-H1): the schedule as data, its bubble, and the runs under
mpiexec (tests/shard/pipeline/zb_cases.py: golden, bitwise equal to 1F1B, explain and the verifier
against the comm layer's counters and flight recorder)."""

from __future__ import annotations

import pytest
from mpirun import case_names, case_params

from soapstone.shard.plan import schedules

CASES = "tests/shard/pipeline/zb_cases.py"


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (8, 4), (8, 16)])
def test_zb1p_runs_each_f_b_w_once_and_its_simulated_bubble_is_its_theory(p, m):
    s = schedules.build("zb1p", p, m)
    for r in range(p):
        acts = s.ranks[r]
        assert sorted((a.kind, a.mb) for a in acts) == sorted(
            (k, i) for k in "FBW" for i in range(m))
        for i in range(m):  # a microbatch's W after its B
            assert acts.index(schedules.Action("W", i, r)) > acts.index(
                schedules.Action("B", i, r))
    assert s.simulated_bubble() == pytest.approx(s.theory_bubble(), abs=1e-12)
    if m >= p:
        assert s.theory_bubble() == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 8), (4, 2)])
def test_zb1p_bubble_is_below_1f1b(p, m):
    zb, f1b = schedules.build("zb1p", p, m), schedules.build("1f1b", p, m)
    assert zb.simulated_bubble() < f1b.simulated_bubble()
    if m >= p:  # a third of 1F1B's idle time per rank
        idle = [(1 - b) ** -1 * b for b in (zb.theory_bubble(), f1b.theory_bubble())]
        assert idle[0] * 3 * m == pytest.approx(idle[1] * m)


def test_zb1p_drawn_and_its_messages():
    s = schedules.build("zb1p", 2, 4)
    text = s.format()
    assert "zb1p: pipe=2 microbatches=4  bubble 7.7% (fwd:bwd 1:2), theory 7.7%" in text, text
    assert "rank 0 | F0 F1  . B0 W0 F2 B1 W1 F3 B2 W2 B3 W3" in text, text
    assert "rank 1 |  . F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3" in text, text
    # B sends the input gradient at once; W sends nothing
    acts = [str(a) for a in s.with_comm(1)]
    assert acts[acts.index("B0@1") + 1] == "SG0@1" and acts[acts.index("W0@1") + 1][0] != "S"


def test_zb1p_holds_1f1b_peak_activations_until_w():
    """Every rank keeps a microbatch's values from F to W: at most min(P, M), 1F1B's peak."""
    for p, m in ((4, 8), (4, 2)):
        s = schedules.build("zb1p", p, m)
        for acts in s.ranks:
            live = peak = 0
            for a in acts:
                live += {"F": 1, "W": -1}.get(a.kind, 0)
                peak = max(peak, live)
            assert peak == min(p, m)


@pytest.mark.parametrize("case,n", case_params(CASES, case_names(CASES)))
def test_zb_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)
