"""Failure behaviour under real mpiexec: one rank's exception ends the whole job (a hang would
run into the launch's timeout) with that rank's message."""

from __future__ import annotations

from mpirun import run_mpi

SCRIPT = "tests/comm/comm_abort.py"


def test_exception_on_one_rank_aborts_the_job():
    res = run_mpi(4, [SCRIPT, "raise"], timeout=60)
    assert not res.timed_out and res.returncode != 0, res.report()
    out = res.stdout + res.stderr
    assert "[rank 2] RuntimeError: boom from rank 2" in out, res.report()
    assert out.count("[rank 2] RuntimeError: boom from rank 2") == 1, "traceback printed once"
    assert "[rank 2] Traceback" in out and "unreachable" not in out
    # the first failure, summarised once by rank 0; every other rank dumped its recorder
    summary = "[rank 0] soapstone: rank 2 failed: RuntimeError: boom from rank 2; aborting"
    assert out.count(summary) == 1, res.report()
    for r in (0, 1, 3):
        assert f"[rank {r}] flight recorder (failure on rank 2): blocked in allreduce #1" in out


def test_debug_collectives_end_a_mismatched_job_with_the_message():
    res = run_mpi(2, [SCRIPT, "mismatch"], timeout=60,
                  env={"SOAPSTONE_DEBUG_COLLECTIVES": "1"})
    assert not res.timed_out and res.returncode != 0, res.report()
    out = res.stdout + res.stderr
    assert "CommError: debug collectives" in out, res.report()
    assert "rank 0 passed allreduce(shape=(4,)" in out, res.report()
    assert "rank 1 passed allreduce(shape=(3,)" in out, res.report()
