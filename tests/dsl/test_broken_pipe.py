"""stdout closed early (`soapstone show ... | head -1`): the command ends quietly with exit 141
(128 + SIGPIPE, as a Unix tool killed by SIGPIPE reports), no traceback, no "Exception
ignored" from the interpreter's last flush. Real pipes, real processes: the reader's end is
closed before the command writes, so the write fails whatever the timing (a `| head -1`
races the writer: output that fits the pipe before head exits is written whole, exit 0,
as with any Unix tool)."""

from __future__ import annotations

import os
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


def test_a_reader_gone_mid_write_is_141_under_python_u():
    """Under PYTHONUNBUFFERED a pipe whose reader leaves mid-write takes part of a long write
    and the text layer dropped the rest with exit 0; now the rest fails, exit 141."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([*CLI, "show", "examples/llama.par", "--parallel", "ptd8", "--json"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert len(p.stdout.read(1000)) == 1000  # more than a pipe holds is still to come
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and err == "", (p.returncode, err)


def test_without_a_closed_pipe_nothing_changes():
    p = subprocess.run([*CLI, "check", "examples/gpt.par"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok: examples/gpt.par"), p
