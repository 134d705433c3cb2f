"""The dtypes of specs and programs, one table: name -> bytes per element, kind, torch name.

The language (which dtypes a spec may declare), the plan (byte counts, which values carry
gradients) and the runtime (`getattr(torch, d.torch_name)`) all read it. No torch here.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class DType:
    """One dtype: its name in specs and programs, bytes per element, kind, torch attribute."""

    name: str
    nbytes: int
    kind: str  # "float" | "int" | "bool"
    torch_name: str  # the attribute of the torch module: torch.float32, ...

    @property
    def is_float(self) -> bool:
        """Whether values of this dtype carry gradients."""
        return self.kind == "float"


# In the order `soapstone check` lists them.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f16", 2, "float", "float16"),
    DType("bf16", 2, "float", "bfloat16"),
    DType("f32", 4, "float", "float32"),
    DType("f64", 8, "float", "float64"),
    DType("i32", 4, "int", "int32"),
    DType("i64", 8, "int", "int64"),
    DType("bool", 1, "bool", "bool"),
)}

FLOATS = tuple(n for n, d in DTYPES.items() if d.kind == "float")
INTS = tuple(n for n, d in DTYPES.items() if d.kind == "int")
DTYPE_BYTES = {n: d.nbytes for n, d in DTYPES.items()}


def is_float(name: str) -> bool:
    """Whether dtype `name` is a float type (KeyError for an unknown name)."""
    return DTYPES[name].is_float
