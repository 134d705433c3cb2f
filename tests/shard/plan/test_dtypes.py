"""The one dtype table (shard/plan/dtypes.py) agrees with torch, and everything reads it."""

from __future__ import annotations

import torch

from soapstone.dsl.layers import registry as layers
from soapstone.shard.plan import dtypes, layout
from soapstone.shard.plan.analysis import explain
from soapstone.shard.runtime.sharded_model import TORCH_DTYPES


def test_the_table_matches_torch():
    assert set(TORCH_DTYPES) == set(dtypes.DTYPES)
    for name, d in dtypes.DTYPES.items():
        t = TORCH_DTYPES[name]
        assert torch.empty((), dtype=t).element_size() == d.nbytes, name
        assert t.is_floating_point == d.is_float == dtypes.is_float(name), name


def test_every_dtype_fact_comes_from_the_table():
    assert layout.DTYPE_BYTES is dtypes.DTYPE_BYTES
    assert explain.FLOAT_BYTES == {n: dtypes.DTYPE_BYTES[n] for n in dtypes.FLOATS}
    # a spec declares floats and ints, listed in the table's order
    assert layers.DTYPES == ("f16", "bf16", "f32", "f64", "i32", "i64")
