"""build_optimizer across pipeline stages: global-norm clipping over every stage and axis, and
weights tied across stages summed over the pipe axis before the update (Executor.step).

Run on every rank by tests/support/mpirun.py (see tests/shard/pipeline/test_pipeline_optim.py). Each
case trains a pipeline layout of tests/specs/pipe_layouts.par with
`use_optimizer(build_optimizer(..., grad_clip=CLIP))` next to the single-rank model with the torch
optimizer and torch.nn.utils.clip_grad_norm_ (CLIP is small, so every step clips): in fp32 the loss
of each step matches at rtol 1e-5; in float64 the loss, the clipped global norm and the final
parameters match at rtol 1e-5 (fp32 final params after Adam differ by rounding, see
numerics_cases.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests/support"))

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.lower import lower  # noqa: E402
from soapstone.dsl.compile.stages import lower_pipeline, resolve_ties  # noqa: E402
from soapstone.shard.data.tasks import random_inputs  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402
from soapstone.shard.runtime.sharded_model import ShardedModel  # noqa: E402

W = init("mpi")
# 3 steps: the first update makes the optimizer state, two more reuse it (later steps
# repeat the second's path)
SEED, STEPS, RTOL, LR, CLIP = 7, 3, 1e-5, 1e-3, 0.5
SPEC = dsl.load(ROOT / "tests/specs/pipe_layouts.par")


def tied(model):
    """The output projection tied to the embedding table (`head.table`, tied_to)."""
    table = next(p for p in model.params if p.name == "embedding0.table")
    head = attrs.evolve(table, name="head.table", tied_to=table.name)
    params = tuple(p for p in model.params if p.name != "linear0.weight") + (head,)
    ops = tuple(attrs.evolve(op, args=tuple("head.table" if a == "linear0.weight" else a
                                            for a in op.args)) for op in model.ops)
    return attrs.evolve(model, params=params, ops=ops)


def rel(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * abs(want), f"{what}: {got!r} vs single-rank {want!r}"


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=RTOL, atol=RTOL * scale + 1e-12), \
        f"{what}: max abs diff {float((got - want).abs().max()):.3e} (scale {scale:.3e})"


def golden(layout: str, name: str, zero: int, tie: bool = False) -> None:
    par = SPEC.parallel(layout)
    assert par.world_size == W.size, f"{layout} needs {par.world_size} ranks, not {W.size} (@ranks)"
    model = tied(SPEC.model()) if tie else SPEC.model()
    graph = lower_pipeline(model, par)
    if tie:
        assert graph.shared and graph.shared[0][0] == "embedding0.table", graph.shared
    single = lower(resolve_ties(model), None)
    mesh = Mesh(W, **dict(par.mesh))
    for dtype in (torch.float32, torch.float64):
        ref = ShardedModel(single, None, seed=SEED, dtype=dtype)
        opt_ref = (torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0) if name == "adamw"
                   else torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9))
        pm = Executor(graph, mesh, seed=SEED, dtype=dtype)
        pm.use_optimizer(name=name, lr=LR, momentum=0.9, zero=zero, grad_clip=CLIP)
        for step in range(STEPS):
            batch = random_inputs(lower(model, None), step)
            want = ref(batch)["loss"]
            want.backward()
            want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            opt_ref.step()
            opt_ref.zero_grad()
            got = pm.train_step(batch)
            rel(got, float(want.detach()), f"{layout} step {step} loss ({dtype})")
            assert want_norm > CLIP, "the test must clip"
            if dtype == torch.float64:
                rel(pm.grad_norm, want_norm, f"{layout} step {step} grad norm")
        if dtype == torch.float64 or name == "sgd":
            state = pm.full_state_dict()
            assert set(state) == set(ref.params), "the pipeline holds other params"
            for pname, full in state.items():
                close(full, ref.params[pname].detach(),
                      f"{layout}: {pname} after {STEPS} {name} zero {zero} steps ({dtype})")


@ranks(2)
def case_pp2_1f1b_adamw_clip():
    golden("pp2f1b", "adamw", zero=0)


@ranks(2)
def case_pp2_1f1b_tied_sgd_clip():
    golden("pp2f1b", "sgd", zero=0, tie=True)


@ranks(2)
def case_pp2_interleaved_tied_adamw_clip():
    golden("pp2inter", "adamw", zero=1, tie=True)


@ranks(4)
def case_pp2dp2_zero1_adamw_clip():
    golden("pp2dp2", "adamw", zero=1)


@ranks(4)
def case_pp2dp2_zero1_tied_sgd_clip():
    golden("pp2dp2", "sgd", zero=1, tie=True)
