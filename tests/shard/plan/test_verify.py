"""The static verifier (shard/plan/verify/prove.py) and the per-rank sequences it proves
(shard/plan/verify/sequence.py): every example and test layout verifies; broken stage graphs and
sequences are refused with the right ranks and positions. That the sequences are what a real
step calls, in order, is checked under mpiexec with the explain cases
(tests/shard/train/run_cases.py: every communicator's flight recorder during the step explain's
counters measure)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from soapstone import dsl
from soapstone.comm.errors import UserError
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan import schedules
from soapstone.shard.plan.schedules import Action, Schedule
from soapstone.shard.plan.verify.prove import (
    VerifyError,
    check_bytes,
    representatives,
    verify_layout,
    verify_sequences,
)
from soapstone.shard.plan.verify.sequence import expected_by_comm, rank_sequence, rank_sequences

ROOT = Path(__file__).resolve().parents[3]
SPECS = sorted([*ROOT.glob("examples/*.par"), *ROOT.glob("tests/specs/*.par")])


def _spec(path: Path):
    dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))
    return dsl.load(path)


def _graph(path: str, layout: str):
    s = _spec(ROOT / path)
    par = s.parallel(layout)
    return lower_graph(s.model(par.model), par)


@pytest.fixture(scope="module")
def pp2():
    return _graph("tests/specs/pipe_layouts.par", "pp2f1b")


@pytest.fixture(scope="module")
def dp2tp2():
    return _graph("examples/gpt.par", "dp2tp2")


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_layout_verifies(path):
    s = _spec(path)
    for par in s.parallels.values():
        got = verify_layout(lower_graph(s.model(par.model), par))
        assert got.ranks == par.world_size


@pytest.mark.parametrize("path", [p for p in SPECS if "operator" in p.read_text()],
                         ids=lambda p: p.name)
def test_every_pipeline_layout_verifies_with_grouped_p2p(path):
    """The executor's grouped p2p order (NCCL's): every pipeline layout's sequences pair in
    order and complete; the same messages as posting ahead, in another order."""
    s = _spec(path)
    for par in s.parallels.values():
        graph = lower_graph(s.model(par.model), par)
        if graph.pipe <= 1:
            continue
        reps = representatives(graph)
        got = verify_layout(graph, ranks=reps, p2p="grouped")
        assert got.messages == verify_layout(graph, ranks=reps).messages
        for r in reps:
            ahead, grouped = (expected_by_comm(rank_sequence(graph, r, p2p=m))
                              for m in ("ahead", "grouped"))
            assert ahead.keys() == grouped.keys()
            for key in ahead:
                assert ahead[key]["collective"] == grouped[key]["collective"]
                assert sorted(map(str, ahead[key]["p2p"])) == sorted(
                    map(str, grouped[key]["p2p"]))


def _first_microbatches_swapped_on_rank_1(pp2) -> Schedule:
    """pp2's schedule with pipe rank 1 running the forwards of microbatches 0 and 1 in the
    other order."""
    s = schedules.build(pp2.schedule, 2, pp2.microbatches)
    r1 = list(s.ranks[1])
    i, j = r1.index(Action("F", 0, 1)), r1.index(Action("F", 1, 1))
    r1[i], r1[j] = r1[j], r1[i]
    return Schedule(s.kind, s.pipe, s.microbatches, s.chunks, (s.ranks[0], tuple(r1)))


def test_grouped_p2p_of_a_swapped_schedule_is_refused(pp2):
    swapped = _first_microbatches_swapped_on_rank_1(pp2)
    with pytest.raises(VerifyError, match="message 1 from rank 0 to rank 1"):
        verify_layout(pp2, schedule=swapped, p2p="grouped")


def test_sequence_fields(dp2tp2):
    seq = rank_sequence(dp2tp2, 0)
    first = seq[0]
    assert first.kind == "allreduce" and first.key == "model[0,1]" and first.phase == "forward"
    assert first.shape == (4, 16, 32) and first.dtype == "f32"
    assert first.source == "x"  # the embedding's partial sum over the split vocab
    assert seq[1].source == "layer.0.attention0.y"  # the attention's output projection
    assert any(o.key == "data[0,2]" and o.phase == "grad sync" for o in seq)
    plain = expected_by_comm(seq)
    assert plain["model[0,1]"]["collective"][0]["dtype"] == "float32"
    assert all(isinstance(v, (str, int, list)) for v in plain["model[0,1]"]["collective"][0]
               .values())


def test_locate_names_spec_lines(dp2tp2):
    seq = rank_sequence(dp2tp2, 1, locate=lambda name: "gpt.par:9:5" if name else "")
    assert "gpt.par:9:5" in seq[0].describe()


# -- broken stage graphs and schedules ------------------------------------------------------
def test_receive_of_another_shape(pp2):
    """The receiving stage compiled the boundary tensor with another shape."""
    st1 = pp2.stages[1]
    name = pp2.edges[0].tensors[0].name
    vals = tuple(attrs.evolve(v, local_shape=(v.local_shape[0] + 1,) + v.local_shape[1:])
                 if v.name == name else v for v in st1.program.values)
    broken = attrs.evolve(pp2, stages=(pp2.stages[0], attrs.evolve(
        st1, program=attrs.evolve(st1.program, values=vals))))
    with pytest.raises(VerifyError) as e:
        verify_layout(broken)
    text = str(e.value)
    assert "another shape" in text and "rank 0 (its call" in text and "rank 1 (its call" in text
    assert name in text and "microbatch 0" in text
    assert isinstance(e.value, UserError)


def test_a_failure_names_the_spec_location_of_each_side(pp2):
    from soapstone.dsl.compile.layout_proof import prove_layout

    st1 = pp2.stages[1]
    name = pp2.edges[0].tensors[0].name
    vals = tuple(attrs.evolve(v, dtype="f64") if v.name == name else v
                 for v in st1.program.values)
    broken = attrs.evolve(pp2, stages=(pp2.stages[0], attrs.evolve(
        st1, program=attrs.evolve(st1.program, values=vals))))
    model = _spec(ROOT / "tests/specs/pipe_layouts.par").model(pp2.model)
    with pytest.raises(VerifyError) as e:
        prove_layout(model, broken)
    sides = [line for line in str(e.value).splitlines() if line.startswith("  rank ")]
    assert len(sides) == 2 and " f32 " in sides[0] and " f64 " in sides[1]
    assert all(f"{name} (" in line and ".par:" in line for line in sides), sides


def test_swapped_microbatch_order(pp2):
    """Pipe rank 1 runs microbatches 0 and 1 in the other order: NCCL would pair them wrong."""
    swapped = _first_microbatches_swapped_on_rank_1(pp2)
    with pytest.raises(VerifyError) as e:
        verify_layout(pp2, schedule=swapped)
    text = str(e.value)
    assert "message 1 from rank 0 to rank 1" in text
    assert "microbatch 0" in text and "microbatch 1" in text and "order" in text


def test_one_pipe_column_proves_the_rest(pp2):
    gpt8 = _graph("examples/gpt.par", "gpt8")
    assert representatives(gpt8) == (0, 4) and representatives(_graph(
        "examples/gpt.par", "dp2tp2")) == (0,)
    column = verify_layout(gpt8, ranks=representatives(gpt8))
    assert column.derived == 2 and column.ranks == 8 and "one pipe column of 2" in \
        column.summary()
    # what only p2p between pipe ranks can get wrong is still found from one column
    s = schedules.build(pp2.schedule, 2, pp2.microbatches)
    swapped = Schedule(s.kind, 2, s.microbatches, 1, (s.ranks[0], tuple(reversed(s.ranks[1]))))
    with pytest.raises(VerifyError):
        verify_layout(pp2, schedule=swapped, ranks=representatives(pp2))


def test_a_large_world_is_proved_from_one_pipe_column():
    from soapstone.dsl.compile.layout_proof import EVERY_RANK_UP_TO, prove_layout

    s = dsl.load((ROOT / "examples/gpt.par").read_text() + """
