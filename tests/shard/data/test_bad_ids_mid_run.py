"""An id out of the vocab that a run meets mid-run is bad input like any other: a token file
over token_memmap.SCAN_BYTES (256 MiB) is checked as its windows are read, so a bad id ends
the job during training, on whichever rank reads it, while the others may be waiting for it
in a collective. The job still ends promptly with exit 2 and the one line naming the file,
the offset and the fix, printed once (by rank 0), never a traceback and never a hang
(comm/launch/failure.py: end_on_bad_input). Here SCAN_BYTES is 0 so that a small file is
checked the lazy way; a 2-rank job where one rank alone raises covers the rank that waits."""

from __future__ import annotations

import numpy as np
import pytest
from mpirun import run_mpi

# the CLI with every token file checked as its windows are read, as one over 256 MiB is
LAZY = ("import sys; import soapstone.shard.data.token_memmap as t; t.SCAN_BYTES = 0; "
        "from soapstone.dsl.cli import main; sys.exit(main(sys.argv[1:]))")
LINE = "error: {f}: token id 300 at token offset "


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory):
    """4000 uint16 ids: below examples/gpt.par's vocab of 64 in the first half, 300 after."""
    ids = np.full(4000, 5, dtype="<u2")
    ids[2000:] = 300
    path = tmp_path_factory.mktemp("data") / "bad.bin"
    ids.tofile(path)
    return path


def ended_with_one_line(res, needle: str) -> None:
    """Exit 2 by itself (not the launch's timeout), `needle` once, no traceback or dumps."""
    text = res.stdout + res.stderr
    assert not res.timed_out and res.returncode == 2, res.report()
    assert text.count(needle) == 1, res.report()
    assert "Traceback" not in text and "[rank " not in text and "Abort(" not in text, \
        res.report()


@pytest.mark.parametrize("n,layout", [(1, []), (2, ["--parallel", "dp2"])], ids=["1", "dp2"])
def test_a_bad_id_read_mid_run_is_one_line_and_exit_2(bad_file, n, layout):
    res = run_mpi(n, ["-c", LAZY, "run", "examples/gpt.par", "--data", str(bad_file),
                      "--steps", "5", "--quiet", *layout], timeout=120)
    ended_with_one_line(res, LINE.format(f=bad_file))
    assert "raise it (e.g. --dim vocab=512) or check --data-dtype" in res.stderr, res.report()
    assert "done:" not in res.stdout, res.report()


ONE_RANK = """
import sys, time
import torch
from soapstone.comm import init
from soapstone.shard.data.errors import DataError
w = init("mpi")
if w.rank == int(sys.argv[1]):
    time.sleep(0.5)  # the other rank is waiting in the allreduce by now
    raise DataError("big.bin: token id 300 at token offset 7 does not fit the vocab of 64")
w.allreduce(torch.ones(4))
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("who", [1, 0])
def test_the_rank_that_meets_it_ends_the_job_and_rank_0_says_it_once(who):
    """Only rank `who` meets the bad id; the other waits in a collective and does not hang.
    Rank 0 says it: a rank whose notice rank 0 never acts on prints it itself, prefixed with
    its `[rank R]`, which ended_with_one_line refuses."""
    res = run_mpi(2, ["-c", ONE_RANK, str(who)], timeout=60)
    ended_with_one_line(res, "error: big.bin: token id 300 at token offset 7")
    assert "unreachable" not in res.stdout, res.report()
