"""The one dtype table (comm/dtype_table.py) agrees with torch, and everything reads it."""

from __future__ import annotations

import pytest
import torch

from soapstone.comm import dtype_table
from soapstone.comm import dtypes as comm_dtypes
from soapstone.dsl.layers import registry as layers
from soapstone.shard.checkpoint import index as checkpoint_index
from soapstone.shard.plan import dtypes, layout
from soapstone.shard.plan.analysis import explain
from soapstone.shard.runtime import calibrate
from soapstone.shard.runtime.sharded_model import TORCH_DTYPES


def test_the_table_matches_torch():
    for d in dtype_table.TABLE:
        t = getattr(torch, d.torch_name)
        assert torch.empty((), dtype=t).element_size() == d.nbytes, d
        assert t.is_floating_point == d.is_float, d
    assert set(TORCH_DTYPES) == set(dtypes.DTYPES)
    for name, d in dtypes.DTYPES.items():
        assert TORCH_DTYPES[name] == getattr(torch, d.torch_name)
        assert d.is_float == dtypes.is_float(name), name


def test_every_dtype_fact_comes_from_the_table():
    assert layout.DTYPE_BYTES is dtypes.DTYPE_BYTES
    assert explain.FLOAT_BYTES == {n: dtypes.DTYPE_BYTES[n] for n in dtypes.FLOATS}
    # a spec declares floats and ints, listed in the table's order
    assert layers.DTYPES == ("f16", "bf16", "f32", "f64", "i32", "i64")
    carried = [d for d in dtype_table.TABLE if d.mpi]
    assert comm_dtypes.SUPPORTED == tuple(getattr(torch, d.torch_name) for d in carried)
    assert set(comm_dtypes.FLOATING) == {t for t in comm_dtypes.SUPPORTED if t.is_floating_point}
    assert checkpoint_index.DTYPES == {d.torch_name: (d.safetensors, d.nbytes)
                                       for d in dtype_table.TABLE if d.safetensors}
    assert calibrate.DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_precisions_map_through_the_table():
    p = dtype_table.PRECISIONS
    assert {n: d.spec for n, d in p.items()} == {"bf16": "bf16", "fp32": "f32", "fp64": "f64"}
    assert set(dtype_table.RUN_PRECISIONS) <= set(p)


def test_the_lexer_knows_the_languages_dtypes_only():
    pytest.importorskip("pygments")
    from soapstone.dsl.lang import lexer

    assert lexer.DTYPES == tuple(dtypes.DTYPES)  # no i8, i16 or u8: the language lacks them
