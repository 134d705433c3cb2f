"""stdout closed early (`soapstone show ... | head -1`): the command ends quietly with exit 141
(128 + SIGPIPE, as a Unix tool killed by SIGPIPE reports), no traceback, no "Exception
ignored" from the interpreter's last flush. Real pipes, real processes: the reader's end is
closed before the command writes, so the write fails whatever the timing (a `| head -1`
races the writer: output that fits the pipe before head exits is written whole, exit 0,
as with any Unix tool)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    assert p.returncode == 141, (p.returncode, p.stderr)
    assert p.stderr == "", p.stderr


@pytest.mark.parametrize("args", [
    ["show", "examples/gpt.par", "--parallel", "gpt8"],
    ["explain", "examples/gpt.par", "--parallel", "gpt8"],
    ["check", "examples/gpt.par", "--verify"],
    ["plan", "examples/gpt.par", "--world", "8", "--profile", "h100-80gb"],
])
def test_closed_stdout_exits_141_quietly(args):
    quiet_141(closed_stdout(*args))


def test_without_a_closed_pipe_nothing_changes():
    p = subprocess.run([*CLI, "check", "examples/gpt.par"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok: examples/gpt.par"), p
