"""The compiler's layouts and collectives, read off the Program (no processes needed).

The parallel patterns people know by name are not special cases in soapstone: these tests
show each one falling out of the sharding rules and the cost of moving data.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import attrs
import pytest

from soapstone import dsl
from soapstone.dsl.compile.lower import LoweringError, lower
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.plan.collectives import backward_op
from soapstone.shard.plan.layout import R, Split
from soapstone.shard.plan.program import Compute, CopyTo, Redistribute
from soapstone.shard.plan.program_text import format_program, program_to_json

ROOT = Path(__file__).resolve().parents[2]
GPT = dsl.load(ROOT / "tests/specs/gpt_layouts.par")
LAYERS = len(GPT.model().blocks)


def program(spec, layout):
    return lower(spec.model(), spec.parallel(layout))


def activation_collectives(prog, axis="model"):
    """(forward, backward) Counters of collective kinds over `axis`, per step."""
    fwd, bwd = Counter(), Counter()
    for s in prog.steps:
        if isinstance(s, Redistribute) and s.axis == axis and s.kind != "slice":
            fwd[s.kind] += 1
        if isinstance(s, Redistribute | CopyTo) and s.axis == axis and backward_op(s):
            bwd[backward_op(s)] += 1
    return fwd, bwd


def test_megatron_tensor_parallel_is_two_allreduces_per_layer_each_way():
    fwd, bwd = activation_collectives(program(GPT, "tp2"))
    # per layer: after attention's output projection and after the MLP (forward), and at the
    # entry of each (backward, Megatron's f); plus the vocab-parallel embedding and the head.
    assert fwd == {"allreduce": 2 * LAYERS + 1}
    assert bwd == {"allreduce": 2 * LAYERS + 1}


def test_sequence_parallel_trades_each_allreduce_for_allgather_and_reduce_scatter():
    prog = program(GPT, "sp2")
    fwd, bwd = activation_collectives(prog)
    assert "allreduce" not in fwd and "allreduce" not in bwd
    assert fwd["reduce_scatter"] == 2 * LAYERS + 1  # the embedding's partial sum too
    assert bwd["reduce_scatter"] == 2 * LAYERS + 1  # each gather of the normalised input
    # layernorm runs on sequence shards: its params' gradients are summed over model
    ln = [p for p in prog.params if p.name.endswith("gamma")]
    assert ln and all(p.grad_sync == ("model",) for p in ln)


def test_vocab_parallel_cross_entropy_never_gathers_the_logits():
    prog = program(GPT, "tp2")
    ce = next(s for s in prog.steps if isinstance(s, Compute) and s.kind == "cross_entropy")
    assert ce.dist == ("model",)
    logits = prog.value(ce.args[0])
    assert logits.layout.get("model") == Split("vocab")
    gathered = [s for s in prog.steps if isinstance(s, Redistribute) and s.src == ce.args[0]]
    assert not gathered


def test_data_parallel_sums_every_gradient_over_data_and_moves_no_activation():
    prog = program(GPT, "dp2")
    assert not [s for s in prog.steps if isinstance(s, Redistribute | CopyTo)]
    assert all(p.grad_sync == ("data",) for p in prog.params)


def test_context_parallel_gathers_keys_and_values_only():
    prog = program(GPT, "cp2")
    gathers = [s for s in prog.steps if isinstance(s, Redistribute)]
    assert {(s.kind, s.axis, s.frm, s.to) for s in gathers} == {
        ("allgather", "cp", Split("seq_k"), R)}
    # exactly the keys and values (renamed to seq_k) of every layer, once each
    assert sorted(s.src for s in gathers) == sorted(
        f"layer.{i}.attention0.{kv}" for i in range(LAYERS) for kv in ("k2", "v2"))
    assert all(s.grad == "partial" for s in gathers)


def test_row_parallel_first_layer_slices_its_input_locally():
    mlp = dsl.load(ROOT / "tests/specs/mlp_layouts.par")
    prog = program(mlp, "rowfirst")
    kinds = Counter(s.kind for s in prog.steps if isinstance(s, Redistribute))
    assert kinds == {"slice": 1, "allreduce": 1}


def test_ulysses_all_to_all_falls_out_when_heads_may_split_but_weights_stay_whole():
    # sequence split over 4 ranks; heads may split there too, but no weight is split. With
    # long enough sequences the cost model prefers all-to-all (DeepSpeed-Ulysses) to gathering
    # keys and values: seq->heads before the attention core, heads->seq after it.
    spec = dsl.load(ROOT / "tests/specs/gpt_layouts.par", dims={"seq": 128})
    prog = program(spec, "ulysses4")
    moves = Counter((s.kind, s.frm, s.to) for s in prog.steps if isinstance(s, Redistribute))
    seq, seq_k, heads = Split("seq"), Split("seq_k"), Split("heads")
    assert moves == {("alltoall", seq, heads): LAYERS, ("alltoall", seq_k, heads): 2 * LAYERS,
                     ("alltoall", heads, seq): LAYERS}


def test_sharded_shapes_are_the_global_ones_divided():
    prog = program(GPT, "tp4")
    wq = prog.param("layer.0.attention0.wq")
    assert wq.shape == (32, 4, 8) and wq.local_shape == (32, 1, 8)


def test_an_op_that_cannot_be_sharded_is_a_located_error():
    # swiglu declares only ffn splittable; its weights split along hidden leave no valid way
    dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))
    spec = dsl.load(ROOT / "examples/swiglu.par")
    par = attrs.evolve(spec.parallel("tp2"), parameter=(("hidden", "model"),))
    with pytest.raises(LoweringError) as err:
        lower(spec.model(), par)
    (diag,) = err.value.diagnostics
    assert "swiglu" in diag.message and "'model'" in diag.message
    assert (diag.file.endswith("swiglu.par"), diag.line) == (True, 17)
    assert "parameters never move" in diag.hint
    assert "^" in err.value.format()  # the caret line under the call


def test_show_text_and_json_name_every_collective():
    prog = program(GPT, "sp2")
    text = format_program(prog)
    assert "reduce_scatter[model]" in text and "allgather[model]" in text
    data = program_to_json(prog)
    assert '"kind": "reduce_scatter"' in data


@pytest.mark.parametrize("layout", sorted(n for n, p in GPT.parallels.items() if not p.operator))
def test_every_gpt_layout_lowers(layout):
    prog = program(GPT, layout)
    assert prog.loss is not None and prog.world_size == GPT.parallel(layout).world_size


def test_lower_points_pipeline_layouts_to_lower_graph():
    """A layout with pipeline stages compiles to a stage graph: lower() says where to go."""
    with pytest.raises(LoweringError) as err:
        program(GPT, "gpt8")
    (diag,) = err.value.diagnostics
    assert "pipeline" in diag.message and "lower_graph" in diag.hint


@pytest.mark.parametrize("layout", [None, "tp2", "dp2tp2", "gpt8"])
def test_every_layout_is_a_stage_graph(layout):
    """One executor runs every layout: one without stages is a one-stage graph holding
    lower()'s Program; a pipeline layout has its stages and p2p edges."""
    par = GPT.parallel(layout) if layout else None
    graph = lower_graph(GPT.model(), par)
    if par is None or not par.operator:
        assert graph.axis is None and graph.pipe == 1 and graph.edges == ()
        assert graph.program == lower(GPT.model(), par)
        assert graph.program.batch_dim == "batch"
    else:
        assert graph.axis == "pipe" and len(graph.stages) == 2 and graph.edges
        assert all(s.program.zero == par.zero for s in graph.stages)
    assert graph.world_size == (par.world_size if par else 1)


