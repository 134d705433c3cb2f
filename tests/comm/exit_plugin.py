"""A --plugin for tests/comm/test_supervisor.py: one world rank leaves a running
`soapstone run` with os._exit (no exception, no SystemExit, no atexit: as a library calling
exit would). SOAPSTONE_TEST_EXIT=RANK:STEP:CODE makes world rank RANK exit with CODE as
training step STEP begins; the other ranks are left in the step's collectives."""

from __future__ import annotations

import os

from soapstone.shard.train.trainer import Trainer

RANK, STEP, CODE = (int(x) for x in os.environ.get("SOAPSTONE_TEST_EXIT", "-1:0:0").split(":"))
_step = Trainer.step


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def step(self, i):
    """Trainer.step, except that the chosen rank exits at the chosen step."""
    if i == STEP and _rank() == RANK:
        os._exit(CODE)
    return _step(self, i)


Trainer.step = step
