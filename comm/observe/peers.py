"""Where every rank runs (host, pid), and which of them are gone.

The watchdog gathers every rank's (host, pid) once, when it starts, over its side channel.
While this rank waits in a comm op, a member of that op's communicator whose process no
longer exists can never arrive: the launcher did not end the job (hydra does when a rank dies
by a signal, not when one exits with 0; other launchers may not at all), so the watchdog says
which rank is gone, where, and ends the job instead of waiting out the collective timeout.
Only ranks on this host can be looked at (their pids are this kernel's); the others are named
with their host and pid in the timeout report.
"""

from __future__ import annotations

import os
import socket

import attrs

GONE_AFTER_S = 2.0  # look for gone peers once an op has waited this long


def here() -> tuple[str, int]:
    """This process's (host, pid)."""
    return socket.gethostname(), os.getpid()


@attrs.frozen
class Peers:
    """Each world rank's (host, pid), by rank."""

    where: tuple[tuple[str, int], ...]

    def name(self, rank: int) -> str:
        """"rank 1 (pid 4242 on node7)"."""
        host, pid = self.where[rank]
        return f"rank {rank} (pid {pid} on {host})"

    def gone(self, ranks) -> list[int]:
        """The ranks among `ranks` on this host whose process has ended."""
        me = socket.gethostname()
        return [r for r in ranks if self.where[r][0] == me and not alive(self.where[r][1])]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): it exists
