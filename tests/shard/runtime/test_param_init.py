"""Sharded initialisation (shard/runtime/init/param_init.py over init/counter_rng.py): any
box of a parameter equals the same box of the whole tensor bit for bit, the work is the box's,
and the schemes keep their statistics; under mpiexec, every layout's shards equal the single-rank
model's slices (tests/shard/runtime/init_cases.py)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from mpirun import case_params

from soapstone.shard.plan.layout import Layout
from soapstone.shard.plan.program import ParamSpec
from soapstone.shard.runtime.init import counter_rng
from soapstone.shard.runtime.init.param_init import init_full, init_shard

CASES = "tests/shard/runtime/init_cases.py"


def param(shape, init, dtype="f32"):
    """A ParamSpec of `shape` (no layout: these tests cut boxes by hand)."""
    dims = tuple(f"d{i}" for i in range(len(shape)))
    return ParamSpec("block.w", dtype, dims, tuple(shape), init, Layout(()), tuple(shape))


def boxes(shape, n, rng):
    """n random non-empty boxes of `shape`."""
    for _ in range(n):
        box = []
        for size in shape:
            a = rng.randrange(size)
            box.append(slice(a, rng.randint(a + 1, size)))
        yield tuple(box)


@pytest.mark.parametrize("init", ["normal(0.02)", "uniform(0.5)", "zeros", "ones"])
def test_any_box_equals_the_full_tensor_slice(init, monkeypatch):
    shape = (13, 6, 70)
    p = param(shape, init)
    full = init_full(p, seed=3)
    assert full.dtype == torch.float32 and full.shape == shape
    for box in boxes(shape, 40, random.Random(0)):
        assert torch.equal(init_shard(p, 3, box), full[box]), box
    # however the box is cut into pieces (rows at a time, one index of a dim at a time)
    for chunk in (7, 64, 500):
        monkeypatch.setattr(counter_rng, "CHUNK", chunk)
        assert torch.equal(init_full(p, 3), full)


def test_values_depend_on_seed_name_and_index_only():
    p = param((40, 50), "normal(1.0)")
    a = init_full(p, 1)
    assert not torch.equal(a, init_full(p, 2))
    other = ParamSpec("block.v", "f32", p.dims, p.shape, p.init, p.layout, p.local_shape)
    assert not torch.equal(a, init_full(other, 1))
    # the same flat index gives the same value whatever the shape around it
    flat = init_full(param((2000,), "normal(1.0)"), 1)
    assert torch.equal(a.reshape(-1), flat)
    assert init_full(param((40, 50), "normal(1.0)", "f64"), 1).dtype == torch.float64


def test_work_is_the_box_and_pieces_are_bounded():
    shape = (64, 16, 128)
    box = (slice(8, 40), slice(4, 6), slice(0, 128))  # tp over the middle dim
    pieces = list(counter_rng._chunks(shape, box, None))
    assert sum(len(f) for _, f in pieces) == 32 * 2 * 128  # no element outside the box
    assert max(len(f) for _, f in pieces) <= counter_rng.CHUNK
    big = (1, 3 * counter_rng.CHUNK)  # a row longer than a piece: one row at a time
    assert max(len(f) for _, f in counter_rng._chunks(big, (slice(0, 1), slice(0, big[1])),
                                                        None)) <= counter_rng.CHUNK


def test_normal_moments():
    n = 1 << 21
    z = init_full(param((n,), "normal(0.02)"), 0).double() / 0.02
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se
    assert abs(z.std() - 1) < 5 * se
    assert abs((z ** 3).mean()) < 5 * math.sqrt(15) * se  # skew 0
    assert abs((z ** 4).mean() - 3) < 5 * math.sqrt(96) * se  # kurtosis 3
    # the tails are the normal's: P(|z| > 3) = 0.0027, P(|z| > 4) = 6.3e-5, no truncation
    for k, p in ((1, 0.3173), (2, 0.0455), (3, 0.0027), (4, 6.33e-5)):
        got = float((z.abs() > k).double().mean())
        assert abs(got - p) < 5 * math.sqrt(p / n) + 1e-7, (k, got, p)
    assert z.abs().max() > 4.5


def test_uniform_moments_and_bounds():
    n = 1 << 20
    u = init_full(param((n,), "uniform(0.5)"), 0).double()
    assert u.min() > -0.5 and u.max() < 0.5
    se = 0.5 / math.sqrt(3 * n)
    assert abs(u.mean()) < 5 * se
    assert abs(u.std() - 0.5 / math.sqrt(3)) < 5 * se
    counts = torch.histc(u, bins=10, min=-0.5, max=0.5)
    assert (counts - n / 10).abs().max() < 5 * math.sqrt(n / 10)


def test_inverse_cdf_and_log_accuracy():
    from statistics import NormalDist

    u = torch.tensor([1e-300, 1e-12, 1e-6, 0.001, 0.02, 0.02425, 0.3, 0.5, 0.9, 1 - 1e-9],
                     dtype=torch.float64)
    z = counter_rng.normal_from_uniform(u)
    want = torch.tensor([NormalDist().inv_cdf(max(x, 1e-300)) for x in u.tolist()],
                        dtype=torch.float64)
    assert torch.allclose(z, want, rtol=2e-9, atol=0)
    x = torch.logspace(-300, 0, 5000, dtype=torch.float64)
    assert torch.allclose(counter_rng.log(x), torch.log(x), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_sharded_init_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


def test_load_full_state_dict_takes_exactly_the_programs_parameters():
    """ShardedModel.load_full_state_dict's state dict is checked whole before the first copy:
    a missing key was a KeyError, a misspelt or another model's key skipped silently, an
    integer tensor cast silently, a numpy array an AttributeError, and a wrong shape after
    the first parameter left the model half loaded. Each is a ShapeMismatch naming the key;
    the model keeps its weights; what full_state_dict() gives loads back unchanged."""
    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.runtime.sharded_model import ShapeMismatch, ShardedModel

    spec = dsl.load(Path(__file__).resolve().parents[3] / "examples/mlp.par")
    m = ShardedModel(lower(spec.model(), None), None, seed=0)
    full = m.full_state_dict()
    w = "linear0.weight"
    moved = {k: v + 1 for k, v in full.items()}
    for bad, said in (
            ({k: v for k, v in moved.items() if k != w}, "missing 1 of its parameters "
                                                         "(linear0.weight); the keys are"),
            ({("x" + k if k == w else k): v for k, v in moved.items()},
             "missing 1 of its parameters (linear0.weight); 1 key(s) naming none "
             "(xlinear0.weight)"),
            ({**moved, "stray": torch.zeros(1)}, "1 key(s) naming none (stray)"),
            ({**moved, w: moved[w].long()}, "load_full_state_dict: linear0.weight is a "
                                            "torch.int64 tensor"),
            ({**moved, w: moved[w].numpy()}, "load_full_state_dict: linear0.weight is of "
                                             "type ndarray"),
            ({**moved, "linear1.bias": torch.zeros(3)}, "linear1.bias: expected global shape")):
        with pytest.raises(ShapeMismatch) as e:
            m.load_full_state_dict(bad)
        assert said in str(e.value), str(e.value)
        now = m.full_state_dict()
        assert all(torch.equal(now[k], full[k]) for k in full), said
    m.load_full_state_dict(moved)
    now = m.full_state_dict()
    assert all(torch.equal(now[k], moved[k]) for k in full)
