"""The collective watchdog under real mpiexec: hangs end with a report naming the rank and op.

Each hang job arms a deadline of a few seconds only once its ranks are in step (hang_jobs.py
meets in a raw MPI barrier first; hang_plugin.py arms it where the job is about to hang), so a
slow start on a loaded machine is never mistaken for a hang. Nothing here asserts how fast a
job ended: a job the watchdog failed to end runs into the launch timeout and fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import ROOT, case_params, mpiexec, run_mpi

RECORDER_CASES = "tests/comm/observe/recorder_cases.py"
JOBS = "tests/comm/observe/hang_jobs.py"
PLUGIN = "tests/comm/observe/hang_plugin.py"
SOAPSTONE = "import sys; from soapstone.dsl.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("case,n", case_params(RECORDER_CASES))
def test_recorder_case(comm_runs, case, n):
    comm_runs(n, RECORDER_CASES).check(case)


def ended(res) -> str:
    """The job ended by itself (not by the launch timeout) with a failure; its output."""
    assert not res.timed_out and res.returncode != 0, res.report()
    assert "unreachable" not in res.stdout, res.report()
    return res.stdout + res.stderr


# recorder "0": no entries kept; the watchdog finds the call on the stack, and the rings, which
# number every op recorded or not, give its number
@pytest.mark.parametrize("recorder", ["512", "0"])
def test_a_skipped_collective_is_reported_with_the_op_each_rank_called(recorder):
    res = run_mpi(2, [JOBS, "skip"], timeout=120,
                  env={"SOAPSTONE_COLLECTIVE_TIMEOUT": "3", "SOAPSTONE_FLIGHT_RECORDER": recorder})
    out = ended(res)
    assert "soapstone watchdog: collective timeout: rank " in out, res.report()
    assert ("ranks disagree on collective #2 of world[0,1]: rank 0 called allreduce(4,) "
            "float32; rank 1 called barrier(0,) float32") in out, res.report()


@pytest.mark.parametrize("recorder", ["512", "0"])
def test_allgather_against_allreduce_is_reported(recorder):
    res = run_mpi(2, [JOBS, "mismatch"], timeout=120,
                  env={"SOAPSTONE_COLLECTIVE_TIMEOUT": "3", "SOAPSTONE_FLIGHT_RECORDER": recorder})
    out = ended(res)
    assert "arrived in another op: rank " in out, res.report()
    assert ("ranks disagree on collective #2 of world[0,1]: rank 0 called allgather(4,) "
            "float32; rank 1 called allreduce(4,) float32") in out, res.report()


def _run_hang(mode: str, spec: str, layout: str, debug_dir: Path):
    return run_mpi(2, ["-c", SOAPSTONE, "run", spec, "--parallel", layout, "--plugin", PLUGIN,
                       "--steps", "3", "--collective-timeout", "300", "--debug-dir",
                       str(debug_dir)], timeout=180, env={"SOAPSTONE_TEST_HANG": mode})


def test_a_rank_stuck_in_a_custom_layer_is_named_with_its_stack(tmp_path, capsys):
    res = _run_hang("sleep_layer", "examples/swiglu.par", "tp2", tmp_path)
    out = ended(res)
    assert "run set the timeout to 300s" in out, res.report()  # --collective-timeout arrived
    report = out[out.index("soapstone watchdog: collective timeout: rank 0"):]
    assert " in allreduce #" in report.split("\n")[0] and "on model[0,1]" in report, report
    assert "[rank 0]   did not arrive: rank 1\n" in report, report
    assert "in swiglu" in report and "time.sleep(600)" in report, report  # rank 1's stack
    # where the layout's plan (comm/observe/expected.py, handed down by run) puts each rank
    assert "[rank 0]   where the layout's plan puts each rank (calls of one step):" in report
    at = report[report.index("[rank 0]     rank 0 on model[0,1]: in call "):]
    assert "of the step's 14 collectives, which the plan says is allreduce (8, 16, 32) f32 " \
        "on model[0,1] (forward, stage 0, microbatch 0" in at.split("\n")[0], report
    assert "[rank 0]     rank 1 on model[0,1]: has made " in report, report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json",
                                                          "report.txt"]
    # `soapstone debug hang DIR` reads the dumps (no MPI, no torch needed: in-process)
    from soapstone.dsl.cli import main

    assert main(["debug", "hang", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("2 of 2 ranks dumped")
    assert "first divergence: rank 1 behind on model[0,1]: rank 0 reached allreduce #" in text
    assert "time.sleep(600)" in text
    assert "  plan: rank 1 on model[0,1]: has made " in text and "the plan's next" in text
    # and its reader gone (`| head`): quietly, 128 + SIGPIPE (tests/dsl/test_broken_pipe.py)
    from closed_pipe import closed_stdout, quiet_141

    quiet_141(closed_stdout("debug", "hang", str(tmp_path)))


def test_a_pipeline_stage_that_never_sends_is_found(tmp_path):
    res = _run_hang("never_send", "tests/specs/pipe_layouts.par", "pp2f1b", tmp_path)
    out = ended(res)
    assert "soapstone watchdog: collective timeout: rank " in out, res.report()
    assert ("rank 1 is blocked in irecv from rank 0 (p2p #1) on pipe[0,1]: it waits for "
            "message 1 from rank 0 on pipe[0,1], which has sent 0") in out, res.report()
    # the plan: rank 0's first p2p call should have been its send; it made a receive instead
    assert ("rank 0 on pipe[0,1]: in call 1 of the step's 16 p2p calls, which the plan says "
            "is send to rank 1 (1, 16, 32) f32 on pipe[0,1] (p2p, stage 0, microbatch 0, from "
            "activation") in out and "it left the plan" in out, res.report()


def test_debug_hang_without_dumps_is_bad_input(tmp_path, capsys):
    from soapstone.dsl.cli import main

    assert main(["debug", "hang", str(tmp_path)]) == 2
    assert "no rank<R>.json dumps" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_negative_timeout_is_bad_input(how):
    args = ["-c", SOAPSTONE, "run", "examples/gpt.par", "--steps", "1"]
    env = {}
    if how == "flag":
        args += ["--collective-timeout", "-1"]
    else:
        env["SOAPSTONE_COLLECTIVE_TIMEOUT"] = "-1"
    res = run_mpi(1, args, timeout=120, env=env)
    assert res.returncode == 2, res.report()
    assert "must be a number of seconds >= 0" in res.stderr, res.report()
    assert "Traceback" not in res.stdout + res.stderr, res.report()


def test_sigusr1_dumps_every_rank_and_sigterm_ends_the_run(tmp_path):
    """SIGUSR1 to mpiexec: every rank dumps and goes on; SIGTERM: every rank ends, one line."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [launcher, "-n", "2", sys.executable, "-c", SOAPSTONE, "run", "examples/gpt.par",
           "--parallel", "dp2", "--steps", "1000000", "--debug-dir", str(tmp_path)]
    log = tmp_path / "err.txt"
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                             text=True, start_new_session=True)
    try:
        _until(lambda: "steps" in log.read_text(), p, log)  # training has started
        p.send_signal(signal.SIGUSR1)
        _until(lambda: len(list(tmp_path.glob("rank*.json"))) == 2, p, log)
        assert p.poll() is None, "SIGUSR1 must not end the job"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    text = out + log.read_text()
    assert p.returncode != 0, text
    assert text.count("soapstone run: stopped by SIGTERM; every rank exits") == 1, text
    assert "[rank 0] flight recorder (SIGUSR1)" in text and "[rank 1] flight recorder (SIGUSR1)" \
        in text, text
    assert "Traceback" not in text, text


def _until(ready, proc, log, limit_s: float = 240) -> None:
    """Wait for `ready()` (a launch that dies or never gets there fails the test)."""
    end = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, f"the job ended early:\n{log.read_text()}"
        assert time.monotonic() < end, f"the job never got there:\n{log.read_text()}"
        time.sleep(0.2)
