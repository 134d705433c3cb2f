"""Data parallel and ZeRO: golden numerics under mpiexec (tests/shard/parallel/dp_cases.py, one
launch per world size), plus single-process checks of the flat optimizers against torch.optim."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpirun import case_params

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.runtime.sharded_model import ShardedModel
from soapstone.shard.train.optim import build_optimizer

CASES = "tests/shard/parallel/dp_cases.py"
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_data_parallel_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def _batch(model, step):
    g = torch.Generator().manual_seed(step)
    d = dict(model.dims)
    return {"tokens": torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=g),
            "targets": torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=g)}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_flat_optimizer_matches_torch(name, clip):
    """One rank, fp32: our flat update + clipping is bitwise torch.optim + clip_grad_norm_.
    track_norm=False: the norm is computed only where clipping needs it; the update is the same."""
    model = dsl.load(ROOT / "examples/gpt.par").model()
    ref = ShardedModel(lower(model, None), None, seed=2)
    m = ShardedModel(lower(model, None), None, seed=2)
    lr = 1e-3 if name == "adamw" else 1e-2
    if name == "adamw":
        # our flat AdamW runs torch's fused CPU kernel: compare with the same arithmetic
        o_ref = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, fused=True)
    else:
        o_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, weight_decay=0.1)
    opt = build_optimizer(m, name, lr=lr, weight_decay=0.1, grad_clip=clip, bucket_mb=0.01,
                          track_norm=False)
    for step in range(3):
        b = _batch(model, step)
        ref(b)["loss"].backward()
        m(b)["loss"].backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else 1e9)
        o_ref.step()
        o_ref.zero_grad()
        opt.step()
        opt.zero_grad()
        if clip is None:
            assert opt.grad_norm is None  # nothing asked for it: not computed
        else:
            assert opt.grad_norm == pytest.approx(float(norm), rel=1e-5)
    for k, p in ref.params.items():
        if clip is None:
            assert torch.equal(m.params[k].detach(), p.detach()), k
        else:  # torch sums the norm per tensor first: the clip factor differs in the last bit
            assert torch.allclose(m.params[k].detach(), p.detach(), rtol=1e-5, atol=1e-7), k


def test_build_optimizer_rejects_bad_arguments():
    model = dsl.load(ROOT / "examples/mlp.par").model()
    m = ShardedModel(lower(model, None), None, seed=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer(m, "lamb")
    with pytest.raises(ValueError, match="zero must be"):
        build_optimizer(m, zero=4)


def test_zero_stages_nest_and_a_single_data_rank_runs_stage_0():
    """What each ZeRO stage answers (shard/parallel/zero_stage.py): each shards what the one
    below does and one thing more; over one data rank there is nothing to shard."""
    from soapstone.shard.parallel.zero_stage import ZeroStage

    table = [(z.shards_optimizer, z.shards_grads, z.shards_params, z.keeps_full_grad,
              z.publishes_params) for z in map(ZeroStage.of, range(4))]
    assert table == [(False, False, False, True, False), (True, False, False, True, True),
                     (True, True, False, False, True), (True, True, True, False, False)]
    assert ZeroStage.of(3).on(1) == ZeroStage.of(0) and ZeroStage.of(2).on(4).level == 2
    assert ZeroStage.of(ZeroStage.of(1)) is ZeroStage.of(1) and str(ZeroStage.of(2)) == "2"
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        ZeroStage.of(4)


def test_a_step_that_skips_parameters_reduces_zeros_for_them():
    """zero_grad leaves stage 0's buffers stale (data_parallel.py, Bucket.settle): a parameter
    the next backward does not reach reduces as zero, not as last step's gradient, and the
    ones it reaches hold their new gradient alone, accumulated over two backwards."""
    model = dsl.load(ROOT / "examples/gpt.par").model()
    m = ShardedModel(lower(model, None), None, seed=0)
    opt = build_optimizer(m, "sgd", lr=0.0, zero=0)
    m(_batch(model, 0))["loss"].backward()
    opt.step()
    opt.zero_grad()
    names = list(m.params)
    used = [m.params[n] for n in names[:2]]
    for _ in range(2):
        sum(p.sum() for p in used).backward()
    opt.grad_norm_sq()  # finishes the reduction; fp32 grads are then views of the sums
    for n in names:
        p = m.params[n]
        want = torch.full_like(p, 2.0) if n in names[:2] else torch.zeros_like(p)
        assert torch.equal(p.grad, want), n