def test_the_program_carries_the_data_axes_and_zero():
    """The runtime reads what the compiler decided instead of re-deriving it."""
    spec = dsl.load(ROOT / "tests/specs/zero_layouts.par")
    prog = program(spec, "dp2tp2z3")
    assert prog.data_axes == ("data",) and prog.zero == 3
    single = lower(spec.model(), None)
    assert single.data_axes == () and single.zero == 0


@pytest.mark.parametrize("layout,sample,zero_axes", [
    ("cp2", (), ("cp",)),  # context parallel: the parameters are whole on cp
    ("ulysses4", (), ("cp",)),  # heads on cp too: inputs only, no parameter splits there
    ("cp2tp2", (), ("cp",)),  # the tensor axis splits parameters
    ("dp2sp2", ("data",), ("data",)),  # sequence parallel: seq on the tensor axis
    ("dp2", ("data",), ("data",)),
])
def test_zero_shards_over_the_sample_and_context_axes(layout, sample, zero_axes):
    """ZeRO's axes: the sample axes, then each attribute axis no parameter is split on."""
    prog = program(GPT, layout)
    assert prog.data_axes == sample and prog.zero_axes == zero_axes


def test_lower_resolves_tied_params():
    """A param tied to another is the same tensor without stages too: one param, read twice."""
    m = GPT.model()
    table = next(p for p in m.params if p.name == "embedding0.table")
    head = attrs.evolve(table, name="head.table", tied_to=table.name)
    params = tuple(p for p in m.params if p.name != "linear0.weight") + (head,)
    ops = tuple(attrs.evolve(op, args=tuple("head.table" if a == "linear0.weight" else a
                                            for a in op.args)) for op in m.ops)
    tied = attrs.evolve(m, params=params, ops=ops)
    for layout in (None, GPT.parallel("tp2")):
        prog = lower(tied, layout)
        names = [p.name for p in prog.params]
        assert "head.table" not in names and names.count("embedding0.table") == 1
        readers = [s.kind for s in prog.steps if isinstance(s, Compute)
                   and any(a.split("@")[0].split(">")[0] == "embedding0.table" for a in s.args)]
        assert readers == ["embedding", "einsum"], readers


