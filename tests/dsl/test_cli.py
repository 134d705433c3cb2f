"""The command line's shape: cli.py only dispatches to soapstone.dsl.commands, and every bad
input, whichever layer finds it, is a UserError that the commands turn into exit 2 without a
traceback."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from cli_calls import cli

from soapstone.comm.errors import UserError
from soapstone.dsl.cli import COMMANDS
from soapstone.dsl.commands import fail

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_is_a_module_of_dsl_commands(name):
    path = COMMANDS[name][0]
    # a module named for the command (gpu-check: gpu_check), in dsl/commands or a sub-room of it
    assert path.startswith("soapstone.dsl.commands.") and \
        path.rsplit(".", 1)[1] == name.replace("-", "_"), path
    module = importlib.import_module(path)
    assert callable(module.configure) and callable(module.main)


def test_cli_imports_no_command_until_one_is_chosen():
    code = ("import sys, soapstone.dsl.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('soapstone.dsl.commands.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.parametrize("where", [
    "soapstone.dsl.lang.errors:SpecError", "soapstone.dsl.compile.lower:LoweringError",
    "soapstone.dsl.lang.errors:BadInput", "soapstone.shard.data.errors:DataError",
    "soapstone.shard.train.golden:GoldenError",
    "soapstone.shard.runtime.sharded_model:ShapeMismatch",
    "soapstone.comm:CommError",
])
def test_bad_input_classes_are_user_errors(where):
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, UserError)


def test_comm_exports_user_error_lazily():
    code = ("import sys, soapstone.comm as c; assert 'torch' not in sys.modules; "
            "from soapstone.comm import UserError; "
            "from soapstone.comm.errors import UserError as U; assert UserError is U; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, check=True)


def test_fail_prints_the_error_once_on_rank_0(capsys):
    assert fail(UserError("--steps 0: give at least 1")) == 2
    assert capsys.readouterr().err == "error: --steps 0: give at least 1\n"
    assert fail(UserError("the same verdict on every rank"), rank=1) == 2
    assert capsys.readouterr().err == ""


# (layer that finds it, argv, what stderr must say); one process for all, no mpiexec needed
USER_ERRORS = [
    ("spec (dsl SpecError)", ["check", "tests/bad_specs/dim_zero_size.par"],
     "dim_zero_size.par:7:7: error: "),
    ("flag (dsl BadInput)", ["golden", "record", "examples/mlp.par", "-o", "/no/such/r.npz"],
     "-o /no/such/r.npz: the directory does not exist"),
    ("data file (shard DataError)", ["run", "examples/gpt.par", "--data", "no/such.bin"],
     "--data no/such.bin: no such file"),
    ("record file (shard GoldenError)", ["golden", "check", "examples/mlp.par", "README.md"],
     "not a soapstone golden record"),
]


@pytest.fixture(scope="module")
def user_errors() -> dict[str, dict]:
    """Each USER_ERRORS command's outcome by its layer (cli_calls.py: one torch import)."""
    return {layer: r for (layer, _, _), r in
            zip(USER_ERRORS, cli(*(argv for _, argv, _ in USER_ERRORS)), strict=True)}


@pytest.mark.parametrize("layer,argv,needle", USER_ERRORS)
def test_each_layer_user_error_exits_2_without_traceback(user_errors, layer, argv, needle):
    r = user_errors[layer]
    assert r["argv"] == argv and r["rc"] == 2, (layer, r)
    assert needle in r["stderr"], (layer, r["stderr"])
    assert "Traceback" not in r["text"], (layer, r["text"])


def test_progress_bar_on_a_pipe_prints_a_line_every_tenth_of_the_run():
    import io

    from soapstone.dsl.commands.run import progress_bar

    out = io.StringIO()  # not a terminal
    bar = progress_bar(100, stream=out)  # tqdm, one line per redraw
    for _ in range(100):
        bar.set_postfix_str("loss 1.0000", refresh=False)
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue(), lines
    assert lines[0].startswith("10%|") and " 10/100 [" in lines[0], lines
    assert lines[-1].startswith("100%|") and " 100/100 [" in lines[-1] and "loss 1.0000" in \
        lines[-1], lines
