"""The name of a rank that dies: each rank of a launched job runs under a small supervisor.

A rank killed outright (kill -9, the kernel's OOM killer, a crash in native code) gets no
chance to say anything, and mpiexec (hydra) kills the other ranks at once, SIGKILL, before
their watchdogs can notice: what survives is the launcher's "BAD TERMINATION ... PID N
RUNNING AT host", a pid nobody knows. So a command that launches under mpiexec (`run`,
`golden check`, `generate`) forks first, before MPI or torch: the child does the work, the
process the launcher started waits for it. When the child dies by a signal, the supervisor,
which knows its rank from the launcher's environment, prints one line to stderr

    soapstone: rank 1 (pid 4242 on node7) died: killed by signal 9 (SIGKILL: kill -9, or
    the kernel's out-of-memory killer); the launcher ends the job

and exits 128 + the signal, so mpiexec tears the job down as before, with the name in its
output. Otherwise it exits with the child's code. Signals the launcher forwards (SIGTERM,
SIGINT, SIGUSR1, ...) go on to the child, once (the child has its own process group, so a
signal to the launched process's group does not reach it twice); the child dies with its
supervisor
(PR_SET_PDEATHSIG), so a killed supervisor never leaves a rank behind. Without a launcher
(no PMI_RANK, PMIX_RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID), or in a process that has
loaded MPI already (the CLI called from Python under mpiexec), nothing forks;
SOAPSTONE_SUPERVISE=0 turns it off. Torch-free, MPI-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys

RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT, signal.SIGCONT)
WHY = {signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer",
       signal.SIGSEGV: "a crash in native code", signal.SIGBUS: "a crash in native code",
       signal.SIGABRT: "an abort in native code"}
PR_SET_PDEATHSIG = 1


def launched_rank() -> int | None:
    """This process's world rank as the launcher's environment says, or None (no launcher)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def supervise() -> None:
    """Under a launcher: fork, return in the child (which does the work) and never return in
    the parent, which waits, reports a death by signal, and exits with the child's status."""
    rank = launched_rank()
    if rank is None or os.environ.get("SOAPSTONE_SUPERVISE", "1").strip() == "0":
        return
    if "mpi4py.MPI" in sys.modules:  # called from a program that has MPI already (a test,
        return  # the Python API): a fork would copy its live MPI state into the child
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with(parent)
        return
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(child, signum))
    status = os.waitpid(child, 0)[1]  # retried after each forwarded signal (PEP 475)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        sys.stderr.write(death_line(rank, child, socket.gethostname(), sig) + "\n")
        sys.stderr.flush()
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def death_line(rank: int, pid: int, host: str, sig: int) -> str:
    """What the supervisor of a rank killed by `sig` prints."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    why = f": {WHY[sig]}" if sig in WHY else ""
    return (f"soapstone: rank {rank} (pid {pid} on {host}) died: killed by signal {sig} "
            f"({name}{why}); the launcher ends the job")


def _forward(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _die_with(parent: int) -> None:
    """The child: its own process group, so a signal the launcher sends to the group reaches
    it once, through the supervisor, not twice; SIGKILL when the supervisor dies (Linux), so
    no rank outlives it."""
    import ctypes

    with contextlib.suppress(OSError):
        os.setpgid(0, 0)

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(128 + signal.SIGKILL)
