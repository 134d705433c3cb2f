"""A token file truncated while a run reads it (shard/data/token_reader.py) is bad input like
any other: the next batch is a DataError naming the file and its size now and when the run
opened it, and the job ends with exit 2 and that one line. Read through a memory map it was
SIGBUS (exit 135) as soon as a window touched a page past the new end.

Both tests truncate for real, with os.truncate, between two reads; the reader's test runs in a
child process so that a crash signal is a failed assertion, not the end of pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mpirun import ROOT, mpiexec

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.token_memmap import TokenMemmap

# 40,000 ids below examples/gpt.par's vocab of 64
IDS = (np.arange(40_000) * 7 % 64).astype("<u2")
NOW = "the file is {now:,} bytes now, {then:,} when the run opened it: it was truncated"

READER = """
import os, sys
from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.errors import DataError
from soapstone.shard.data.token_memmap import TokenMemmap
path, keep = sys.argv[1], int(sys.argv[2])
program = lower_graph(dsl.load("examples/gpt.par").model(), None).program
task = TokenMemmap(program, path, seed=0)
task.batch(0), task.eval_batch(0)
os.truncate(path, keep)
for j in range(1, 200):
    try:
        task.batch(j) if j % 2 else task.eval_batch(j)
    except DataError as e:
        print(e.format(), flush=True)
        sys.exit(2)
print("no error", flush=True)
"""


def test_the_reader_says_the_file_shrank_instead_of_dying(tmp_path):
    """Truncated to 1 KiB after a training and a held-out batch: the next read is a DataError,
    the process alive to say so."""
    path = tmp_path / "tokens.bin"
    IDS.tofile(path)
    p = subprocess.run([sys.executable, "-c", READER, str(path), "1024"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"--data {path}: " + NOW.format(now=1024, then=IDS.nbytes) in p.stdout, p.stdout
    assert "Traceback" not in p.stderr, p.stderr


def test_windows_are_read_past_a_npy_header_in_its_byte_order(tmp_path):
    """Read by offset, a .npy's windows start after its header, in the dtype it declares."""
    path = tmp_path / "big_endian.npy"
    np.save(path, (np.arange(5000) % 64).astype(">i4"))
    task = TokenMemmap(lower_graph(dsl.load("examples/gpt.par").model(), None).program, path)
    for b in (task.batch(0), task.eval_batch(0)):
        rows = b["tokens"].numpy()
        assert np.array_equal(rows, (rows[:, :1] + np.arange(16)) % 64), rows
        assert np.array_equal(b["targets"].numpy(), (rows + 1) % 64)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, limit_s: float) -> None:
    """Until `path` has n lines (rank 0 writes one a step), or the job has ended."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {path} (job exit {proc.poll()})")


def test_a_two_rank_run_ends_with_exit_2_when_its_file_is_truncated(tmp_path):
    """A dp2 run of 100,000 steps, its --data file truncated after a few: exit 2 and the one
    line naming the file, printed once, instead of a rank dying of SIGBUS."""
    data, metrics = tmp_path / "tokens.bin", tmp_path / "metrics.jsonl"
    IDS.tofile(data)
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "soapstone.dsl.cli", "run",
           "examples/gpt.par", "--parallel", "dp2", "--data", str(data), "--steps", "100000",
           "--quiet", "--metrics", str(metrics)]
    # own session, so that a job that does not end is killed with every rank it started
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_lines(metrics, 3, proc, 120)
        os.truncate(data, 1000)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = out + err
    assert proc.returncode == 2, (proc.returncode, text)
    line = f"error: --data {data}: " + NOW.format(now=1000, then=IDS.nbytes)
    assert text.count(line) == 1, text
    assert "SIGBUS" not in text and "Traceback" not in text and "[rank " not in text, text
    assert "done:" not in out, text