def test_a_received_replicated_tensor_feeding_split_work_gets_a_copy_to():
    """A stage's received residual stream, replicated over `model`, feeds the h2-split linear:
    backward would return per-rank terms, so lowering inserts CopyTo (allreduce backward) on
    the received tensor itself, as for any other value."""
    from soapstone.dsl.compile.stages import lower_pipeline

    spec = dsl.load(ROOT / "tests/specs/pipe_residual.par")
    graph = lower_pipeline(spec.model(), spec.parallel("pp2tp2res"))
    for stage in graph.stages:
        copies = [(s.src, s.axis) for s in stage.program.steps if isinstance(s, CopyTo)]
        # stage 0 reads the data input x, which carries no gradient
        assert copies == [(name, "model") for name in stage.recv], (stage.index, copies)
    assert graph.stages[1].recv == ("layer.0.x",)


def test_branches_run_on_their_owner_and_meet_in_one_allreduce():
    spec = dsl.load(ROOT / "tests/specs/branch_layouts.par")
    prog = lower(spec.model("towers"), spec.parallel("br2"))
    owners = Counter(s.owner for s in prog.steps if isinstance(s, Compute) and s.owner)
    assert owners == {("branch", 0): 5, ("branch", 1): 6}  # tower b also owns its layernorm
    kinds = Counter(s.kind for s in prog.steps if isinstance(s, Redistribute))
    # each tower's result becomes a partial sum for free; the head's output is then reduced
    # once, after the contraction, on the small logits rather than the hidden activations
    assert kinds == {"zero_fill": 2, "allreduce": 1}
    (ar,) = [s for s in prog.steps if isinstance(s, Redistribute) and s.kind == "allreduce"]
    assert prog.value(ar.src).dims == ("batch", "classes")
    # the shared input reaches both towers: its gradient is summed back over the axis
    assert [s.src for s in prog.steps if isinstance(s, CopyTo)] == ["h"]


def test_a_branch_value_a_product_needs_whole_is_broadcast_from_its_owner():
    spec = dsl.load(ROOT / "tests/specs/branch_layouts.par")
    prog = lower(spec.model("gated"), spec.parallel("gated_br2"))
    moves = sorted((s.kind, s.src) for s in prog.steps if isinstance(s, Redistribute))
    assert moves == [("allreduce", "linear1.mm"), ("broadcast", "b"), ("zero_fill", "a")]
    # the broadcast copy feeds a product with a partial factor: its gradient is summed back
    assert [s.src for s in prog.steps if isinstance(s, CopyTo)] == ["h", "b@branch:R"]


MLP_TP2 = (ROOT / "examples/mlp.par").read_text()


@pytest.mark.parametrize("name", ["P", "R"])
def test_a_dim_named_like_a_placement_shards_like_any_other_dim(name):
    """Placements are typed, not strings beside dim names: a dim called P is not 'partial'
    and one called R is not 'replicate' (the program, its traffic and buckets are the same as
    with the dim called ffn)."""
    ref = program(dsl.load(MLP_TP2), "tp2")
    got = program(dsl.load(MLP_TP2.replace("ffn", name)), "tp2")
    assert format_program(got, zero=1) == format_program(ref, zero=1).replace("ffn", name)
    w = got.param("linear0.weight")
    assert w.local_shape == ref.param("linear0.weight").local_shape == (32, 32)
    assert w.layout.split_axis(name) == "model"


def test_one_table_of_collective_kinds():
    """Every redistribution kind the layout algebra can produce has a row in the collectives
    table, and the runtime runs exactly those kinds (no second list to keep in step)."""
    from soapstone.shard.plan import collectives
    from soapstone.shard.plan.layout import Owned, Partial, Replicate, transition
    from soapstone.shard.runtime.sharded_model import REDISTRIBUTE

    placements = (Replicate(), Partial(), Split("a"), Split("b"), Owned(0))
    produced = {transition(s, d) for s in placements for d in placements} - {None, "invalid"}
    assert produced == set(collectives.KINDS) == set(REDISTRIBUTE)
    # the cost model's bytes are the comm layer's: 64 KiB over 4 ranks, ring allreduce
    assert collectives.transition_cost("allreduce", 1 << 16, 4) == \
        collectives.LATENCY_BYTES + 2 * 3 * (1 << 16) // 4
    assert collectives.transition_cost("slice", 1 << 16, 4) == 0.0


def test_a_parallel_block_of_another_model_is_refused_where_it_is_written():
    """mlp's ffn happens to be a dim of gpt too: gpt's tp2 lowered mlp silently, its heads and
    vocab statements dropped; a name where a block goes was an AttributeError inside."""
    gpt, mlp = dsl.load(ROOT / "examples/gpt.par"), dsl.load(ROOT / "examples/mlp.par")
    with pytest.raises(LoweringError) as e:
        lower_graph(mlp.model(), gpt.parallel("tp2"))
    text = e.value.format()
    assert "gpt.par:" in text and "parallel block 'tp2' is for model gpt, not mlp" in text, text
    assert "pass spec.model('gpt')" in text, text
    with pytest.raises(LoweringError, match="parallel: str 'tp2' is no parallel block"):
        lower_graph(gpt.model(), "tp2")
    with pytest.raises(LoweringError, match="model: str 'gpt' is no checked model"):
        lower_graph("gpt", None)
    assert lower_graph(mlp.model(), mlp.parallel("tp2")).parallel == "tp2"
