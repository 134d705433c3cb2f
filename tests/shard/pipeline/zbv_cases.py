"""The V-shaped schedules (zbv, dualpipev) under mpiexec (tests/shard/pipeline/test_zbv.py), on
tests/specs/zbv_layouts.par:

- golden: at pipe 2, alone and with data parallel (ZeRO 1, 2) and tensor parallel inside the
  stages, 5 steps reproduce gpt.par's single-rank record (tests/golden/runs/gpt.npz); at pipe 4
  (gptv, 8 blocks: two per rank) the run equals the single-process one side by side in both
  p2p modes (grouped: the NCCL-safe groups p2p_proof proves, the V's turn handed in memory),
  and with data parallel (ZeRO 1, 2) and tensor parallel on 8 ranks;
- inference (Executor.infer, forward actions only) equals the single-process forward;
- explain vs counters (measure.measure_pipeline): every rank's communicator counters over a
  step equal explain's figures (no p2p at the turn), and each flight recorder holds the
  calls in the order shard/plan/verify/sequence.py gives;
- traced: the step's timeline holds one B and one W per microbatch and stage, and the Chrome
  trace shows both.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh
from soapstone.dsl.compile.lower import lower
from soapstone.dsl.compile.stages import lower_pipeline
from soapstone.dsl.model import ir
from soapstone.dsl.testing import assert_matches_golden
from soapstone.shard.data.tasks import random_inputs
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.runtime.sharded_model import ShardedModel

sys.path.insert(0, str(Path(__file__).parent))
from measure import W, measure_pipeline  # noqa: E402  (the explain cases' measurement)

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "tests/specs/zbv_layouts.par"
RECORD = str(ROOT / "tests/golden/runs/gpt.npz")
# 3 steps: the first update makes the optimizer state, two more reuse it (later steps
# repeat the second's path)
STEPS, RTOL = 3, 1e-9


def layout(name: str) -> tuple[ir.Model, ir.Parallel]:
    """Layout `name` of the spec and its model."""
    spec = dsl.load(SPEC)
    par = spec.parallel(name)
    return spec.model(par.model), par


def side_by_side(model: ir.Model, par: ir.Parallel, p2p: str) -> None:
    """float64, AdamW: each step's loss and the final parameters of the pipeline equal the
    single-process run's (rtol 1e-9)."""
    mesh = Mesh(W, **dict(par.mesh))
    single = lower(model, None)
    ref = ShardedModel(single, None, seed=5, dtype=torch.float64)
    ex = Executor(lower_pipeline(model, par), mesh, seed=5, dtype=torch.float64, p2p=p2p)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    ex.use_optimizer(name="adamw", lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        batch = random_inputs(single, step)
        want = ref(batch)["loss"]
        want.backward()
        opt.step()
        opt.zero_grad()
        got = ex.train_step(batch, step=step)
        assert abs(got - float(want)) <= RTOL * abs(float(want)), (par.name, p2p, step, got)
    for name, full in ex.full_state_dict().items():
        w = ref.params[name].detach()
        assert torch.allclose(full, w, rtol=RTOL, atol=1e-12), f"{par.name} {p2p}: {name}"
    batch = random_inputs(single, STEPS)  # forward only: the turn's hand-off in infer too
    with torch.no_grad():
        want = float(ref(batch)["loss"])
    got, _ = ex.infer(batch)
    assert abs(got - want) <= RTOL * abs(want), (par.name, p2p, "infer", got, want)


def traced(name: str) -> None:
    """One traced step at pipe 2: a B and a W per microbatch and stage, both in the trace."""
    spec = dsl.load(SPEC)
    par = spec.parallel(name)
    model = spec.model(par.model)
    ex = Executor(lower_pipeline(model, par), Mesh(W, **dict(par.mesh)), seed=3, trace=True)
    ex.train_step(random_inputs(lower(model, None), 0))
    m = par.schedule.microbatches
    events = ex.events()
    for k in "BW":
        got = sorted((e.mb, e.stage) for e in events if e.kind == k)
        assert got == sorted((i, s) for i in range(m) for s in range(4)), (k, got)
    measured, theory = ex.bubble()
    assert 0.0 <= measured < 1.0 and 0.0 <= theory < 1.0, (measured, theory)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        ex.write_chrome_trace(path)
        if W.rank == 0:
            cats = [e.get("cat") for e in json.loads(path.read_text())["traceEvents"]]
            assert cats.count("weight gradients") == 4 * m, cats


@ranks(2)
def case_zbv_two_ranks_reproduce_the_single_rank_run_and_trace_b_and_w():
    assert_matches_golden(str(SPEC), "pp2zbv", RECORD)
    side_by_side(*layout("pp2zbv"), "grouped")
    traced("pp2zbv")


@ranks(4)
def case_zbv_four_ranks_and_with_data_and_tensor_parallel_reproduce_the_run():
    for name in ("pp2dp2zbv", "pp2tp2zbv"):
        assert_matches_golden(str(SPEC), name, RECORD)
    for p2p in ("ahead", "grouped"):
        side_by_side(*layout("pp4zbv"), p2p)
    measure_pipeline(SPEC, "pp2tp2zbv", "adamw")


@ranks(2)
def case_dualpipev_two_ranks_reproduce_the_single_rank_run_and_trace_b_and_w():
    assert_matches_golden(str(SPEC), "pp2dpv", RECORD)
    side_by_side(*layout("pp2dpv"), "grouped")
    traced("pp2dpv")


@ranks(4)
def case_dualpipev_four_ranks_and_with_data_and_tensor_parallel_reproduce_the_run():
    for name in ("pp2dp2dpv", "pp2tp2dpv"):
        assert_matches_golden(str(SPEC), name, RECORD)
    for p2p in ("ahead", "grouped"):
        side_by_side(*layout("pp4dpv"), p2p)
    measure_pipeline(SPEC, "pp2dp2dpv", "adamw")


@ranks(8)
def case_zbv_and_dualpipev_at_pipe_4_with_data_and_tensor_parallel_equal_one_process():
    for name in ("pp4dp2zbv", "pp4tp2zbv", "pp4dp2dpv", "pp4tp2dpv"):
        side_by_side(*layout(name), "ahead" if "dp2" in name else "grouped")
