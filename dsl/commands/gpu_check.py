"""`soapstone gpu-check [--report FILE] [--root DIR]`: the CUDA path checked on one GPU, in
about eight minutes, with a JSON report (what it runs: dsl/app/gpu_check.py). Without a CUDA
GPU: exit 2 and one line. `make gpu-check` installs soapstone from `make gpu-wheels`' folder
first (README, "On a GPU").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.commands import fail
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """--report, --root, --steps, --skip-tests."""
    parser.add_argument("--report", default="gpu-check.json", metavar="FILE",
                        help="where the JSON report goes (default gpu-check.json)")
    parser.add_argument("--root", default=".", metavar="DIR",
                        help="the soapstone checkout whose tests and examples run (default .)")
    parser.add_argument("--steps", type=int, default=30, metavar="N",
                        help="timed steps of each side of the step-time comparison (default "
                             "and least 30)")
    parser.add_argument("--skip-tests", action="store_true",
                        help="leave out the pytest run of the CUDA tests")


def main(args: argparse.Namespace) -> int:
    """Exit 2 without a GPU; else every check, the report, 0 or 1."""
    from soapstone.comm.bench.harness import MIN_STEPS
    from soapstone.dsl.app.gpu_check import cuda_missing, gpu_check

    try:
        if args.steps < MIN_STEPS:
            raise BadInput(f"--steps {args.steps}: give at least {MIN_STEPS}")
        if not Path(args.report).resolve().parent.is_dir():
            raise BadInput(f"--report {args.report}: the directory does not exist")
        missing = cuda_missing()
        if missing is not None:
            print(missing, file=sys.stderr)
            return 2
        return gpu_check(Path(args.root), Path(args.report), args.steps, args.skip_tests,
                         say=lambda text: print(text, flush=True))
    except UserError as e:
        return fail(e)
