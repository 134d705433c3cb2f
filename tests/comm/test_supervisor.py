"""The supervisor's verdict on how a rank ended (comm/launch/supervisor.py): a rank that exits
0 before the job ended is named and fails the job; a signal sent to the job that ends a rank
before it handles signals itself is a stop ("stopped by SIGTERM"), not a death; a signal sent
to the rank alone still is a death. First on a bare supervisor (a launcher's rank variable, no
MPI: fast), then on real 2-rank `soapstone run` jobs under mpiexec."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import ROOT, mpiexec

from soapstone.comm.launch.supervisor import early_exit_line, stopped_line

PLUGIN = "tests/comm/exit_plugin.py"
# a supervised child: says its pid, then does what argv[1] says
CHILD = """
import os, sys, time
from soapstone.comm.launch.supervisor import note_step, supervise
supervise()
print(os.getpid(), flush=True)
what = sys.argv[1]
if what == "exit0":
    note_step(3)
    os._exit(0)
if what == "sleep":
    time.sleep(60)
sys.exit(int(what))
"""


def _supervised(what: str, rank: int = 1) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in
           ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
            "SOAPSTONE_SUPERVISE")}
    return subprocess.Popen([sys.executable, "-c", CHILD, what], cwd=ROOT, text=True,
                            env={**env, "PMI_RANK": str(rank)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _child_pid(p: subprocess.Popen) -> int:
    pid = int(p.stdout.readline())
    assert pid != p.pid  # the line comes from the supervised child, not the supervisor
    return pid


def test_exit_0_before_the_end_is_named_and_fails():
    p = _supervised("exit0")
    child = _child_pid(p)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert err.strip() == early_exit_line(1, child, socket.gethostname(), 0, 3), err
    assert "in step 3;" in err and "before the job ended" in err, err


@pytest.mark.parametrize("code", [0, 3])
def test_a_normal_end_keeps_its_code_and_says_nothing(code):
    p = _supervised(str(code))
    _child_pid(p)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (code, "")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_forwarded_sigterm_is_a_stop_not_a_death(rank):
    """The launcher's SIGTERM reaches a child that has no handler of its own yet: the
    default action ends it, and that is the stop the job was asked for. Rank 0 says so; any
    other rank still alive a moment later (no hydra here to end it) was sent it alone, and
    names itself."""
    p = _supervised("sleep", rank)
    child = _child_pid(p)
    p.send_signal(signal.SIGTERM)  # to the supervisor, as hydra sends it
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "died" not in err, err
    alone = (f"soapstone: rank {rank} (pid {child} on {socket.gethostname()}) stopped by "
             "SIGTERM, sent to it alone; the launcher ends the job\n")
    assert err == (stopped_line(signal.SIGTERM) + "\n" if rank == 0 else alone), err


def test_sigterm_to_the_rank_alone_is_a_death():
    p = _supervised("sleep")
    child = _child_pid(p)
    os.kill(child, signal.SIGTERM)  # not through the supervisor: nobody stopped the job
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert f"rank 1 (pid {child} on {socket.gethostname()}) died: killed by signal 15 " \
        "(SIGTERM)" in err, err


# -- real jobs ---------------------------------------------------------------------------------
def _run(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    assert mpiexec() is not None, "no mpiexec: `make test` installs the mpich wheel"
    return subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "soapstone.dsl.cli",
                             "run", "examples/gpt.par", "--parallel", "dp2", "--quiet", *argv],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _finish(p: subprocess.Popen) -> str:
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return out + err


def test_a_rank_exiting_0_mid_run_fails_the_job():
    p = _run(["--steps", "1000", "--plugin", PLUGIN], {"SOAPSTONE_TEST_EXIT": "1:2:0"})
    text = _finish(p)
    assert p.returncode != 0, text
    line = (rf"soapstone: rank 1 \(pid \d+ on {re.escape(socket.gethostname())}\) exited "
            r"\(code 0\) before the job ended, in step 2; the launcher ends the job\n")
    assert re.search(line, text), text
    assert "Traceback" not in text, text


def _workers(marker: str) -> list[int]:
    """The supervised children of this launch: a rank's process (the launcher gave it
    PMI_RANK) whose parent is one too, its supervisor."""
    mine = {}
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if f"SOAPSTONE_EXIT_TEST={marker}".encode() in env and \
                any(v.startswith(b"PMI_RANK=") for v in env):
            mine[int(d.name)] = parent
    return [pid for pid, parent in mine.items() if parent in mine]


def test_sigterm_while_the_ranks_start_is_a_stop():
    """SIGTERM to mpiexec as soon as both ranks' workers exist, long before the run's own
    handling is in place: the job stops with 143 and one stop line, and no rank 'died'."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    p = _run(["--steps", "1000000"], {"SOAPSTONE_EXIT_TEST": marker})
    end = time.monotonic() + 120
    while len(_workers(marker)) < 2:
        assert p.poll() is None and time.monotonic() < end, _finish(p)
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    text = _finish(p)
    assert p.returncode == 128 + signal.SIGTERM, text
    assert "died" not in text and "Traceback" not in text, text
    assert text.count("stopped by SIGTERM; every rank exits") == 1, text
