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

A signal sent to the job is a stop, not a death. Until the child sets up its own handling
(the run's watchdog, `exit_on_signals`, seconds into its start) a forwarded SIGTERM ends it
by the default action; the supervisor, which forwarded it, then says "stopped by SIGTERM"
(rank 0, once) instead of naming a crash, and exits 128 + the signal all the same.

A rank that leaves early with exit code 0 (os._exit(0) in a plugin, a library calling exit)
would pass for success: hydra presets the other ranks' codes to 0 as it kills them, so the
job can exit 0 with no word. The child marks a normal end of its interpreter (atexit) in a
page shared with the supervisor, and the trainer notes each step there (`note_step`); code 0
without that mark is named, with the step, and the supervisor exits 1.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import signal
import socket
import struct
import sys
import time

RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT, signal.SIGCONT)
WHY = {signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer",
       signal.SIGSEGV: "a crash in native code", signal.SIGBUS: "a crash in native code",
       signal.SIGABRT: "an abort in native code"}
PR_SET_PDEATHSIG = 1
EXIT_EARLY = 1  # the job's exit code when a rank left with 0 before its end
# a stopped rank other than 0 waits this long before exiting: hydra kills every rank the
# moment the first one exits, and rank 0's supervisor must get its line out first
STOP_WAIT_S = 2.0
# the page shared by supervisor and child: [ended normally, step + 1 (0: none yet)]
_LAYOUT = struct.Struct("qq")
_shared: mmap.mmap | None = None  # the child's view of it (None: not supervised)


def launched_rank() -> int | None:
    """This process's world rank as the launcher's environment says, or None (no launcher)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def note_step(step: int) -> None:
    """Record the training step this rank is in, for its supervisor to name if it leaves."""
    if _shared is not None:
        _shared[8:16] = struct.pack("q", step + 1)


def supervise() -> None:
    """Under a launcher: fork, return in the child (which does the work) and never return in
    the parent, which waits, reports a death, a stop or an early exit, and exits with the
    child's status."""
    global _shared
    rank = launched_rank()
    if rank is None or os.environ.get("SOAPSTONE_SUPERVISE", "1").strip() == "0":
        return
    if "mpi4py.MPI" in sys.modules:  # called from a program that has MPI already (a test,
        return  # the Python API): a fork would copy its live MPI state into the child
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getpid()
    shared = mmap.mmap(-1, _LAYOUT.size)  # anonymous and MAP_SHARED: both sides see writes
    # blocked across the fork: a signal before the forwarding is in place waits, not kills
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        _die_with(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _shared = shared
        atexit.register(_mark_ended, os.getpid())  # before MPI's: runs after it (LIFO)
        return
    sent: set[int] = set()
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(child, signum, sent))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    status = os.waitpid(child, 0)[1]  # retried after each forwarded signal (PEP 475)
    host = socket.gethostname()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in sent:  # the job was sent it: the child had no handler yet, not a crash
            _say_stopped(rank, child, host, sig)
        else:
            _say(death_line(rank, child, host, sig))
        os._exit(128 + sig)
    code = os.waitstatus_to_exitcode(status)
    ended, step = _LAYOUT.unpack(shared[:_LAYOUT.size])
    if code == 0 and not ended:
        _say(early_exit_line(rank, child, host, code, step - 1 if step else None))
        os._exit(EXIT_EARLY)
    os._exit(code)


def death_line(rank: int, pid: int, host: str, sig: int) -> str:
    """What the supervisor of a rank killed by `sig` prints."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    why = f": {WHY[sig]}" if sig in WHY else ""
    return (f"soapstone: rank {rank} (pid {pid} on {host}) died: killed by signal {sig} "
            f"({name}{why}); the launcher ends the job")


def early_exit_line(rank: int, pid: int, host: str, code: int, step: int | None) -> str:
    """What the supervisor of a rank that exited before the job ended prints."""
    where = f", in step {step}" if step is not None else ""
    return (f"soapstone: rank {rank} (pid {pid} on {host}) exited (code {code}) before the "
            f"job ended{where}; the launcher ends the job")


def stopped_line(sig: int) -> str:
    """What rank 0's supervisor prints when a signal sent to the job ended its rank."""
    return f"soapstone: stopped by {signal.Signals(sig).name}; every rank exits"


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _say_stopped(rank: int, pid: int, host: str, sig: int) -> None:
    if rank == 0:
        _say(stopped_line(sig))
        return
    time.sleep(STOP_WAIT_S)  # a signal sent to the job: hydra ends this sooner, once rank 0 exits
    # still here: the signal came to this rank alone (a kill of its pid), so say whose it was
    _say(f"soapstone: rank {rank} (pid {pid} on {host}) stopped by "
         f"{signal.Signals(sig).name}, sent to it alone; the launcher ends the job")


def _forward(child: int, signum: int, sent: set[int]) -> None:
    sent.add(signum)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _mark_ended(pid: int) -> None:
    """atexit in the child: its interpreter ends normally (not a forked grandchild's)."""
    if _shared is not None and os.getpid() == pid:
        _shared[0:8] = struct.pack("q", 1)


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
