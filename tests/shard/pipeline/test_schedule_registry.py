"""The schedules room (shard/plan/schedules/): the action kinds' one table, the registry every
reader asks, and the placement each schedule owns."""

from __future__ import annotations

import pytest

from soapstone.shard.plan import p2p_groups, schedules
from soapstone.shard.plan.schedules import Action, ActionKind, Direction, ScheduleKind

K = ActionKind


def test_each_comm_kind_names_its_edge_and_peer():
    """Edge i joins virtual stages i and i + 1; activations flow up the stages, gradients
    down; a receive's peer is the stage that sends it."""
    s = 3
    assert (K.SA.peer(s), K.SA.edge(s)) == (4, 3)
    assert (K.RA.peer(s), K.RA.edge(s)) == (2, 2)
    assert (K.SG.peer(s), K.SG.edge(s)) == (2, 2)
    assert (K.RG.peer(s), K.RG.edge(s)) == (4, 3)
    assert [k for k in K if k.sending] == [K.SA, K.SG]
    assert [k for k in K if k.receiving] == [K.RA, K.RG]
    assert [k for k in K if k.compute] == [K.F, K.B, K.W]
    assert {k.direction for k in (K.F, K.RA, K.SA)} == {Direction.A}
    assert {k.direction for k in (K.B, K.RG, K.SG)} == {Direction.G}
    assert not K.W.messages and K.W.direction is None


def test_a_compute_reads_and_sends_only_where_a_neighbour_is():
    last = 2
    assert Action("F", 0, 0).receive(last) is None
    assert Action("F", 1, 1).receive(last) == Action("RA", 1, 1)
    assert Action("F", 1, 2).send(last) is None
    assert Action("B", 1, 2).receive(last) is None
    assert Action("B", 1, 1).send(last) == Action("SG", 1, 1)
    assert Action("B", 1, 0).send(last) is None
    assert Action("W", 1, 1).receive(last) is None and Action("W", 1, 1).send(last) is None
    # what each compute waits for: its input's producer, else what it follows on its stage
    assert Action("F", 0, 0).waits_for(last) is None
    assert Action("F", 0, 1).waits_for(last) == (K.F, 0, 0)
    assert Action("B", 0, 1).waits_for(last) == (K.B, 0, 2)
    assert Action("B", 0, 2).waits_for(last) == (K.F, 0, 2)
    assert Action("W", 0, 1).waits_for(last) == (K.B, 0, 1)


def test_action_kinds_are_enum_members_and_print_as_letters():
    a = Action("SG", 2, 1)
    assert a.kind is K.SG and str(a) == "SG2@1"
    with pytest.raises(ValueError):
        Action("X", 0, 0)


@pytest.mark.parametrize("name", schedules.KINDS)
def test_every_registered_schedule_builds_and_its_messages_pair(name):
    """Each message a rank sends is one its peer (by the schedule's placement) receives."""
    spec = schedules.get(name)
    p, m, c = 4, 8, 2 if spec.chunked else 1
    s = schedules.build(name, p, m, c)
    assert s.spec is spec
    sent, got = [], []
    for r in range(p):
        for a in s.with_comm(r):
            if a.kind.compute:
                assert s.rank_of(a.stage) == r
                continue
            msg = p2p_groups.p2p_of(s, a)
            assert s.rank_of(a.kind.peer(a.stage)) == msg.peer
            key = (a.kind.direction, a.mb, msg.edge)
            (sent if a.kind.sending else got).append((r, msg.peer, key) if a.kind.sending
                                                     else (msg.peer, r, key))
    assert sorted(sent) == sorted(got) and sent


def test_placement_is_the_schedules_own():
    """A schedule with another placement gets its stages' ranks from it alone."""
    def v_shape(stage: int, pipe: int) -> tuple[int, int]:
        chunk, i = divmod(stage, pipe)
        return (i if chunk % 2 == 0 else pipe - 1 - i), chunk

    v = ScheduleKind("v", schedules.get("1f1b").actions, place=v_shape, chunked=True)
    assert v.ranks(4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [v.stage_at(r, 1, 4) for r in range(4)] == [7, 6, 5, 4]
    assert schedules.get("interleaved").ranks(4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_unknown_schedule_is_refused_naming_the_registry():
    """(The checker's message for a spec: tests/bad_specs/schedule_unknown.par.)"""
    with pytest.raises(schedules.ScheduleError, match="use one of " + ", ".join(
            schedules.KINDS)):
        schedules.build("gpipee", 2, 2)
    assert schedules.KINDS == ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
    assert schedules.SPLIT == ("zb1p", "zbv", "dualpipev") and schedules.CHUNKED == ("interleaved",)
