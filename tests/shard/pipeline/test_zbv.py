"""The V-shaped schedules: zbv (ZB-V) as data (its placement, each F/B/W once, its bubble
against its closed form, its peaks in flight, NCCL-safe grouping proven), the spec's rules
for a V, and the runs under mpiexec (tests/shard/pipeline/zbv_cases.py)."""

from __future__ import annotations

import pytest
from cli_calls import cli
from mpirun import case_names, case_params

from soapstone.shard.plan import p2p_groups, schedules
from soapstone.shard.plan.analysis.in_flight import walk_in_flight
from soapstone.shard.plan.schedules.placement import cut, v_shape
from soapstone.shard.plan.verify import p2p_proof

CASES = "tests/shard/pipeline/zbv_cases.py"
SIZES = [(2, 1), (2, 4), (2, 5), (3, 2), (3, 8), (4, 4), (4, 8), (4, 9), (8, 16)]


def test_v_placement_goes_down_the_ranks_and_back():
    assert [v_shape(v, 4) for v in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1),
                                                 (2, 1), (1, 1), (0, 1)]
    assert schedules.get("zbv").ranks(2, 2) == [0, 1, 1, 0]
    # the last rank's two ranges are two stages; elsewhere ranges on one rank stay one
    assert cut([(0, "a"), (1, "b"), (1, "c"), (0, "d")], [0, 1, 1, 0]) == [0, 1, 2, 3]
    assert cut([(0, "a"), (0, "b"), (1, "c")], [0, 1]) == [0, 0, 1]
    assert cut([(0, "a"), (1, "b"), (1, "b"), (0, "d")], [0, 1, 1, 0]) == [0, 1, 1, 2]


@pytest.mark.parametrize("p,m", SIZES)
def test_zbv_runs_each_f_b_w_once_per_stage_and_its_bubble_is_its_closed_form(p, m):
    s = schedules.build("zbv", p, m)
    assert s.chunks == 2 and s.stages == 2 * p
    for r in range(p):
        acts = s.ranks[r]
        mine = (r, 2 * p - 1 - r)
        assert sorted((a.kind, a.mb, a.stage) for a in acts) == sorted(
            (k, i, v) for k in "FBW" for i in range(m) for v in mine)
        for a in acts:  # a W after its B
            if a.kind == "W":
                assert acts.index(schedules.Action("B", a.mb, a.stage)) < acts.index(a)
    assert s.simulated_bubble() == pytest.approx(s.theory_bubble(), abs=1e-12)
    if 2 * m >= 3 * p - 1:
        assert s.theory_bubble() == pytest.approx((p - 1) / (6 * m + p - 1))
        assert s.theory_bubble() < schedules.build("zb1p", p, m).theory_bubble()


@pytest.mark.parametrize("p,m", SIZES)
def test_zbv_hand_off_at_the_turn_is_no_message_and_grouped_p2p_is_proven(p, m):
    s = schedules.build("zbv", p, m)
    turn = p - 1  # edge p-1 joins stages p-1 and p, both on the last rank
    for r in range(p):
        for a in s.with_comm(r):
            assert a.kind.compute or a.kind.edge(a.stage) != turn, a
    grouping = p2p_proof.choose(s)
    assert grouping is not None, p2p_proof.unproven(s)
    for r in range(p):
        for g in p2p_groups.rank_plan(s, r, False, grouping):
            if isinstance(g, p2p_groups.Group):
                assert all(o.edge != turn and o.peer != r for o in g.ops), g


def test_zbv_walk_of_2p_has_the_peaks_of_any_m():
    for p in (2, 3, 4):
        for r in range(p):
            want = walk_in_flight("zbv", p, 2 * p, 2, r)
            assert all(walk_in_flight("zbv", p, m, 2, r) == want for m in (2 * p + 1, 5 * p))
    # activations: at most 2P microbatch-chunks per rank, P microbatches' worth
    s = schedules.build("zbv", 4, 16)
    for acts in s.ranks:
        live = peak = 0
        for a in acts:
            live += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak <= 2 * 4


def test_zbv_drawn():
    text = schedules.build("zbv", 2, 4).format()
    assert "zbv: pipe=2 microbatches=4 chunks=2  bubble 4.0% (fwd:bwd 1:2), theory 4.0%" \
        in text, text
    assert "rank 1 |    . F0:0 F0:1 F1:0 F1:1 B0:1 W0:1" in text, text


@pytest.mark.parametrize("case,n", case_params(CASES, [c for c in case_names(CASES)
                                                      if c.startswith("case_zbv")]))
def test_zbv_cases(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_show_and_explain_print_the_v_schedules():
    """`show` draws each V schedule and its NCCL groups and says the turn is handed over in
    memory; explain prints each one's formula and memory note."""
    spec = "tests/specs/zbv_layouts.par"
    show_zbv, show_dpv, explain_dpv = cli(
        ["show", spec, "--parallel", "pp2zbv"], ["show", spec, "--parallel", "pp2dpv"],
        ["explain", spec, "--parallel", "pp4dpv"])
    assert all(r["rc"] == 0 for r in (show_zbv, show_dpv, explain_dpv))
    for r, kind in ((show_zbv, "zbv"), (show_dpv, "dualpipev")):
        text = r["text"]
        assert f"schedule {kind}: pipe=2 microbatches=4 chunks=2" in text, text
        assert "edge 1 -> 2  (pipe 1 -> 1): 4.0 KiB per microbatch per rank, handed over in " \
            "memory, no p2p" in text, text
        assert " grouping; [...] = one NCCL group)" in text, text  # a proven grouping
        assert "cannot run on cuda" not in text
    text = explain_dpv["text"]
    assert "dualpipev, 8 microbatches: bubble 0.059 = (p-1)/(6m+p-1); published " \
        "(PP/2-1)(F&B+B-3W)" in text, text
    assert "dualpipev memory: parameters 1x" in text and "edge 3 -> 4  on pipe rank 3: handed " \
        "over in memory, no p2p" in text, text
