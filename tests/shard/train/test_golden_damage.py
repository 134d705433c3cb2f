"""Damaged and inconsistent golden records: `golden check` reads a record whole before it
trains, and a record it cannot trust is bad input (exit 2, one line naming the file, what is
wrong and `re-record it with soapstone golden record ...`), never a traceback and never a FAIL;
exit 1 stays the verdict on a layout that does not reproduce a sound record
(test_golden.py). Each entry damages a copy of tests/golden/runs/mlp.npz one way."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from cli_calls import cli
from mpirun import run_mpi

ROOT = Path(__file__).resolve().parents[3]
RECORD = ROOT / "tests/golden/runs/mlp.npz"
W = "linear0.weight"  # (32, 64) in examples/mlp.par


def edited(header_edit=None, arrays_edit=None):
    """A damage: the record rewritten (pickle-free) with its header or arrays edited."""
    def apply(path: Path) -> None:
        with np.load(RECORD, allow_pickle=False) as z:
            arrays = dict(z)
        header = json.loads(bytes(arrays["header"]).decode())
        if header_edit:
            header_edit(header)
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        if arrays_edit:
            arrays_edit(arrays)
        np.savez(path, **arrays)
    return apply


def truncated(path: Path) -> None:
    """The file cut in half, as a copy that ran out of disk leaves it."""
    data = RECORD.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def flipped(path: Path) -> None:
    """One byte flipped inside the largest array's data (the zip member's CRC-32 catches it)."""
    data = bytearray(RECORD.read_bytes())
    with zipfile.ZipFile(RECORD) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:
                                                    info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def setitem(key: str, value):
    """An edit setting `key` of a dict to `value`, or to `value(old)` when it is callable."""
    return lambda d: d.__setitem__(key, value(d[key]) if callable(value) else value)


# (name, damage, what the one line must say besides the file and the fix)
DAMAGED = [
    ("truncated", truncated, "a damaged record (cut short: its zip directory is missing)"),
    ("one-byte-flipped", flipped, "a damaged record (BadZipFile: Bad CRC-32"),
    ("digest-cut-short", edited(arrays_edit=setitem(f"digest/{W}", lambda d: d[:, :5])),
     f"digest/{W} has 5 columns, but the model's {W} (2048 elements) has 11"),
    ("final-transposed", edited(arrays_edit=setitem(f"final/{W}", lambda t: t.T.copy())),
     f"final/{W} has shape [64, 32], but the model's {W} is [32, 64]"),
    ("seed-null", edited(setitem("seed", None)), "header seed None: want a whole number"),
    ("lr-negative", edited(setitem("lr", -0.1)), "header lr -0.1: want a positive number"),
    ("lr-nan", edited(setitem("lr", float("nan"))), "header lr nan: want a positive number"),
    ("steps-a-string", edited(setitem("steps", "5")), "header steps '5': want a whole number"),
    ("params-repeated", edited(setitem("params", lambda p: [*p, p[0]])),
     "want a list of distinct parameter names"),
    ("header-a-list", edited(arrays_edit=setitem(
        "header", np.frombuffer(b"[1, 2]", np.uint8))), "its header is not a JSON object"),
    ("loss-nan", edited(arrays_edit=setitem("loss", lambda v: np.where(
        np.arange(len(v)) == 2, np.nan, v))), "loss holds a value that is not finite"),
    ("loss-as-ints", edited(arrays_edit=setitem("loss", lambda v: v.astype(np.int64))),
     "loss holds int64 values, not floating point"),
    ("final-missing", edited(arrays_edit=lambda a: a.pop(f"final/{W}")),
     f"no array final/{W}, which its header's params (and full) ask for"),
    ("stray-array", edited(arrays_edit=setitem("digest/extra.weight", np.zeros((5, 11)))),
     "array digest/extra.weight, which its header's params (and full) do not name"),
]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, dict]:
    """`golden check examples/mlp.par` of every damaged copy, in one process (cli_calls)."""
    d = tmp_path_factory.mktemp("damaged")
    argvs = []
    for name, damage, _ in DAMAGED:
        damage(d / f"{name}.npz")
        argvs.append(["golden", "check", "examples/mlp.par", str(d / f"{name}.npz")])
    return {name: r for (name, _, _), r in zip(DAMAGED, cli(*argvs), strict=True)}


@pytest.mark.parametrize("name,needle", [(n, s) for n, _, s in DAMAGED],
                         ids=[n for n, _, _ in DAMAGED])
def test_a_damaged_record_is_bad_input(checks, name, needle):
    r = checks[name]
    assert r["rc"] == 2, r
    assert "Traceback" not in r["text"] and "FAIL" not in r["text"], r
    assert r["stderr"].count("\n") == 1 and r["stdout"] == "", r
    assert f"{name}.npz: " in r["stderr"] and needle in r["stderr"], r
    assert "re-record it with `soapstone golden record " in r["stderr"], r


def test_the_sound_record_still_checks():
    """The record the damages start from passes (its header and arrays are what the checks
    want), so each failure above is its damage's."""
    (r,) = cli(["golden", "check", "examples/mlp.par", str(RECORD), "--quiet"])
    assert r["rc"] == 0 and "ok: one rank reproduces" in r["stdout"], r


def test_every_rank_refuses_a_damaged_record_and_rank_0_says_so(tmp_path):
    """Under mpiexec the record is checked on every rank before any training: a digest cut
    short, which a tp2 check once met mid-step (`zip() argument 2 is shorter`)."""
    bad = tmp_path / "cut.npz"
    edited(arrays_edit=setitem(f"digest/{W}", lambda d: d[:, :5]))(bad)
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "golden", "check", "examples/mlp.par",
                    str(bad), "--parallel", "tp2"])
    assert r.returncode == 2, r.report()
    text = r.stdout + r.stderr
    assert "Traceback" not in text and text.count(f"digest/{W} has 5 columns") == 1, r.report()


def test_golden_record_under_mpiexec_says_why_once(tmp_path):
    """`golden record` runs on one rank: under mpiexec -n 2 both ranks refuse, one line."""
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "golden", "record", "examples/mlp.par", "-o",
                    str(tmp_path / "r.npz")])
    assert r.returncode == 2, r.report()
    text = r.stdout + r.stderr
    assert text.count("error: golden record runs on one rank; this run has 2") == 1, r.report()
    assert not (tmp_path / "r.npz").exists()
