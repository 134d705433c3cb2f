"""Pipeline p2p in groups (shard/plan/p2p_groups.py, proven by p2p_proof.py): every schedule
at pipe 2..8 and microbatches 1..16 has a grouping that the rendezvous simulator (NCCL's
in-order, tagless semantics) runs to the end with FIFO-paired messages, for training and for
infer; bad groupings (receives first and ungrouped, the tag-matched posting ahead, swapped
messages) are caught with the ranks and ops named. Pure data: no torch, no MPI."""

from __future__ import annotations

import attrs
import pytest

from soapstone.shard.plan import p2p_groups as pg
from soapstone.shard.plan import schedules
from soapstone.shard.plan.schedules import Action
from soapstone.shard.plan.verify import p2p_proof as proof


def _all_schedules():
    for kind in schedules.KINDS:
        for p in range(2, 9):
            for m in range(1, 17):
                for c in ((2, 3) if kind == "interleaved" else (1,)):
                    try:
                        yield schedules.build(kind, p, m, c)
                    except schedules.ScheduleError:  # e.g. interleaved needs p | m
                        continue


def test_every_schedule_has_a_proven_grouping():
    seen = {}
    for s in _all_schedules():
        g = proof.choose(s)
        assert g is not None, f"{s.kind} p={s.pipe} m={s.microbatches} c={s.chunks}: " \
                              + proof.unproven(s)
        for fo in (False, True):
            ps = pg.plans(s, fo, g)
            assert proof.simulate(ps).ok and proof.check_fifo(ps) is None
            # two tensors per activation, one per gradient: still paired in order
            assert proof.check_fifo(ps, lambda d, e: 2 if d == "A" else 1) is None
        seen.setdefault((s.kind, g), 0)
        seen[(s.kind, g)] += 1
    # Megatron's choices: consume for the linear pipelines, pairs for interleaved except
    # where every microbatch is warm-up (microbatches = pipe, or fewer than 2 per rank)
    assert {k for k, _ in seen} == set(schedules.KINDS)
    assert seen[("gpipe", "consume")] == seen[("1f1b", "consume")] == \
        seen[("zb1p", "consume")] == 7 * 16
    assert seen[("interleaved", "pairs")] > seen[("interleaved", "consume")] > 0


def test_consume_is_megatrons_1f1b_and_every_receive_is_at_its_consumer():
    s = schedules.build("1f1b", 4, 4)
    text = " ".join(str(x) for x in pg.rank_plan(s, 1))
    # send_forward_recv_backward and send_backward_recv_forward as one group each
    assert text == ("[RA0@1] F0@1 [SA0@1, RA1@1] F1@1 [SA1@1, RA2@1] F2@1 [SA2@1, RG0@1] "
                    "B0@1 [SG0@1, RA3@1] F3@1 [SA3@1, RG1@1] B1@1 [SG1@1, RG2@1] B2@1 "
                    "[SG2@1, RG3@1] B3@1 [SG3@1]"), text
    for s in (schedules.build("zb1p", 4, 8), schedules.build("gpipe", 3, 5)):
        for r in range(s.pipe):
            plan = pg.rank_plan(s, r)
            for i, item in enumerate(plan):
                if isinstance(item, pg.Group):
                    for o in item.ops:
                        if not o.sending:  # read by the next F or B (a W reads no message)
                            nxt = next(x for x in plan[i + 1:] if x.kind != "W")
                            assert (nxt.kind, nxt.mb, nxt.stage) == (
                                "F" if o.direction == "A" else "B", o.action.mb,
                                o.action.stage)
                elif item.kind in ("F", "B"):  # what it sends leaves right after it
                    sends = item.stage < s.stages - 1 if item.kind == "F" else item.stage > 0
                    if sends:
                        nxt = plan[i + 1]
                        assert isinstance(nxt, pg.Group), (r, i, item, nxt)
                        assert any(o.sending and (o.action.mb, o.action.stage) ==
                                   (item.mb, item.stage) for o in nxt.ops), (r, i, item, nxt)


def test_zb1p_sends_the_input_gradient_before_w_runs():
    s = schedules.build("zb1p", 4, 8)
    text = " ".join(str(x) for x in pg.rank_plan(s, 1))
    assert "B1@1 [SG1@1, RA4@1] W0@1" in text, text  # not B1@1 W0@1 [SG1@1, ...]


def test_pairs_is_megatrons_interleaved_steady_state():
    s = schedules.build("interleaved", 2, 4, 2)
    text = " ".join(str(x) for x in pg.rank_plan(s, 1, grouping="pairs"))
    # a forward and a backward back to back, then their sends and the next pair's receives
    assert "F2@1 B0@1 [SA2@1, SG0@1, RA3@1, RG1@1] F3@1 B1@1" in text, text


def _ungrouped_receives_first(plan):
    out = []
    for item in plan:
        if isinstance(item, pg.Group):
            ops = sorted(item.ops, key=lambda o: o.sending)
            out.extend(pg.Group((o,)) for o in ops)
        else:
            out.append(item)
    return tuple(out)


def test_receives_first_and_ungrouped_deadlock_and_name_the_ranks():
    s = schedules.build("1f1b", 2, 4)
    bad = {r: _ungrouped_receives_first(p) for r, p in pg.plans(s).items()}
    got = proof.simulate(bad)
    assert not got.ok
    text = got.describe()
    # rank 0 waits in its receive of the first gradient, rank 1 in the next activation's
    assert "rank 0 waits in group" in text and "RG0@0 (recv edge 0 from rank 1)" in text, text
    assert "rank 1 waits in group" in text and "RA" in text, text
    assert {s.rank for s in got.stuck} == {0, 1}
    assert all(len(s.unmatched) == 1 and not s.unmatched[0].sending for s in got.stuck)