parallel big for gpt on mesh(pipe = 2, data = 64) {
  sample batch -> data
  operator layer[0..1] -> pipe 0, layer[2..3] -> pipe 1
  schedule 1f1b, microbatches = 2
}
""", dims={"batch": 128})
    par = s.parallel("big")
    assert par.world_size > EVERY_RANK_UP_TO
    proof = prove_layout(s.model("gpt"), lower_graph(s.model("gpt"), par))
    assert proof.ranks == 128 and proof.derived == 2


def _without(seqs, rank, pick):
    seq = list(seqs[rank])
    k = next(i for i, o in enumerate(seq) if pick(o))
    gone = seq.pop(k)
    return {**seqs, rank: tuple(seq)}, gone, k + 1


def test_collective_issued_by_part_of_a_group(dp2tp2):
    seqs = rank_sequences(dp2tp2)
    # rank 1 leaves out a collective on model[0,1] unlike the one after it (the 9th: the
    # last forward allreduce before the loss's statistics)
    seq = list(seqs[1])
    on_model = [i for i, o in enumerate(seq) if o.key == "model[0,1]"]
    k = next(n for n in range(len(on_model) - 1)
             if seq[on_model[n]].signature() != seq[on_model[n + 1]].signature())
    assert k == 8
    del seq[on_model[k]]
    with pytest.raises(VerifyError) as e:
        verify_sequences({**seqs, 1: tuple(seq)})
    text = str(e.value)
    assert text.startswith("collective 9 on model[0,1] differs between rank 0 and rank 1")
    assert "rank 0 (its call 9): allreduce (4, 16, 32)" in text
    assert "rank 1 (its call 9): allreduce (4, 16, 1)" in text


def test_collective_missing_at_the_end(dp2tp2):
    seqs = rank_sequences(dp2tp2)
    seq = list(seqs[3])
    last = max(i for i, o in enumerate(seq) if o.key == "data[1,3]")
    del seq[last]
    with pytest.raises(VerifyError) as e:
        verify_sequences({**seqs, 3: tuple(seq)})
    assert "rank 3 issues none" in str(e.value) and "data[1,3]" in str(e.value)


def test_missing_receive(pp2):
    seqs = rank_sequences(pp2)
    broken, gone, _ = _without(seqs, 1, lambda o: o.kind == "recv" and o.mb == 2)
    with pytest.raises(VerifyError) as e:
        verify_sequences(broken)
    text = str(e.value)
    assert "rank 0 sends a message rank 1 never receives" in text
    assert "microbatch 2" in text and gone.source in text


def test_missing_send(pp2):
    seqs = rank_sequences(pp2)
    broken, _, _ = _without(seqs, 0, lambda o: o.kind == "send")
    with pytest.raises(VerifyError) as e:
        verify_sequences(broken)
    assert "rank 1 waits for a message rank 0 never sends" in str(e.value)


def test_cycle_of_waits(pp2):
    """Rank 0 waits for microbatch 0's gradient before sending its activation: a deadlock."""
    seqs = rank_sequences(pp2)
    seq = list(seqs[0])
    send = next(i for i, o in enumerate(seq) if o.kind == "send" and o.mb == 0)
    wait = next(i for i, o in enumerate(seq) if o.kind == "wait" and o.waits == "recv"
                and o.mb == 0)
    seq.insert(send, seq.pop(wait))
    with pytest.raises(VerifyError) as e:
        verify_sequences({**seqs, 0: tuple(seq)})
    text = str(e.value)
    assert "cycle" in text and "rank 0 (its call" in text and "waits for rank 1" in text
    assert "rank 1 (its call" in text and "waits for rank 0" in text


