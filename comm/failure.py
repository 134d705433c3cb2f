"""Fail fast: an uncaught exception on any rank aborts the whole MPI job.

Without this, one rank dies and the others wait forever in their next collective. The hook
prints the failing rank's traceback once, every line prefixed `[rank R]` so it stands out in
interleaved output, then calls MPI.COMM_WORLD.Abort(1), which makes mpiexec kill every rank.
"""

from __future__ import annotations

import sys
import traceback

_installed = False


def world_rank() -> int:
    """This process's rank in MPI.COMM_WORLD (0 when MPI is not initialised)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0


def abort_on_exception(exc_type, exc, tb) -> None:
    """sys.excepthook: print `[rank R]`-prefixed traceback to stderr, then MPI Abort(1)."""
    try:
        rank = world_rank()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        prefix = f"[rank {rank}] "
        sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
        sys.stderr.write(f"{prefix}aborting the MPI job (soapstone.comm failure handler)\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def install_failure_handler() -> None:
    """Make an uncaught exception on this rank abort the whole job (idempotent)."""
    global _installed
    if not _installed:
        sys.excepthook = abort_on_exception
        _installed = True
