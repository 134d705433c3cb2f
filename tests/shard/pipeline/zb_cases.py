"""The zero-bubble schedule zb1p under mpiexec (tests/shard/pipeline/test_zero_bubble.py), on
tests/specs/zb_layouts.par:

- golden: at 2 and 4 stages, with data parallel under ZeRO 1 and 2 and with tensor parallel
  inside the stages, 5 steps reproduce gpt.par's single-rank record (tests/golden/runs/gpt.npz);
- zb1p against 1F1B on the same stage graph: every local gradient of a step and every
  parameter after two AdamW steps are bitwise equal (B and W run each node's arithmetic on the
  same tensors as one backward), and the traced step holds one W per microbatch and stage;
- explain vs counters (measure.measure_pipeline): every rank's communicator counters over
  a step equal explain's figures, and each flight recorder holds the plan's calls in the
  order shard/plan/verify/sequence.py gives for zb1p (B's collectives, then W's with the buckets).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import attrs
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

sys.path.insert(0, str(Path(__file__).parent))
from measure import W, measure_pipeline  # noqa: E402  (the explain cases' measurement)

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "tests/specs/zb_layouts.par"
RECORD = str(ROOT / "tests/golden/runs/gpt.npz")


@ranks(2)
def case_zb1p_two_stages_reproduce_the_single_rank_run():
    assert_matches_golden(str(SPEC), "pp2zb", RECORD)


@ranks(2)
def case_zb1p_equals_1f1b_bitwise_and_traces_w():
    spec = dsl.load(SPEC)
    model, par = spec.model(), spec.parallel("pp2zb")
    mesh = Mesh(W, **dict(par.mesh))
    single = lower(model, None)  # the global batch's shapes
    runs = {}
    for kind in ("1f1b", "zb1p"):
        p = attrs.evolve(par, schedule=ir.Schedule(kind, par.schedule.microbatches))
        ex = Executor(lower_pipeline(model, p), mesh, seed=3, trace=True)
        ex.train_step(random_inputs(single, 0))  # no optimizer: gradients left in .grad
        grads = {n: q.grad.clone() for _, n, q in ex.named_parameters()}
        for q in ex.parameters():
            q.grad = None
        ex.use_optimizer(name="adamw", lr=1e-3, grad_clip=0.5)
        for step in (1, 2):
            ex.train_step(random_inputs(single, step), step=step)
        runs[kind] = (ex, grads, {n: q.detach().clone() for _, n, q in ex.named_parameters()})
    (_, g1, p1), (zb, g2, p2) = runs["1f1b"], runs["zb1p"]
    for name in g1:
        assert torch.equal(g1[name], g2[name]), f"gradient of {name} differs"
        assert torch.equal(p1[name], p2[name]), f"{name} after two AdamW steps differs"
    events = zb.events()
    m = par.schedule.microbatches
    ws = sorted((e.mb, e.stage) for e in events if e.kind == "W")
    assert ws == sorted((i, s) for i in range(m) for s in range(2)), ws
    measured, theory = zb.bubble()
    assert 0.0 <= measured < 1.0 and abs(theory - 1 / (3 * m + 1)) < 1e-12, (measured, theory)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        zb.write_chrome_trace(path)
        if W.rank == 0:
            cats = [e.get("cat") for e in json.loads(path.read_text())["traceEvents"]]
            assert cats.count("weight gradients") == 2 * m, cats


@ranks(4)
def case_zb1p_four_stages_and_with_data_and_tensor_parallel_reproduce_the_run():
    for layout in ("pp4zb", "pp2dp2zb", "pp2dp2zb2", "pp2tp2zb"):
        assert_matches_golden(str(SPEC), layout, RECORD)


@ranks(4)
def case_zb1p_explain_and_verifier_order_match_the_counters():
    for layout in ("pp2dp2zb", "pp2tp2zb"):
        measure_pipeline(SPEC, layout, "adamw")
