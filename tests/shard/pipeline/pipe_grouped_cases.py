"""Pipelines with grouped p2p, NCCL's structure on MPI (tests/shard/pipeline/test_pipeline.py).

SOAPSTONE_P2P=grouped for this whole launch: every Executor here (those inside
assert_matches_golden and Trainer too) issues its p2p in the groups of
shard/plan/p2p_groups.py, one batch_p2p each with synchronous sends (Issend: complete only
when matched, NCCL's rendezvous), each group waited before the next, messages paired by order
alone (one tag). What it proves, with the ahead mode's own checks:

- golden: gpt.par's model reproduces its single-rank record (tests/golden/runs/gpt.npz) under
  pp2 1F1B, pp2 interleaved (2 chunks), pp2 zb1p, and at 4 ranks pp2 x dp2 (1F1B) and
  pp2 x tp2 (zb1p);
- grouped equals ahead bitwise (losses, gradients, parameters after AdamW steps, infer), and
  each communicator's flight recorder holds the calls shard/plan/verify/sequence.py lists for the
  grouped order (measure.measure_pipeline), with explain's bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["SOAPSTONE_P2P"] = "grouped"  # before any Executor is built
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests/support"), str(Path(__file__).parent)]

import torch  # noqa: E402
from measure import W, measure_pipeline  # noqa: E402
from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh  # noqa: E402
from soapstone.dsl.compile.lower import lower  # noqa: E402
from soapstone.dsl.compile.stages import lower_pipeline  # noqa: E402
from soapstone.dsl.testing import assert_matches_golden  # noqa: E402
from soapstone.shard.data.tasks import random_inputs  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402
from soapstone.shard.runtime.p2p_mode import p2p_mode  # noqa: E402

PIPE = str(ROOT / "tests/specs/pipe_layouts.par")
ZB = str(ROOT / "tests/specs/zb_layouts.par")
RECORD = str(ROOT / "tests/golden/runs/gpt.npz")


@ranks(2)
def case_gpt_pp2_1f1b_reproduces_the_record():
    assert_matches_golden(PIPE, "pp2f1b", RECORD)


@ranks(2)
def case_interleaved_and_zb1p_reproduce_the_record():
    assert_matches_golden(PIPE, "pp2inter", RECORD)
    assert_matches_golden(ZB, "pp2zb", RECORD)


@ranks(2)
def case_grouped_equals_ahead_bitwise_and_records_the_grouped_order():
    spec = dsl.load(PIPE)
    model, par = spec.model(), spec.parallel("pp2inter")
    graph, mesh = lower_pipeline(model, par), Mesh(W, **dict(par.mesh))
    single = lower(model, None)
    runs = {}
    for mode in ("ahead", "grouped"):
        ex = Executor(graph, mesh, seed=5, p2p=mode)
        assert ex.p2p == mode
        ex.use_optimizer(name="adamw", lr=1e-3, grad_clip=0.5)
        losses = [ex.train_step(random_inputs(single, i), step=i) for i in range(2)]
        loss, _ = ex.infer(random_inputs(single, 2))
        runs[mode] = (losses, loss, {n: q.detach().clone() for _, n, q in
                                     ex.named_parameters()})
    (la, ia, pa), (lg, ig, pg) = runs["ahead"], runs["grouped"]
    assert la == lg and ia == ig, (la, lg, ia, ig)
    for name in pa:
        assert torch.equal(pa[name], pg[name]), f"{name} differs after two AdamW steps"
    # the environment's choice reaches the Trainer: the recorder holds the grouped order
    assert p2p_mode(None, torch.device("cpu")) == "grouped"
    measure_pipeline(Path(PIPE), "pp2inter", "adamw")


@ranks(4)
def case_pp2_dp2_and_pp2_tp2_reproduce_the_record():
    assert_matches_golden(PIPE, "pp2dp2", RECORD)
    assert_matches_golden(ZB, "pp2tp2zb", RECORD)


def consume_main() -> None:
    """The control: pp2inter grouped as `consume` (receives at their consumer), which the
    simulator proves deadlocks on NCCL (tests/shard/plan/test_p2p_groups.py). With synchronous sends
    the MPI run must hang the same way; the watchdog (SOAPSTONE_COLLECTIVE_TIMEOUT) ends it."""
    from soapstone.shard.plan.verify import p2p_proof

    p2p_proof.choose = lambda sched: "consume"
    spec = dsl.load(PIPE)
    model, par = spec.model(), spec.parallel("pp2inter")
    ex = Executor(lower_pipeline(model, par), Mesh(W, **dict(par.mesh)))
    ex.train_step(random_inputs(lower(model, None), 0))
    print("no deadlock", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["consume"]:
    consume_main()
