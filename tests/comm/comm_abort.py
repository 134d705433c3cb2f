"""A job that fails on one rank: `raise` (rank 2 raises while the others sit in a collective)
or `mismatch` (SOAPSTONE_DEBUG_COLLECTIVES=1 and ranks pass different shapes). Run by
tests/comm/test_comm_failure.py; it must end quickly with the failing rank's message, never hang."""

from __future__ import annotations

import sys
import time

import torch

from soapstone.comm import init

mode = sys.argv[1]
w = init("mpi")
if mode == "raise":
    if w.rank == 2:
        time.sleep(0.5)  # let the others block in the allreduce first
        raise RuntimeError("boom from rank 2")
    w.allreduce(torch.ones(4))
elif mode == "mismatch":
    w.allreduce(torch.ones(3 if w.rank == 1 else 4))
w.barrier()
print("unreachable", flush=True)
