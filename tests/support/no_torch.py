"""The soapstone CLI in a process where importing torch fails (a login node): `python -c
BLOCKED ARGS...`, for the tests that prove a command needs no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The CLI with an import hook that refuses torch, and proves the hook works first.
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



def run_without_torch(*args: str) -> subprocess.CompletedProcess:
    """`soapstone ARGS...` from the repository root in a process that cannot import torch."""
    return subprocess.run([sys.executable, "-c", BLOCKED, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
