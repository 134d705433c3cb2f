"""The dtypes soapstone knows, one table: each one's names (torch's, a spec's, a safetensors
file's, MPI's datatype, a --precision flag's), its bytes per element and its kind.

Everything that names a dtype reads it: the communicators (comm/dtypes.py: which torch dtypes
they carry and how each travels over MPI), the language and the plan (shard/plan/dtypes.py:
the spec names), checkpoints (shard/checkpoint/index.py), the trainer's and calibration's
precisions, and the `.par` lexer. It lives in comm, the lowest layer, because the comm layer
names dtypes too; no torch here (`getattr(torch, d.torch_name)` is the torch dtype).
"""

from __future__ import annotations

import enum

import attrs


class Kind(enum.Enum):
    """What a dtype's values are."""

    FLOAT = "float"
    INT = "int"
    BOOL = "bool"


@attrs.frozen
class DType:
    """One dtype and its names; a None name: that place does not take it."""

    torch_name: str  # the attribute of the torch module, and the name messages print
    nbytes: int
    kind: Kind
    spec: str | None = None  # its name in .par specs and Programs
    safetensors: str | None = None  # its code in a safetensors header (what checkpoints hold)
    mpi: str | None = None  # the MPI datatype its elements travel as (what communicators carry)
    precision: str | None = None  # its name as a run's --precision (the compute dtype)

    @property
    def is_float(self) -> bool:
        """Whether values of this dtype carry gradients."""
        return self.kind is Kind.FLOAT


# Spec dtypes first, in the order `soapstone check` lists them. fp16 and bf16 have no MPI
# datatype: their bytes travel as uint16 (comm/dtypes.py reduces them in torch).
TABLE: tuple[DType, ...] = (
    DType("float16", 2, Kind.FLOAT, "f16", "F16", "UINT16_T"),
    DType("bfloat16", 2, Kind.FLOAT, "bf16", "BF16", "UINT16_T", precision="bf16"),
    DType("float32", 4, Kind.FLOAT, "f32", "F32", "FLOAT", precision="fp32"),
    DType("float64", 8, Kind.FLOAT, "f64", "F64", "DOUBLE", precision="fp64"),
    DType("int32", 4, Kind.INT, "i32", "I32", "INT32_T"),
    DType("int64", 8, Kind.INT, "i64", "I64", "INT64_T"),
    DType("bool", 1, Kind.BOOL, "bool"),
    DType("int8", 1, Kind.INT, mpi="INT8_T"),
    DType("uint8", 1, Kind.INT, safetensors="U8", mpi="UINT8_T"),
)

#: --precision name -> its dtype (fp64: the whole model in float64, for checks)
PRECISIONS: dict[str, DType] = {d.precision: d for d in TABLE if d.precision}
#: what a run's --precision offers, and what calibration measures (a profile's peak_flops)
RUN_PRECISIONS = ("fp32", "bf16")
#: --precision names that are no one dtype -> the precision everything else computes in.
#: float8: the weight matmuls in float8 with dynamic per-tensor scales (e4m3 forward, e5m2
#: gradients: shard/runtime/float8.py), bf16 around them over fp32 masters
MIXED_PRECISIONS = {"float8": "bf16"}
#: what the commands' --precision accepts
COMMAND_PRECISIONS = RUN_PRECISIONS + tuple(MIXED_PRECISIONS)
