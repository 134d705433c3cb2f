"""`soapstone bench comm` runs under mpiexec and writes well-formed rows (no timing asserts)."""

from __future__ import annotations

import json

from mpirun import run_mpi

RUN = "import sys; from soapstone.dsl.cli import main; sys.exit(main(sys.argv[1:]))"


def test_bench_comm_smoke(tmp_path):
    out = tmp_path / "bench.json"
    res = run_mpi(2, ["-c", RUN, "bench", "comm", "--sizes", "8,4KiB", "--ops",
                      "allreduce,allgather,alltoall", "--iters", "3", "--json", str(out)],
                  timeout=120, check=True)
    assert "soap/mpi" in res.stdout and "allgather" in res.stdout
    rows = json.loads(out.read_text())
    assert {r["impl"] for r in rows} == {"soapstone", "mpi4py", "gloo"}
    assert {(r["op"], r["bytes"]) for r in rows} == {
        (op, b) for op in ("allreduce", "allgather", "alltoall") for b in (8, 4096)}
    for r in rows:
        assert set(r) == {"op", "bytes", "impl", "time_us", "algbw_GBps", "busbw_GBps"}
        assert r["time_us"] > 0 and r["busbw_GBps"] >= 0


def test_bench_comm_rejects_bad_flags():
    res = run_mpi(1, ["-c", RUN, "bench", "comm", "--ops", "allsum"], timeout=60)
    assert res.returncode == 2 and "unknown op" in res.stderr, res.report()


def test_bench_comm_json_into_a_missing_folder_is_a_usage_error():
    res = run_mpi(1, ["-c", RUN, "bench", "comm", "--json", "/nonexistent/x.json"], timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "/nonexistent" in res.stderr, res.report()
    assert "does not exist" in res.stderr and "Traceback" not in out, res.report()


def test_bench_comm_watchdog_times_an_unrecorded_twin_and_says_how_shapes_are_read():
    """--watchdog: the same communicator with its entries not kept, timed beside soapstone,
    and the ratio per size (the figures themselves are BENCHMARKS.md's)."""
    res = run_mpi(2, ["-c", RUN, "bench", "comm", "--watchdog", "--sizes", "8,4KiB", "--ops",
                      "allreduce", "--iters", "20"], timeout=120, check=True)
    out = res.stdout
    assert "rec/none" in out and "no-recorder us" in out, res.report()
    assert "#   allreduce 8 B: " in out and "#   allreduce 4.0 KiB: " in out, res.report()
    assert "# the recorder reads shapes through torch's C++ tensor" in out, res.report()