def test_bytes_differ_from_explain(dp2tp2):
    seqs = rank_sequences(dp2tp2)
    seq = list(seqs[0])
    seq[0] = attrs.evolve(seq[0], bytes=seq[0].bytes + 4)
    with pytest.raises(VerifyError) as e:
        check_bytes(dp2tp2, {**seqs, 0: tuple(seq)})
    assert "rank 0" in str(e.value) and "[model] allreduce" in str(e.value)


# -- properties -----------------------------------------------------------------------------
LAYOUT = """
parallel rnd for gpt on mesh(pipe = {pipe}, data = {data}, model = {model}) {{
  sample batch -> data
  {params}
  {attr}
  {operator}
  {schedule}
  zero {zero}
}}
"""


@st.composite
def gpt_layouts(draw):
    pipe = draw(st.sampled_from([1, 2, 4]))
    data = draw(st.sampled_from([1, 2]))
    model = draw(st.sampled_from([1, 2, 4]))
    params = draw(st.sampled_from(["", "parameter heads, ffn, vocab -> model",
                                   "parameter ffn -> model"]))
    attr = draw(st.sampled_from(["", "attribute seq -> model"])) if model > 1 else ""
    operator = ""
    schedule = ""
    if pipe == 2 and draw(st.booleans()):  # interleaved: two chunks per pipe rank
        operator = "operator " + ", ".join(f"layer[{i}] -> pipe {i % 2}" for i in range(4))
        schedule = (f"schedule interleaved, microbatches = {draw(st.sampled_from([2, 4]))}, "
                    "chunks = 2")
    elif pipe > 1:
        per = 4 // pipe
        operator = "operator " + ", ".join(
            f"layer[{i * per}..{i * per + per - 1}] -> pipe {i}" for i in range(pipe))
        kind = draw(st.sampled_from(["gpipe", "1f1b"]))
        schedule = f"schedule {kind}, microbatches = {draw(st.sampled_from([1, 2, 4]))}"
    elif draw(st.booleans()):
        schedule = "schedule 1f1b, microbatches = 2"
    zero = draw(st.sampled_from([0, 1, 2, 3])) if data > 1 else 0
    return LAYOUT.format(pipe=pipe, data=data, model=model, params=params, attr=attr,
                         operator=operator, schedule=schedule, zero=zero)