def test_posting_ahead_as_mpi_does_deadlocks_under_nccl():
    """with_comm's order (receives one action ahead, matched by tag on MPI) as single-op
    groups: what check_device refused before grouping existed."""
    for kind, p, m, c in (("1f1b", 2, 4, 1), ("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2)):
        s = schedules.build(kind, p, m, c)
        ahead = {r: tuple(pg.Group((pg.p2p_of(s, a),)) if a.kind[0] in "RS" else a
                          for a in s.with_comm(r)) for r in range(p)}
        assert not proof.simulate(ahead).ok, (kind, p, m)


def test_interleaved_with_receives_at_the_consumer_deadlocks_so_pairs_is_chosen():
    s = schedules.build("interleaved", 2, 4, 2)
    got = proof.simulate(pg.plans(s, grouping="consume"))
    assert not got.ok
    # both ranks stuck in a send whose receive the other posts later: the ring of stages
    assert all(any(o.sending for o in x.unmatched) for x in got.stuck), got.describe()
    assert proof.choose(s) == "pairs"


def test_fifo_catches_messages_out_of_order():
    s = schedules.build("1f1b", 2, 4)
    ps = dict(pg.plans(s))
    # rank 1 receives microbatches 1 and 2 in swapped groups: same count, other order
    plan = list(ps[1])
    i = next(k for k, x in enumerate(plan) if isinstance(x, pg.Group)
             and any(o.action == Action("RA", 1, 1) for o in x.ops))
    j = next(k for k, x in enumerate(plan) if isinstance(x, pg.Group)
             and any(o.action == Action("RA", 2, 1) for o in x.ops))

    def swap(g, a, b):
        return pg.Group(tuple(attrs.evolve(o, action=b) if o.action == a else o for o in g.ops))

    plan[i] = swap(plan[i], Action("RA", 1, 1), Action("RA", 2, 1))
    plan[j] = swap(plan[j], Action("RA", 2, 1), Action("RA", 1, 1))
    ps[1] = tuple(plan)
    bad = proof.check_fifo(ps)
    assert bad == ("message 2 from pipe rank 0 to 1: rank 0 sends the activation of "
                   "microbatch 1 over edge 0, tensor 0, rank 1 receives it as the activation "
                   "of microbatch 2 over edge 0, tensor 0"), bad
    # a receive dropped: counts differ, and the sender is left in its group
    last = pg.p2p_of(s, Action("RA", 3, 1))
    ps[1] = tuple(pg.Group(tuple(o for o in x.ops if o != last)) if isinstance(x, pg.Group)
                  else x for x in pg.plans(s)[1])
    assert "sends 4 messages to rank 1, which receives 3" in proof.check_fifo(ps)
    got = proof.simulate(ps)
    assert not got.ok and got.stuck[0].rank == 0


@pytest.mark.parametrize("kind,p,m,c", [("1f1b", 2, 1, 1), ("gpipe", 8, 1, 1),
                                        ("zb1p", 8, 16, 1), ("interleaved", 4, 4, 2)])
def test_forward_only_plans_are_proven_too(kind, p, m, c):
    s = schedules.build(kind, p, m, c)
    ps = pg.plans(s, True, proof.choose(s))
    assert all(x.kind == "F" for plan in ps.values() for x in plan
               if not isinstance(x, pg.Group))
    assert proof.simulate(ps).ok and proof.check_fifo(ps) is None


def test_format_plans_draws_each_ranks_groups_with_chunks_and_weights():
    """`show`'s grouped p2p lines: groups in brackets, chunk suffixes under interleaved, and a
    zb1p W after the group that carries its unit's sends."""
    inter = pg.format_plans(schedules.build("interleaved", 2, 2, 2), "pairs").splitlines()
    assert inter[0] == ("p2p on cuda or SOAPSTONE_P2P=grouped (pairs grouping; [...] = one NCCL "
                        "group):")
    assert inter[1].startswith("  rank 0 | F0:0 [SA0:0] F1:0 [SA1:0 RA0:1] F0:1")
    zb = pg.format_plans(schedules.build("zb1p", 2, 2), "consume").splitlines()
    assert zb[1] == "  rank 0 | F0 [SA0] F1 [SA1 RG0] B0 [RG1] W0 B1 W1", zb


def test_show_prints_the_grouped_p2p_or_why_a_pipeline_cannot_run_on_cuda(monkeypatch):
    import json

    from soapstone import dsl
    from soapstone.dsl.app.show_text import render
    from soapstone.shard.plan.verify import p2p_proof

    spec = dsl.load("examples/gpt2.par")
    assert "  rank 1 | [RA0] F0 B0 [SG0 RA1] F1 B1" in render(spec, parallel="pp2")
    data = json.loads(render(spec, parallel="pp2", as_json=True))
    assert data["p2p_grouping"] == "consume"
    assert data["p2p_grouped"][1][:3] == ["[RA0@1]", "F0@1", "B0@1"]
    monkeypatch.setattr(p2p_proof, "choose", lambda sched: None)
    monkeypatch.setattr(p2p_proof, "unproven", lambda sched: "consume: a deadlock")
    assert "p2p: cannot run on cuda (consume: a deadlock)\n" in render(spec, parallel="pp2")
    assert json.loads(render(spec, parallel="pp2", as_json=True))["p2p_grouped"] is None
