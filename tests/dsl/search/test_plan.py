"""`soapstone plan` and what it stands on: the cost model (shard/plan/analysis/cost.py), the search
(dsl/search/plan_search.py) and the command (the probes: tests/dsl/search/test_plan_probes.py; the
profiles: tests/shard/plan/test_profiles.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
from plan_models import gpt

from soapstone.dsl import load
from soapstone.shard.plan.analysis.hardware import load_profile

# ---- the cost model ----------------------------------------------------------------------

def test_axes_are_laid_out_innermost_first_inside_a_node():
    from soapstone.shard.plan.analysis.cost import link_of

    prof = load_profile("a100-40gb")  # 8 devices per node
    mesh = {"pipe": 4, "data": 2, "model": 4}
    assert link_of("model", mesh, prof) == prof.intra_node  # ranks 0..3
    assert link_of("data", mesh, prof) == prof.intra_node  # span 2 x 4 = 8
    assert link_of("data,model", mesh, prof) == prof.intra_node
    assert link_of("pipe", mesh, prof) == prof.inter_node  # span 32
    assert link_of("data", {"data": 4, "model": 4}, prof) == prof.inter_node


def test_a_ring_across_nodes_pays_the_inter_node_latency_only_where_it_crosses():
    """NCCL's ring model: of a reduce-scatter's n - 1 steps over 4 nodes, 3 cross between
    nodes; an allreduce crosses on 2 x 3 of its 2(n - 1); a ring with one rank per node
    crosses on every step; inside a node nothing changes. By hand, on a100-40gb (8 per
    node, 5 us inside, 10 us between, 20 GB/s between)."""
    from soapstone.shard.plan.analysis.cost import nodes_spanned, row_seconds
    from soapstone.shard.plan.analysis.explain import Traffic

    prof = load_profile("a100-40gb")
    mesh = {"data": 16, "model": 2}  # data ranks 0, 2, .., 30: 4 per node, 4 nodes
    assert nodes_spanned("data", mesh, prof) == 4
    rs = Traffic("grad sync", "reduce_scatter", "data", calls=3, bytes=10**9)
    assert row_seconds(rs, mesh, prof) == pytest.approx(
        3 * (3 * 10e-6 + 12 * 5e-6) + 1e9 / 20e9)
    ar = Traffic("grad sync", "allreduce", "data", calls=1, bytes=10**9)
    assert row_seconds(ar, mesh, prof) == pytest.approx(6 * 10e-6 + 24 * 5e-6 + 1e9 / 20e9)
    outer = {"data": 4, "model": 8}  # one data rank per node: every step crosses
    assert nodes_spanned("data", outer, prof) == 4
    assert row_seconds(rs, outer, prof) == pytest.approx(3 * 3 * 10e-6 + 1e9 / 20e9)
    # counted, not listed: a group of 2**30 ranks answers at once
    assert nodes_spanned("data", {"data": 2**30, "model": 8}, prof) == 2**30
    assert nodes_spanned("model,data", {"pipe": 4, "data": 4, "model": 4}, prof) == 2
    inner = {"data": 2, "model": 4}
    assert row_seconds(rs, inner, prof) == pytest.approx(3 * 1 * 5e-6 + 1e9 / 240e9)


def test_step_time_of_one_rank_is_its_compute_and_its_update():
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.cost import program_work, step_time
    from soapstone.shard.plan.analysis.explain import estimate_pipeline

    model = load("examples/mlp.par").model()
    graph = lower_graph(model, None)
    work = program_work(graph.program)
    # two linears: 2 * batch * features * ffn + 2 * batch * ffn * classes
    assert work.matmul_flops == 2 * 8 * 32 * 64 + 2 * 8 * 64 * 8
    prof = load_profile("a100-40gb")
    t = step_time(estimate_pipeline(graph), [work], prof)
    assert t.blocking_comm == t.grad_sync == t.bubble == 0
    assert t.total == pytest.approx(t.compute + t.optimizer + t.after_step)
    assert t.compute == pytest.approx(work.seconds(prof, "fp32"))


def test_recompute_costs_the_blocks_forward_once_more():
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.cost import program_work

    text = gpt(4)
    plain = lower_graph(load(text).model(), None).program
    spec = load(text + "parallel rc for gpt on mesh(data = 1) { recompute layer }")
    again = lower_graph(spec.model(), spec.parallel("rc")).program
    base, work = program_work(plain), program_work(again)
    assert base.again is None and work.again is not None
    # the four blocks' matmuls: everything but the head's
    head = 2 * 8 * 16 * 32 * 64  # batch x seq x hidden x vocab
    assert work.again.matmul_flops == base.matmul_flops - head
    prof = load_profile("a100-40gb")
    assert work.seconds(prof, "fp32") == pytest.approx(
        base.seconds(prof, "fp32") + work.again.forward_seconds(prof, "fp32"))


# ---- the search --------------------------------------------------------------------------

def test_layout_dims_are_megatrons_split():
    from soapstone.dsl.search.space import layout_dims

    dims = layout_dims(load(gpt(4)).model())
    assert (dims.batch, dims.tensor, dims.sequence) == ("batch", ("ffn", "heads", "vocab"),
                                                        ("seq",))
    dims = layout_dims(load("examples/mlp.par").model())
    assert dims.tensor == ("ffn",)  # classes would split the second weight too


def test_the_winner_is_a_block_check_explain_and_run_accept(tmp_path, capsys):
    from soapstone.dsl.cli import main
    from soapstone.dsl.compile.stages import lower_graph

    out = tmp_path / "planned.par"
    assert main(["plan", "examples/gpt.par", "--world", "4", "--profile", "a100-40gb",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "why this layout" in text and "parallel planned for gpt on mesh(" in text
    block = text[text.index("parallel planned"):text.index("}\n") + 2]
    # written into a copy of the spec, and as the -o file that includes the spec
    copy = tmp_path / "gpt.par"
    copy.write_text(Path("examples/gpt.par").read_text() + "\n" + block)
    for spec in (copy, out):
        loaded = load(str(spec))
        par = loaded.parallel("planned")
        assert par.world_size == 4
        lower_graph(loaded.model(par.model), par)
        assert main(["check", str(spec)]) == 0
        assert main(["explain", str(spec), "--parallel", "planned"]) == 0
    capsys.readouterr()
    assert main(["plan", "examples/gpt.par", "--world", "8", "--profile", "h100-80gb",
                 "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 3 and data["ranked"][0]["fits"]
    steps = [r["step_time_s"] for r in data["ranked"]]
    assert steps == sorted(steps)
    assert data["parallel"].startswith("parallel planned for gpt")


def test_recompute_is_not_costed_where_it_cannot_pay():
    """Recompute only adds work: where a layout fits at ZeRO 0 it is never costed with it, so
    a model that fits everywhere searches exactly the layouts a search without it does."""
    from soapstone.dsl.search.plan_search import Planner, search

    model = load(gpt(12)).model()
    profile = load_profile("a100-40gb")
    plan = search(Planner(model, profile), 4)
    assert not any(r.candidate.recompute for r in plan.ranked + plan.unfit)
    plain = search(Planner(model, profile, recompute=()), 4)
    assert [r.candidate for r in plan.ranked] == [r.candidate for r in plain.ranked]


def test_where_only_recompute_fits_the_plan_recomputes_and_runs(tmp_path, capsys):
    """gpt.par at sequence 128 on 2 devices of 732 KiB: no layout fits without recompute
    (the smallest, t2+sp, needs 764 KiB), so the plan recomputes, says what it trades, and its
    block is accepted as is by check, explain and a 2-rank run."""
    from mpirun import run_mpi

    from soapstone.dsl.cli import main
    from soapstone.dsl.search.plan_search import Planner, search
    from soapstone.dsl.search.space import PlanError

    profile = tmp_path / "small.json"
    profile.write_text(json.dumps(load_profile("cpu-2core").to_data() | {
        "name": "small", "memory_gib": 750_000 / 0.9 / 2**30}))
    dims = {"seq": 128, "batch": 16}
    flags = [x for k, v in dims.items() for x in ("--dim", f"{k}={v}")]
    model = load("examples/gpt.par", dims=dims).model()
    with pytest.raises(PlanError, match="no layout of gpt fits"):
        search(Planner(model, load_profile(str(profile)), recompute=()), 2)
    out = tmp_path / "planned.par"
    assert main(["plan", "examples/gpt.par", "--world", "2", "--profile", str(profile),
                 *flags, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "  recompute layer\n}" in text and " rc " in text
    assert "- recompute layer: activations " in text and "with no recompute nothing fits" \
        in text
    assert main(["check", str(out), *flags]) == 0
    assert main(["explain", str(out), "--parallel", "planned", *flags]) == 0
    assert "(recompute: without it activations" in capsys.readouterr().out
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", str(out), "--parallel", "planned",
                    "--steps", "2", *flags], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_plan_runs_without_torch():
    from no_torch import run_without_torch as _run

    r = _run("plan", "examples/gpt.par", "--world", "2", "--profile", "cpu-2core")
    assert r.returncode == 0, r.stderr
    assert "parallel planned" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--world", "4", "--profile", "a100-41gb"], "unknown profile 'a100-41gb'"),
    (["--world", "0", "--profile", "a100-40gb"], "--world 0"),
    # 5 devices: no dim divides over 5, and 4 blocks make no 5 stages
    (["--world", "5", "--profile", "a100-40gb"], "batch = 8 does not divide over 5"),
    (["--world", "1", "--profile", "cpu-2core", "--dim", "hidden=65536"],
     "memory: the smallest layout (d1 t1 p1 m8 z0) needs"),
])
def test_bad_input_is_exit_2_with_one_message(capsys, args, message):
    from soapstone.dsl.cli import main

    assert main(["plan", "examples/gpt.par", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_profile_file_missing_a_field_is_exit_2(tmp_path, capsys):
    from soapstone.dsl.cli import main

    data = load_profile("h200").to_data()
    del data["devices_per_node"]
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "examples/gpt.par", "--world", "2", "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: missing field 'devices_per_node'" in err


def test_every_candidate_prints_as_a_block_that_loads_back_equal():
    from soapstone.dsl import format_parallel
    from soapstone.dsl.search.space import Candidate, layout_dims, to_parallel

    text = gpt(12)
    model = load(text).model()
    dims = layout_dims(model)
    for c in (Candidate(2, 2, 2, True, 1, "1f1b", 4), Candidate(1, 1, 4, False, 0,
                                                                "interleaved", 4, 2),
              Candidate(1, 4, 1, True, 0, "1f1b", 2), Candidate(1, 1, 1),
              Candidate(1, 2, 1, True, context=2)):
        par = to_parallel(model, dims, c)
        again = load(text + format_parallel(par, source=True)).parallel("planned")
        assert again == par, c.label
        # context parallel is balanced (zigzag chunks), sequence parallel nested inside it
        assert par.balanced == (("seq",) if c.context > 1 else ()), c.label


def test_context_parallel_is_searched_only_where_the_batch_does_not_divide():
    """Context parallel c holds the tokens and reduces gradients as data parallel c would,
    and gathers keys and values on top: with a batch of 8 on 8 devices it is never costed;
    with a batch of 2 it is, its probes extrapolate exactly, and it prints as a block that
    loads back equal."""
    from soapstone.dsl import format_parallel
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import candidates, to_parallel

    profile = load_profile("a100-40gb")
    model = load(gpt(12)).model()
    planner = Planner(model, profile)
    assert not any(c.context > 1 for c in candidates(model, planner.dims, 8, profile, []))
    text = gpt(12).replace("batch = 8,", "batch = 2,")
    model = load(text).model()
    planner = Planner(model, profile)
    ctx = [c for c in candidates(model, planner.dims, 8, profile, []) if c.context > 1]
    assert {c.context for c in ctx} == {2, 4, 8} and all(c.data * c.context > 2 for c in ctx)
    # ZeRO shards over data x cp, so it is searched without data parallel too, and shards there
    # (one stage: a pipeline's figures are its fullest rank's, whose padding is its own)
    alone = next(c for c in ctx if c.data == 1 and c.zero == 3 and c.pipe == 1)
    whole = planner.cost(attrs.evolve(alone, zero=0), exact=True).estimate.optimizer_bytes
    assert planner.cost(alone, exact=True).estimate.optimizer_bytes * alone.context == whole
    for c in [*ctx[::7], alone]:
        par = to_parallel(model, planner.dims, c)
        assert ("seq", "cp") in par.attribute and dict(par.mesh)["cp"] == c.context
        assert load(text + format_parallel(par, source=True)).parallel("planned") == par
        probed, full = planner.cost(c, exact=False), planner.cost(c, exact=True)
        assert sorted(map(str, probed.estimate.traffic)) == \
            sorted(map(str, full.estimate.traffic)), c.label
        assert probed.time.total == pytest.approx(full.time.total, rel=1e-6), c.label


def test_explains_activations_match_a_measured_step(tmp_path):
    """explain's activations (what autograd saves) and its peak (with the working set) against
    one real training step (bench/bench_memory.py: saved-tensor hooks and the resident-memory
    high-water mark), on one rank."""
    import subprocess
    import sys

    out = tmp_path / "memory.json"
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--small", "--json", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    for row in json.loads(out.read_text()):
        assert abs(row["saved_error"]) < 0.05, r.stdout
        assert abs(row["peak_error"]) < 0.15, r.stdout
        if "loss_layouts" in row["spec"]:  # the chunked loss: the tensors alive, exactly
            assert abs(row["live_error"]) < 0.03, r.stdout


def test_explains_bf16_activations_match_a_measured_bf16_step(tmp_path):
    """The same under `--precision bf16`: a step with bf16 compute over fp32 masters against
    explain --precision bf16 (BENCHMARKS.md has the 2-rank layouts)."""
    import subprocess
    import sys

    out = tmp_path / "memory.json"
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--small", "--precision",
                        "bf16", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    for row in json.loads(out.read_text()):
        assert row["precision"] == "bf16"
        assert abs(row["saved_error"]) < 0.05, r.stdout
        assert abs(row["peak_error"]) < 0.15, r.stdout
        if "loss_layouts" in row["spec"]:  # the chunked loss: the tensors alive, exactly
            assert abs(row["live_error"]) < 0.03, r.stdout


# ---- the fit check -----------------------------------------------------------------------

def _cli(*args: str, timeout: float = 300):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", *args], text=True,
                          capture_output=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_run_refuses_a_layout_that_cannot_fit_before_allocating():
    r = _cli("run", "examples/mlp.par", "--dim", "batch=100000000", "--steps", "1")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "model 'mlp' on one rank does not fit: it needs" in r.stderr
    assert "activations" in r.stderr and "but a rank has" in r.stderr
    # the planner's suggestion: accumulation over microbatches brings it down
    assert "`soapstone plan` finds for 1 rank" in r.stderr and "microbatches = " in r.stderr


def test_explain_warns_when_the_estimate_exceeds_the_memory():
    r = _cli("explain", "examples/gpt.par", "--dim", "seq=1000000000")
    assert r.returncode == 0
    assert "warning: this layout does not fit" in r.stderr
    r = _cli("explain", "examples/gpt.par", "--json", "--profile", "a100-40gb")
    data = json.loads(r.stdout)
    assert data["fits"] and data["memory_limit_bytes"] == load_profile("a100-40gb").usable_bytes
    assert "warning" not in r.stderr


def test_golden_check_refuses_what_cannot_fit(tmp_path):
    record = tmp_path / "mlp.npz"
    assert _cli("golden", "record", "examples/mlp.par", "-o", str(record),
                "--steps", "1").returncode == 0
    huge = tmp_path / "mlp.par"
    huge.write_text(Path("examples/mlp.par").read_text().replace("batch = 8", "batch = 400000000"))
    r = _cli("golden", "check", str(huge), str(record))
    assert r.returncode == 2, r.stderr
    assert "does not fit" in r.stderr and "Traceback" not in r.stderr


def test_the_trainer_refuses_before_allocating():
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.fit import DoesNotFit
    from soapstone.shard.train.trainer import Trainer

    graph = lower_graph(load("examples/mlp.par", dims={"batch": 400_000_000}).model(), None)
    with pytest.raises(DoesNotFit, match="does not fit: it needs .* but a rank has"):
        Trainer(graph, None, task=None)


# ---- seed 004's example ------------------------------------------------------------------

def test_seed_004_a_1t_model_on_4096_a100s_plans_to_tensor_8_pipeline_64_data_8():
    """Seed 004: a ~1T-parameter GPT on 4096 A100-40GB in 8-GPU nodes becomes 8-way tensor
    (inside a node) x 64-way pipeline x 8-way data parallel. At 256 the planner reaches the
    seed's configuration by itself, and says why; at Megatron's sequence 2048 only a slow
    sequence-parallel ZeRO-3 layout fits 40 GB without activation recompute (its linears keep
    their inputs' shards), so the plan recomputes (checked below)."""
    from soapstone.dsl.search.plan_search import Planner, decisions, search

    profile = load_profile("a100-40gb")
    model = load("tests/specs/gpt_1t.par", dims={"seq": 256}).model()
    params = sum(math.prod(model.size(d) for d in p.type.dims) for p in model.params)
    assert 1.0e12 < params < 1.02e12
    planner = Planner(model, profile, precision="bf16")
    plan = search(planner, 4096)
    c = plan.best.candidate
    why = "\n".join([plan.header()] + [f"{r.candidate.label}: {r.time.total:.3f} s, "
                                        f"{r.memory / 2**30:.1f} GiB" for r in plan.ranked[:5]]
                    + decisions(plan, planner))
    assert (c.tensor, c.pipe, c.data) == (8, 64, 8), why
    assert plan.best.memory <= profile.usable_bytes
    # the seed's reasons, in its order: a block is too big for one device, so tensor 8
    # inside a node; the model is far too big for a node, so 64 stages; data for the rest
    lines = decisions(plan, planner)
    assert lines[0].startswith("tensor parallel 8") and "inside a node of 8" in lines[0], why
    assert lines[1].startswith("pipeline 64") and "across nodes" in lines[1], why
    assert lines[2].startswith("data parallel 8"), why
    print(why)  # the planner's choice and why (pytest -s)

    assert c.recompute is None  # it fits without, and recompute only adds work
    long = load("tests/specs/gpt_1t.par").model()  # sequence 2048
    planner = Planner(long, profile, precision="bf16")
    plan = search(planner, 4096)
    # every layout is tried without recompute first: only sequence-parallel ones fit
    assert plan.ranked and plan.best.candidate.recompute == "layer"
    assert all(r.candidate.sequence for r in plan.ranked if r.candidate.recompute is None)
    assert plan.best.candidate.tensor == 8
    assert any(line.startswith("recompute layer: activations ") and
               "the best with no recompute" in line and "slower" in line
               for line in decisions(plan, planner))


def test_a_mixture_of_experts_plans_expert_parallel_and_never_splits_the_router():
    """A Mixtral-like model (tests/specs/moe_plan.par) on 16 H100: the experts dim is one the
    tensor axis may split (expert parallelism), the router's copy of it never is, so every
    candidate with tensor > 1 compiles (each used to fail: the search mapped the router's
    dim onto the model axis and then said no layout with tensor > 1 divides). The winner is
    expert-parallel because the cost model rates it fastest."""
    from soapstone.dsl.search.plan_search import Planner, decisions, search
    from soapstone.dsl.search.space import layout_dims

    model = load("tests/specs/moe_plan.par").model()
    dims = layout_dims(model)
    assert "experts" in dims.tensor and "experts_r" not in dims.tensor
    planner = Planner(model, load_profile("h100-80gb"))
    plan = search(planner, 16)
    assert not [r for r in plan.rejected if "no valid sharding" in r.why], plan.rejected
    assert any(r.candidate.tensor > 1 for r in plan.ranked)
    assert plan.best.candidate.tensor > 1
    assert ("experts", "model") in plan.parallel().parameter
    assert plan.best.time.total == min(r.time.total for r in plan.ranked)
    assert not any("no layout with tensor > 1" in line for line in decisions(plan, planner))
    # the experts over the data axis (DeepSpeed-MoE) are searched and rated too
    assert any(r.candidate.experts_on_data for r in plan.ranked)


def test_bench_calibrate_writes_a_profile_plan_reads(tmp_path):
    from mpirun import run_mpi

    out = tmp_path / "cpu.json"
    run_mpi(2, ["-m", "soapstone.dsl.cli", "bench", "calibrate", "-o", str(out)], check=True,
            timeout=600)
    prof = load_profile(str(out))
    assert prof.devices_per_node == 2 and prof.matmul_efficiency == 1.0
    assert prof.peak_flops["fp32"] > 1e8 and prof.intra_node.bandwidth > 1e6
    # the share of a ring's traffic its matmuls hide, measured; its chunks' matmuls as wide
    # as make them take as long as their sends
    assert "measured" in prof.ring_overlap_source
    from soapstone.shard.runtime.calibrate import hidden_share, ring_shape
    # matmuls 4 ms, sends 2 ms: a ring of 5 ms hid 1 of the 2 ms; 6 ms none; 4 ms all
    assert hidden_share(4.0, 2.0, 5.0) == 0.5 and hidden_share(4.0, 2.0, 6.0) == 0.0
    assert hidden_share(4.0, 2.0, 4.0) == 1.0 and hidden_share(0.0, 2.0, 2.0) == 0.0
    # 5 ms sends of 1024-wide fp32 rows: 4.4 GB/s -> 5371 rows; 82 GFLOP/s matmuls as long
    # -> 2 x 82e9 / 4.4e9 = 37 wide; the bounds
    assert ring_shape(82e9, 4.4e9) == (5371, 37)
    assert ring_shape(1e9, 1e12) == (16384, 16) and ring_shape(1e15, 1e6) == (64, 16384)
    r = run_mpi(1, ["-m", "soapstone.dsl.cli", "bench", "calibrate"])
    assert r.returncode == 2 and "needs -o PROFILE.json" in r.stderr


def test_a_layout_the_compiler_refuses_is_skipped_with_its_reason():
    """examples/moe.par: splitting `hidden` leaves the moe op no sharding, so those
    candidates are rejected with the compiler's message; the rest is planned."""
    from soapstone.dsl.search.plan_search import Planner, search

    model = load("examples/moe.par").model()
    plan = search(Planner(model, load_profile("cpu-2core")), 4)
    assert plan.best.candidate.tensor == 1
    refused = [r for r in plan.rejected if "no valid sharding of moe" in r.why]
    assert refused and all(" t1 " not in r.what for r in refused)


def test_rings_are_not_searched_under_a_split_backward(monkeypatch):
    """A split backward (zb1p, zbv, dualpipev) would run a ring's backward twice, as its B and
    its W: the checker refuses `overlap tensor` with one (tests/bad_specs/overlap_with_zb1p.par),
    so plan proposes rings only under the other schedules (space.candidates; the split ones
    are not planned today, `planned = ()`, so the test plans zb1p too)."""
    from soapstone.dsl.search import space
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.shard.plan import schedules

    monkeypatch.setattr(space, "SCHEDULES", (*space.SCHEDULES, ("zb1p", 1)))
    profile = load_profile("a100-40gb")
    model = load(gpt(12)).model()
    cands = list(space.candidates(model, Planner(model, profile).dims, 8, profile, []))
    split = [c for c in cands if schedules.get(c.schedule).split]
    assert any(c.sequence for c in split)  # zb1p is searched, with sequence parallelism
    rings = [c for c in cands if c.overlap]
    assert any(c.pipe > 1 for c in rings)  # 1f1b pipelines keep theirs
    assert not any(schedules.get(c.schedule).split for c in rings)


def test_float8_rings_whose_chunks_scaled_mm_cannot_take_are_not_planned():
    """Under float8 a ring runs a 1/t chunk of the local tokens per `_scaled_mm`, whose rows
    must be a multiple of 16: plan leaves out the ring layouts run would refuse, saying why."""
    from soapstone.dsl.search.plan_search import Planner, search
    from soapstone.dsl.search.space import Candidate, float8_chunk_misfit

    model = load("examples/llama.par").model()  # batch 8 x seq 16: 128 tokens
    planner = Planner(model, load_profile("h100-80gb"), precision="float8")
    ring = Candidate(1, 2, 1, True, 0, "1f1b", 1, 1, 1, overlap=True)

    def misfit(c, precision="float8"):
        return float8_chunk_misfit(model, planner.dims, precision, c)

    assert misfit(ring) == ""  # 64 tokens a chunk
    small = attrs.evolve(ring, tensor=4, data=4)  # 2 samples x 16 / 4: 8 tokens a chunk
    assert "8 tokens a chunk" in misfit(small)
    assert misfit(small, "bf16") == ""
    plan = search(planner, 16)
    assert not any(misfit(r.candidate) for r in plan.ranked + plan.unfit)
    assert any("tokens a chunk" in r.why for r in plan.rejected)
