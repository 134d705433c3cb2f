"""Token files checked when opened (shard/data/token_memmap.py): a negative id in a small
signed file is found before training (the dtype's max being below the vocab skips no scan
of a signed file), with a hint that fits a negative id; --data-dtype is refused where no
file it names is raw .bin ids, instead of being ignored."""

from __future__ import annotations

import numpy as np
import pytest
from mpirun import run_mpi

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.errors import DataError
from soapstone.shard.data.source import make_task

PROGRAM = lower_graph(dsl.load("examples/gpt.par", dims={"vocab": 256}).model(), None).program


def test_a_negative_id_in_a_small_int8_file_is_refused_when_opened(tmp_path):
    """int8's max (127) is below the vocab (256): only the scan at opening finds the -3."""
    path = tmp_path / "neg.npy"
    np.save(path, np.array([1, 2, -3] * 400, dtype=np.int8))
    with pytest.raises(DataError) as e:
        make_task(PROGRAM, 0, str(path))
    msg = str(e.value)
    assert f"{path}: token id -3 at token offset 2 is negative" in msg, msg
    assert "raise it" not in msg and "--dim vocab" not in msg, msg


def test_an_id_above_the_vocab_still_says_raise_it(tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, np.array([1, 2, 300] * 400, dtype=np.int16))
    with pytest.raises(DataError, match=r"token id 300 .* raise it \(e\.g\. --dim vocab=512\)"):
        make_task(PROGRAM, 0, str(path))


def test_data_dtype_is_refused_without_a_bin_file(tmp_path):
    text, ids = tmp_path / "a.txt", tmp_path / "a.npy"
    text.write_bytes(b"hello world " * 200)
    np.save(ids, np.arange(2000) % 256)
    for data in (str(text), str(ids), None):
        with pytest.raises(DataError, match=r"--data-dtype uint32: it applies to raw \.bin "):
            make_task(PROGRAM, 0, data, data_dtype="uint32")
    raw = tmp_path / "a.bin"
    (np.arange(2000) % 256).astype("<u4").tofile(raw)
    # a .bin with a held-out .npy: the dtype is read for the .bin, so it is taken
    assert make_task(PROGRAM, 0, str(raw), str(ids), data_dtype="uint32").vocab == 256


def test_data_dtype_on_a_text_file_is_exit_2_before_training(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"hello world " * 200)
    r = run_mpi(1, ["-m", "soapstone.dsl.cli", "run", "examples/gpt.par", "--dim", "vocab=256",
                    "--data", str(text), "--data-dtype", "uint32", "--steps", "2", "--quiet"])
    assert r.returncode == 2 and "applies to raw .bin token files only" in r.stderr, r.report()
    assert "done:" not in r.stdout and "Traceback" not in r.stderr, r.report()
