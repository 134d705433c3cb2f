"""`soapstone run --save` under mpiexec and SIGTERM during an evaluation: the evaluation stops
early (every rank at the same batch), the run saves its checkpoint and exits 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpirun import mpiexec

ROOT = Path(__file__).resolve().parents[3]


def test_sigterm_during_evaluation_stops_it_then_saves(tmp_path):
    """An evaluation far longer than the test's bound (a million held-out batches after step
    2): SIGTERM while it runs stops it, there is no eval loss, step 2 is saved."""
    from soapstone.shard.checkpoint import find, read

    d, m = tmp_path / "ck", tmp_path / "m.jsonl"
    argv = ["run", "examples/gpt.par", "--parallel", "tp2", "--quiet", "--dim", "vocab=256",
            "--data", "README.md", "--val-data", "examples/gpt.par", "--eval-every", "2",
            "--eval-steps", "1000000", "--steps", "1000", "--save", str(d), "--metrics", str(m)]
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "soapstone.dsl.cli",
                             *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    end = time.monotonic() + 120
    while not (m.is_file() and m.read_text().strip()):  # step 1 is logged: training runs
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"no step logged (exit {proc.returncode})\n{out}\n{err}")
        time.sleep(0.1)
    # step 0 is logged before its stop check: a signal that early stops at step 1 with no
    # evaluation. Step 1 takes milliseconds and the evaluation then runs for hours, so a
    # while after the log the signal lands inside it even on a loaded machine
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    try:  # a run that finishes the evaluation first would take hours
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the evaluation did not stop on SIGTERM\n{out}\n{err}") from None
    text = out + err
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "step 2: evaluation stopped by SIGTERM after" in text, text
    assert "eval loss" not in text and "Traceback" not in text, text
    assert "checkpoint: saved step 2" in err and "(stopping: SIGTERM)" in err, text
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all("eval_loss" not in r for r in rows), rows
    assert read(find(d)[0][0]).step == 2
