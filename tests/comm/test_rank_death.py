"""A rank killed outright is named: kill -9 one rank of a real 2-rank `soapstone run` and the
job's output says which rank died, on which host, and how (comm/launch/supervisor.py); mpiexec
still ends the job. Without a launcher nothing forks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mpirun import ROOT, mpiexec

from soapstone.comm.launch.supervisor import death_line, launched_rank, supervise
from soapstone.comm.observe.peers import Peers


def _workers(marker: str, rank: int) -> list[int]:
    """The pids of the processes of this launch's `rank` that do the work (a supervisor's
    child: its parent is of the same rank)."""
    mine = []
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if f"SOAPSTONE_DEATH_TEST={marker}".encode() in env and \
                f"PMI_RANK={rank}".encode() in env:
            mine.append((int(d.name), int(stat[1])))
    pids = {p for p, _ in mine}
    return [p for p, parent in mine if parent in pids]


def test_kill_9_of_rank_1_is_named(tmp_path):
    m = tmp_path / "m.jsonl"
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "soapstone.dsl.cli", "run",
                          "examples/gpt.par", "--parallel", "dp2", "--steps", "100000",
                          "--quiet", "--metrics", str(m)], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1",
                              "SOAPSTONE_DEATH_TEST": marker})
    try:
        end = time.monotonic() + 180
        while not (m.is_file() and m.read_text().count("\n") >= 2):  # training, both ranks
            assert p.poll() is None and time.monotonic() < end, p.communicate()
            time.sleep(0.2)
        victims = _workers(marker, 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0
    line = (f"soapstone: rank 1 (pid {victims[0]} on {socket.gethostname()}) died: killed by "
            "signal 9 (SIGKILL: kill -9, or the kernel's out-of-memory killer); the launcher "
            "ends the job")
    assert line in out + err, out + err
    assert "Traceback" not in out + err


def test_peers_gone_are_processes_that_ended():
    """The watchdog's look at the ranks on this host (comm/observe/peers.py), on real
    processes: running, ended and reaped, ended and not yet reaped (a zombie). Under hydra a
    dead rank takes the job down before anyone looks (the test above); launchers that leave
    the others waiting (srun's default) meet this path: the rank waiting in a collective
    names the member whose process is gone instead of waiting out the timeout."""
    host = socket.gethostname()
    running = subprocess.Popen(["sleep", "60"])
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    zombie = subprocess.Popen(["true"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    try:
        peers = Peers(((host, os.getpid()), (host, running.pid), (host, reaped.pid),
                       (host, zombie.pid), ("elsewhere", 1)))
        assert peers.gone(range(5)) == [2, 3]  # another host's pid is not this kernel's
        assert peers.name(3) == f"rank 3 (pid {zombie.pid} on {host})"
    finally:
        running.kill()
        running.wait()
        zombie.wait()


def test_no_launcher_no_fork(monkeypatch):
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert launched_rank() is None
    me = os.getpid()
    supervise()  # returns at once, in this very process
    assert os.getpid() == me


def test_death_line_names_the_signal():
    assert death_line(3, 42, "node7", signal.SIGSEGV) == (
        "soapstone: rank 3 (pid 42 on node7) died: killed by signal 11 (SIGSEGV: a crash in "
        "native code); the launcher ends the job")
    assert "(SIGTERM)" in death_line(0, 1, "h", signal.SIGTERM)
