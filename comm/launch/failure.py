"""Fail fast: an uncaught exception on any rank aborts the whole MPI job, and says why.

Without this, one rank dies and the others wait forever in their next collective. The hook
prints the failing rank's traceback once, every line prefixed `[rank R]` so it stands out in
interleaved output. With the watchdog running (init() starts it) every other rank then dumps its
flight recorder and answers, rank 0 prints a one-line summary naming the failed rank, and the
failing rank's state goes to SOAPSTONE_TRACE_DIR. Before MPI.COMM_WORLD.Abort(1) (which makes
mpiexec kill every rank) the rank waits, bounded, until the launcher has read what it printed:
output still in a pipe when the job is torn down is lost (watchdog.drain_stdio).
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
        from soapstone.comm.observe import watchdog

        dog = watchdog.get()
        try:
            if dog is not None:
                summary = "".join(traceback.format_exception_only(exc_type, exc)).strip()
                dog.report_failure(summary.split("\n")[-1])
        except Exception as e:  # the report is extra: the traceback is out, Abort regardless
            sys.stderr.write(f"{prefix}(no flight-recorder report: {type(e).__name__}: {e})\n")
        watchdog.drain_stdio()
    finally:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def install_failure_handler() -> None:
    """Make an uncaught exception on this rank abort the whole job (idempotent)."""
    global _installed
    if not _installed:
        sys.excepthook = abort_on_exception
        _installed = True
