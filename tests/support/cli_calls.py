"""Commands of the soapstone CLI run in one fresh process, one after another (one torch
import for all): `cli(argv, argv, ...)` gives each one's exit code and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import contextlib, io, json, sys
from soapstone.dsl.cli import main

out = []
for argv in json.loads(sys.argv[1]):
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        rc = main(argv)
    out.append({"argv": argv, "rc": rc, "text": std.getvalue() + err.getvalue(),
                "stdout": std.getvalue(), "stderr": err.getvalue()})
print(json.dumps(out))
"""


def cli(*argvs: list[str]) -> list[dict]:
    """Run each argv through `soapstone` in one process from the repository root: [{argv, rc,
    text (stdout + stderr), stdout, stderr}]; the process itself must not fail."""
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argvs)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])
