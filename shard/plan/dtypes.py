"""The dtypes of specs and programs (f32, i64, ...): the rows of the one dtype table
(comm/dtype_table.py) that a spec can name, keyed by that name.

The language (which dtypes a spec may declare), the plan (byte counts, which values carry
gradients) and the runtime (`getattr(torch, d.torch_name)`) all read it. No torch here.
"""

from __future__ import annotations

from soapstone.comm.dtype_table import TABLE, DType, Kind

# In the order `soapstone check` lists them.
DTYPES: dict[str, DType] = {d.spec: d for d in TABLE if d.spec is not None}

FLOATS = tuple(n for n, d in DTYPES.items() if d.kind is Kind.FLOAT)
INTS = tuple(n for n, d in DTYPES.items() if d.kind is Kind.INT)
DTYPE_BYTES = {n: d.nbytes for n, d in DTYPES.items()}


def is_float(name: str) -> bool:
    """Whether dtype `name` is a float type (KeyError for an unknown name)."""
    return DTYPES[name].is_float
