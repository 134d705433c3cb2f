"""Which torch dtypes the communicators carry, and how each maps onto MPI.

fp16 and bf16 have no MPI datatype in MPICH or mpi4py: their bytes travel as MPI_UINT16_T (pure
data movement needs nothing more) and reductions use a user-defined MPI op that views the
uint16 buffers as the real dtype and does the math in torch. That keeps reductions zero-copy
(no fp32 upcast buffer: the upcast would double the bytes on the wire and cost two extra passes
over memory); torch's half/bf16 add rounds exactly as the single-process op does.
The dtypes and their MPI datatypes are rows of the one table, comm/dtype_table.py.
"""

from __future__ import annotations

import torch

from soapstone.comm.dtype_table import TABLE

_CARRIED = [d for d in TABLE if d.mpi is not None]
SUPPORTED = tuple(getattr(torch, d.torch_name) for d in _CARRIED)

# dtypes that need a user-defined MPI reduction op: floats without an MPI float datatype
CUSTOM_REDUCE = tuple(getattr(torch, d.torch_name) for d in _CARRIED
                      if d.is_float and d.mpi == "UINT16_T")
#: the floating dtypes (an allreduce's op="avg" needs one)
FLOATING = tuple(getattr(torch, d.torch_name) for d in _CARRIED if d.is_float)

SUPPORTED_SET = frozenset(SUPPORTED)
_NAMES = {getattr(torch, d.torch_name): d.torch_name for d in _CARRIED}
_MPI_NAMES = {getattr(torch, d.torch_name): d.mpi for d in _CARRIED}


def dtype_name(d: torch.dtype) -> str:
    """Short name of a dtype ("float32")."""
    return _NAMES.get(d, str(d))


_mpi_types: dict[torch.dtype, object] | None = None
_ops: dict[tuple[torch.dtype, str], object] = {}


def mpi_type(d: torch.dtype):
    """The MPI datatype whose elements have `d`'s size (and, for natives, its arithmetic)."""
    global _mpi_types
    if _mpi_types is None:
        from mpi4py import MPI

        _mpi_types = {t: getattr(MPI, name) for t, name in _MPI_NAMES.items()}
    return _mpi_types[d]


def mpi_op(d: torch.dtype, op: str):
    """The MPI op for reducing dtype `d` with `op` ("sum"/"avg" -> SUM, "max", "min")."""
    found = _ops.get((d, op))  # one dict lookup on the hot path
    if found is None:
        from mpi4py import MPI

        base = "sum" if op == "avg" else op
        if d in CUSTOM_REDUCE:
            found = MPI.Op.Create(_half_reducer(d, base), commute=True)
        else:
            found = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[base]
        _ops[(d, op)] = found
    return found


def _half_reducer(d: torch.dtype, op: str):
    # MPI calls fn(invec, inoutvec, datatype) with raw buffers; inoutvec = invec (op) inoutvec.
    def fn(inbuf, inoutbuf, datatype):
        if len(inoutbuf) == 0:
            return
        a = torch.frombuffer(inbuf, dtype=d)
        b = torch.frombuffer(inoutbuf, dtype=d)
        if op == "sum":
            b.add_(a)
        elif op == "max":
            torch.maximum(a, b, out=b)
        else:
            torch.minimum(a, b, out=b)

    return fn
