"""A command run with its stdout a pipe nobody reads (tests/dsl/test_broken_pipe.py and the
watchdog's `debug hang`): the reading end is closed before the command writes, so the write
fails whatever the timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "soapstone.dsl.cli"]


def closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """Run the command with stdout a pipe whose reading end is already closed."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([*CLI, *args], cwd=ROOT, stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(w)


def quiet_141(p: subprocess.CompletedProcess) -> None:
    """The command ended as a Unix tool killed by SIGPIPE reports, and said nothing."""
    assert p.returncode == 141, (p.returncode, p.stderr)
    assert p.stderr == "", p.stderr
