"""What a command writes is checked before a byte is written (dsl/app/outputs.py): an
output that names one of the command's inputs, a directory, or a place that cannot be written
is bad input (exit 2, one line naming the flag and the path), never a traceback, and the input
is left as it was. What cannot be told before is turned into the same error when it is met."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_calls import cli

ROOT = Path(__file__).resolve().parents[2]
# /sys and /proc refuse new files even to root, whom chmod does not stop
LINUX = pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux /sys, /proc")
PIPE = """
parallel pp2 for gpt on mesh(pipe = 2) {
  operator  layer[0..1] -> pipe 0, layer[2..3] -> pipe 1
  schedule  1f1b, microbatches = 4
}
"""


def _copies(tmp_path: Path) -> dict[str, Path]:
    """Copies of the example specs, a spec including one of them, a pipeline layout of gpt, a
    token file, a text file and metrics files, in tmp_path."""
    files = {"m": tmp_path / "m.par", "g": tmp_path / "g.par", "inc": tmp_path / "inc.par",
             "tok": tmp_path / "tok.bin", "text": tmp_path / "notes.txt",
             "metrics": tmp_path / "m.jsonl", "pp": tmp_path / "pp.par",
             "shown": tmp_path / "metrics.png"}
    shutil.copy(ROOT / "examples/mlp.par", files["m"])
    shutil.copy(ROOT / "examples/gpt.par", files["g"])
    files["inc"].write_text('include "m.par"\n')
    files["tok"].write_bytes(bytes(range(64)) * 8)
    files["text"].write_text("hello world\n")
    files["metrics"].write_text("".join(json.dumps({"step": i, "loss": 2 - i / 10,
                                                    "tokens_per_s": 100.0}) + "\n"
                                        for i in range(5)))
    shutil.copy(files["metrics"], files["shown"])  # a metrics file under an image's name
    files["pp"].write_text((ROOT / "examples/gpt.par").read_text() + PIPE)
    return files


def test_an_output_naming_an_input_is_refused_and_the_input_kept(tmp_path):
    f = {k: str(v) for k, v in _copies(tmp_path).items()}
    before = {k: Path(v).read_bytes() for k, v in f.items()}
    cases = [  # (argv, what the one line says)
        (["plan", f["g"], "--world", "4", "--profile", "h200", "-o", f["g"]],
         f"-o {f['g']}: the same file as the spec {f['g']}"),
        (["golden", "record", f["m"], "-o", f["m"]], f"-o {f['m']}: the same file as the spec"),
        (["tokenize", f["tok"], "-o", f["tok"]], f"-o {f['tok']}: the same file as the text"),
        (["run", f["g"], "--data", f["tok"], "--metrics", f["tok"], "--steps", "2"],
         f"--metrics {f['tok']}: the same file as --data"),
        (["run", f["m"], "--metrics", f["m"], "--steps", "2"],
         f"--metrics {f['m']}: the same file as the spec"),
        (["run", f["inc"], "--metrics", f["m"], "--steps", "2"],
         f"--metrics {f['m']}: the same file as the spec's include"),
        (["plot", f["shown"], "-o", f["shown"]], f"-o {f['shown']}: the same file as the metrics"),
    ]
    for (_, needle), r in zip(cases, cli(*(argv for argv, _ in cases)), strict=True):
        assert r["rc"] == 2 and needle in r["stderr"], r
        assert "Traceback" not in r["text"] and len(r["stderr"].splitlines()) == 1, r
    assert {k: Path(v).read_bytes() for k, v in f.items()} == before


@LINUX
def test_outputs_that_cannot_be_written_exit_2_naming_the_path(tmp_path):
    f = {k: str(v) for k, v in _copies(tmp_path).items()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": "x", "loss": "y"}\n')
    plan = ["plan", f["g"], "--world", "4", "--profile", "h200"]
    cases = [
        (["run", f["m"], "--metrics", "/sys/m.jsonl", "--steps", "2"],
         "--metrics /sys/m.jsonl: cannot write it"),
        (["run", f["m"], "--metrics", "/proc/nope.jsonl", "--steps", "2"],
         "--metrics /proc/nope.jsonl: cannot write it"),
        (["run", f["m"], "--tensorboard", "/sys/tb", "--steps", "2"],
         "--tensorboard /sys/tb: "),
        (["golden", "record", f["m"], "-o", str(tmp_path)], f"-o {tmp_path}: is a directory"),
        (["golden", "record", f["m"], "-o", "/sys/g.npz"], "-o /sys/g.npz: cannot write it"),
        (["golden", "record", f["m"], "-o", "/dev/full", "--steps", "1"],  # at the write
         "-o /dev/full: cannot write it (No space left on device)"),
        ([*plan, "-o", str(tmp_path)], f"-o {tmp_path}: is a directory"),
        ([*plan, "-o", "/sys/p.par"], "-o /sys/p.par: cannot write it"),
        ([*plan, "-o", "/proc/version"], "-o /proc/version: cannot write it"),
        (["tokenize", f["text"], "-o", "/sys/x.bin"], "-o /sys/x.bin: cannot write it"),
        (["plot", f["metrics"], "-o", "/sys/x.png"], "-o /sys/x.png: cannot write it"),
        (["plot", f["metrics"], "-o", str(tmp_path / "p.txt")],
         "matplotlib cannot write .txt images; give one of"),
        (["plot", str(bad), "-o", str(tmp_path / "p.png")],
         "bad.jsonl:1: step \"x\" is not a step number"),
        (["plot", f["metrics"], "-o", str(tmp_path)], f"-o {tmp_path}: is a directory"),
        # a name too long for the filesystem: its stat fails (ENAMETOOLONG), not only its open
        ([*plan, "-o", str(tmp_path / ("a" * 300 + ".par"))], "cannot write it (File name too"),
        (["tokenize", f["text"], "-o", str(tmp_path / ("a" * 300))], "cannot write it (File"),
    ]
    for (_, needle), r in zip(cases, cli(*(argv for argv, _ in cases)), strict=True):
        assert r["rc"] == 2 and needle in r["stderr"], r
        assert "Traceback" not in r["text"], r
    assert not (tmp_path / "p.png").exists() and not Path(f"{tmp_path}.png").exists()


def test_a_metrics_file_that_fills_up_mid_run_is_exit_2_naming_it():
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    (r,) = cli(["run", "examples/mlp.par", "--metrics", "/dev/full", "--steps", "2", "--quiet"])
    assert r["rc"] == 2, r
    assert "--metrics /dev/full: cannot write it (No space left on device)" in r["stderr"], r


def test_plot_prints_the_path_it_wrote(tmp_path):
    f = _copies(tmp_path)
    (r,) = cli(["plot", str(f["metrics"]), "-o", str(tmp_path / "noext")])
    assert r["rc"] == 0, r
    assert r["stdout"] == f"plot: {tmp_path / 'noext.png'}\n"
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "noext").exists()


def test_tokenize_refuses_texts_that_give_no_token(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    (r,) = cli(["tokenize", str(empty), "-o", str(tmp_path / "e.bin")])
    assert r["rc"] == 2 and "empty; a file of 0 tokens cannot train" in r["stderr"], r
    assert "train on it" not in r["text"] and not (tmp_path / "e.bin").exists()


@LINUX
@pytest.mark.parametrize("flags,needles", [
    # the JSON (a non-root user) or its image (root) cannot be written
    (["--trace", "/proc/version"], ["error: --trace", "/proc/version", ": cannot write it"]),
    (["--metrics", "{t}", "--trace", "{t}"], ["error: --trace {t}: the same file as --metrics"]),
    # the trace's image goes beside it as .png: a .png trace would be overwritten by it
    (["--trace", "{t}.png"], ["error: --trace {t}.png: the trace is chrome://tracing JSON"]),
])
def test_under_mpiexec_every_rank_stops_at_once_with_rank_0s_message(tmp_path, flags, needles):
    from mpirun import run_mpi

    t = str(tmp_path / "t.json")
    r = run_mpi(2, ["-m", "soapstone.dsl.cli", "run", str(_copies(tmp_path)["pp"]),
                    "--parallel", "pp2", "--steps", "2", *(x.format(t=t) for x in flags)],
                timeout=120)
    assert r.returncode == 2 and not r.timed_out, r.report()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.report()  # rank 0's, once
    assert all(n.format(t=t) in errors[0] for n in needles), r.report()
    assert "Traceback" not in r.stdout + r.stderr, r.report()
