"""Fail fast: an uncaught exception on any rank aborts the whole MPI job, and says why.

Without this, one rank dies and the others wait forever in their next collective. The hook
prints the failing rank's traceback once, every line prefixed `[rank R]` so it stands out in
interleaved output. With the watchdog running (init() starts it) every other rank then dumps its
flight recorder and answers, rank 0 prints a one-line summary naming the failed rank, and the
failing rank's state goes to SOAPSTONE_TRACE_DIR. Before MPI.COMM_WORLD.Abort(1) (which makes
mpiexec kill every rank) the rank waits, bounded, until the launcher has read what it printed:
output still in a pipe when the job is torn down is lost (watchdog.drain_stdio).

Bad input met mid-run is not a crash: a UserError reaching the hook (a token file over 256 MiB
is checked as its windows are read, so one rank may meet an id out of the vocab while the others
wait for it in a collective) ends the job with exit 2 and the error's one line, printed once by
rank 0 whichever rank met it (`end_on_bad_input`), no traceback and no dumps. A CommError keeps
the traceback: a collective called wrongly is the program's error, found where it called it.

A SystemExit never reaches sys.excepthook: the interpreter just exits, and a rank that leaves
mid-run alone leaves the others waiting in their next collective until its timeout. The CLI
hands one escaping a command's main to `end_on_exit`, which ends the whole job at once, naming
the rank and the code.
"""

from __future__ import annotations

import sys
import traceback

from soapstone.comm.errors import CommError, UserError

_installed = False


def world_rank() -> int:
    """This process's rank in MPI.COMM_WORLD (0 when MPI is not initialised)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0


def abort_on_exception(exc_type, exc, tb) -> None:
    """sys.excepthook: print `[rank R]`-prefixed traceback to stderr, then MPI Abort(1); bad
    input (a UserError) ends the job with its one line and exit 2 instead."""
    if isinstance(exc, UserError) and not isinstance(exc, CommError):
        end_on_bad_input(exc)
        return
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


def end_on_bad_input(exc: UserError) -> None:
    """End the whole job with exit 2 and `exc`'s one line, printed once: by rank 0, which the
    watchdog's side channel tells when another rank met it (see the module doc)."""
    from mpi4py import MPI

    from soapstone.comm.observe import watchdog

    line = exc.format()
    try:
        dog = watchdog.get()
        if dog is not None:
            dog.report_bad_input(line)  # never returns: rank 0 prints the line and aborts
        sys.stderr.write(line + "\n")
        watchdog.drain_stdio()
    finally:
        watchdog.quiet_stderr()  # MPICH's own `Abort(2) on node ...` line is not ours to add
        MPI.COMM_WORLD.Abort(watchdog.EXIT_BAD_INPUT)


def end_on_exit(exc: SystemExit, command: str) -> None:
    """Under a job of more than one rank, end it for the SystemExit `exc` that left `command`
    on this rank, with one line naming the rank and the code; return where there is none."""
    # only a world MPI already runs: the preflight commands never import mpi4py for this
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() \
            or mpi.COMM_WORLD.Get_size() < 2:
        return
    from soapstone.comm.observe import watchdog

    code = exc.code
    # a rank leaving mid-run is no success, whatever it said: 0 and None end the job with 1,
    # a message (sys.exit("text")) with 1 too, as Python itself exits for it
    status = code if isinstance(code, int) and not isinstance(code, bool) and code != 0 else 1
    rank = mpi.COMM_WORLD.Get_rank()
    try:
        sys.stdout.flush()
        sys.stderr.write(f"soapstone: rank {rank} raised SystemExit({code!r}) in the middle of "
                         f"`soapstone {command}`; the other ranks would wait for it, so "
                         f"the job ends with exit {status}\n")
        sys.stderr.flush()
        watchdog.drain_stdio()
    finally:
        watchdog.quiet_stderr()  # MPICH's own `Abort(N) on node ...` line adds nothing
        mpi.COMM_WORLD.Abort(status)


def install_failure_handler() -> None:
    """Make an uncaught exception on this rank abort the whole job (idempotent)."""
    global _installed
    if not _installed:
        sys.excepthook = abort_on_exception
        _installed = True
