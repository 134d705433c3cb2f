"""Jobs that hang in plain code, for tests/comm/observe/test_watchdog.py (2 ranks, a few seconds of
SOAPSTONE_COLLECTIVE_TIMEOUT): `skip` (rank 1 skips an allreduce and goes on to a barrier) or
`mismatch` (rank 0 calls allgather where rank 1 calls allreduce). The watchdog must end each
with a report naming rank 1 and the op; never a hang.

The ranks meet in a raw MPI barrier (not watched) after their imports, so that the deadline
only ever covers the hang, not a slow start on a loaded machine.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from soapstone.comm import init

MPI.COMM_WORLD.Barrier()
w = init("mpi")
x = torch.ones(4)
w.allreduce(x)
if sys.argv[1] == "skip":
    if w.rank != 1:
        w.allreduce(x)
    w.barrier()
elif sys.argv[1] == "mismatch":
    if w.rank == 0:
        w.allgather(x)
    else:
        w.allreduce(x)
print("unreachable", flush=True)
