"""stdout closed early (`soapstone show ... | head -1`): the command ends quietly with exit 141
(128 + SIGPIPE, as a Unix tool killed by SIGPIPE reports), no traceback, no "Exception
ignored" from the interpreter's last flush. Real pipes, real processes: the reader's end is
closed before the command writes, so the write fails whatever the timing (a `| head -1`
races the writer: output that fits the pipe before head exits is written whole, exit 0,
as with any Unix tool)."""

from __future__ import annotations

import subprocess

import pytest
from closed_pipe import CLI, ROOT, closed_stdout, quiet_141


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