TOWERS = """
parallel rnd for towers on mesh(data = {data}, branch = 2, model = {model}) {{
  sample batch -> data
  {params}
  operator a -> branch 0, b -> branch 1
}}
"""


@st.composite
def towers_layouts(draw):
    """examples/towers.par's branches, with data and tensor parallelism around them."""
    model = draw(st.sampled_from([1, 2]))
    return "towers", TOWERS.format(data=draw(st.sampled_from([1, 2])), model=model, params=(
        "parameter ffn -> model" if model > 1 else ""))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(gpt_layouts().map(lambda b: ("gpt", b)), towers_layouts()))
def test_random_valid_layouts_verify(example):
    name, block = example
    text = (ROOT / f"examples/{name}.par").read_text() + block
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "rnd.par")
        path.write_text(text)
        try:
            s = dsl.load(path)
        except UserError:  # an invalid combination: the checker's business, not ours
            return
        par = s.parallel("rnd")
        verify_layout(lower_graph(s.model(par.model), par))


MUTATIONS = ("drop", "shape", "dtype", "duplicate", "swap")


@functools.cache
def verified():
    """Verified sequences of three layouts (tensor x pipeline, data x tensor, interleaved)."""
    out = {}
    for path, layout in (("tests/specs/pipe_layouts.par", "pp2tp2"),
                         ("examples/gpt.par", "dp2tp2"),
                         ("tests/specs/pipe_layouts.par", "pp2inter")):
        seqs = rank_sequences(_graph(path, layout))
        verify_sequences(seqs)
        out[layout] = seqs
    return out


def _mutate(seqs, data):
    """One random single mutation of one rank's calls (never of a wait, which only orders)."""
    layout = data.draw(st.sampled_from(sorted(seqs)))
    ranks = seqs[layout]
    rank = data.draw(st.sampled_from(sorted(ranks)))
    seq = list(ranks[rank])
    calls = [i for i, o in enumerate(seq) if o.is_call]
    i = data.draw(st.sampled_from(calls))
    how = data.draw(st.sampled_from(MUTATIONS))
    o = seq[i]
    if how == "drop":
        del seq[i]
    elif how == "shape":
        seq[i] = attrs.evolve(o, shape=o.shape + (2,))
    elif how == "dtype":
        seq[i] = attrs.evolve(o, dtype="f64" if o.dtype != "f64" else "f32")
    elif how == "duplicate":
        seq.insert(i, o)
    else:  # swap with a later, different call of the same kind on the same channel
        later = [j for j in calls if j > i and seq[j].key == o.key and seq[j].kind == o.kind
                 and seq[j].peer == o.peer and (seq[j].signature(), seq[j].tag) !=
                 (o.signature(), o.tag)]
        if not later:
            del seq[i]
        else:
            j = data.draw(st.sampled_from(later[:8]))
            seq[i], seq[j] = seq[j], seq[i]
    return {**ranks, rank: tuple(seq)}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_single_mutations_never_verify(data):
    with pytest.raises(VerifyError):
        verify_sequences(_mutate(verified(), data))


