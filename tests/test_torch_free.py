"""The language, the compiler and the plan need no torch: `check`, `show` and `explain` run in a
process where importing torch fails (a machine that cannot load it, or a login node)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs the CLI with an import hook that refuses torch, and proves the hook works first.
BLOCKED = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable in this test")
sys.meta_path.insert(0, NoTorch())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    sys.exit("the torch blocker did not block")
import soapstone.dsl, soapstone.shard.plan  # noqa: E401
from soapstone.shard.parallel import bucket_plan as buckets  # noqa: F401
from soapstone.shard.plan.analysis import explain
from soapstone.shard.plan import layout, program, program_text
from soapstone.shard.plan import schedules, stage_graph  # noqa: F401
from soapstone.shard.plan.verify import prove as verify, sequence
from soapstone.shard.ops import registry  # every primitive's record, kernels unrun
from soapstone.dsl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.parametrize("args", [
    ("check", "examples/gpt.par"),
    ("check", "examples/gpt.par", "--verify"),
    ("show", "examples/gpt.par", "--parallel", "dp2tp2"),
    ("show", "examples/gpt.par", "--parallel", "gpt8", "--json"),
    ("explain", "examples/gpt.par", "--parallel", "dp2tp2"),
    ("explain", "examples/gpt.par", "--parallel", "gpt8", "--json"),
])
def test_command_runs_without_torch(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "torch" not in r.stderr


def test_a_bad_spec_is_still_exit_2_without_torch():
    r = _run("show", "examples/gpt.par", "--parallel", "nosuchlayout")
    assert r.returncode == 2
    assert "nosuchlayout" in r.stderr and "Traceback" not in r.stderr