# -- the command ----------------------------------------------------------------------------
def test_check_verify_prints_each_layout(capsys):
    from soapstone.dsl.cli import main

    assert main(["check", "examples/gpt.par", "--parallel", "gpt8", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified: gpt / gpt8: 8 ranks: 888 collective calls on 14 communicators and 32 " \
           "p2p messages per step match and complete" in out
    assert main(["check", "examples/mlp.par", "--verify"]) == 0
    assert "verified: mlp / single: 1 rank" in capsys.readouterr().out


def test_check_verify_of_an_unknown_layout_is_exit_2(capsys):
    from soapstone.dsl.cli import main

    assert main(["check", "examples/gpt.par", "--parallel", "gpt9", "--verify"]) == 2
    err = capsys.readouterr().err
    assert "no parallel block named 'gpt9'" in err and "Traceback" not in err


# -- errors that list the valid choices -----------------------------------------------------
def _check_error(block: str) -> str:
    text = (ROOT / "examples/gpt.par").read_text() + block
    with pytest.raises(UserError) as e:
        dsl.load(text, filename="gpt.par")
    return str(e.value)


def test_an_indivisible_weight_dim_lists_sizes_dims_and_replication():
    err = _check_error("parallel m8 for gpt on mesh(model = 8) {\n"
                       "  parameter heads -> model\n}\n")
    assert "heads = 4 does not divide over model = 8" in err
    assert "model sizes that divide heads = 4: 2, 4" in err
    assert "dims that divide over model = 8 instead: hidden = 32, ffn = 64, vocab = 64" in err
    # e.g. key/value heads fewer than the tensor-parallel ranks: keep them whole on each rank
    assert "or leave heads out of the statement: replicated on every model rank" in err
    assert "--dim heads=" in err


def test_an_indivisible_batch_lists_the_data_sizes():
    err = _check_error("parallel d3 for gpt on mesh(data = 3) {\n  sample batch -> data\n}\n")
    assert "batch = 8 does not divide over data = 3" in err
    assert "data sizes that divide batch = 8: 2, 4, 8" in err
    assert "instead" not in err and "replicated" not in err  # only the batch may be sampled


# -- what the watchdog is handed --------------------------------------------------------------
def test_positions_in_the_plan(dp2tp2):
    from soapstone.comm.observe import expected

    plan = expected_by_comm(rank_sequence(dp2tp2, 0))
    ops = plan["model[0,1]"]["collective"]
    expected.expect(plan)  # no live communicator here: every step counts from 0
    try:
        def snap(seq):
            return [{"key": "model[0,1]", "seq": seq, "p2p_seq": 0}]

        blocked = {"key": "model[0,1]", "kind": "collective", "seq": 10, "op": "allreduce",
                   "shape": [4, 16, 1], "dtype": "float32"}
        where = expected.positions(snap(10), blocked)["model[0,1]"]["collective"]
        assert where == {"made": 10, "of": len(ops), "at": 10, "planned": ops[9]["what"]}
        wrong = dict(blocked, shape=[4, 16, 32])
        (line,) = expected.position_lines(0, expected.positions(snap(10), wrong), "model[0,1]",
                                          "collective")
        assert line.startswith(f"rank 0 on model[0,1]: in call 10 of the step's {len(ops)} "
                               "collectives, which the plan says is allreduce (4, 16, 1) f32")
        assert line.endswith("it left the plan")
        # not in a call: the next one, wrapping into the next step
        nxt = expected.positions(snap(len(ops) + 2), None)["model[0,1]"]["collective"]
        assert nxt["next"] == 3 and nxt["planned"] == ops[2]["what"]
    finally:
        expected.clear()
    assert expected.positions([{"key": "model[0,1]", "seq": 1, "p2p_seq": 0}], None) == {}
