"""soapstone.dsl.commands: one module per `soapstone` subcommand (dsl/cli.py dispatches).

Each module has `configure(parser)` and `main(args) -> int`; it parses flags, calls library
code (dsl/app/build.py, dsl/app/golden_run.py, dsl/app/show_text.py, ...), prints and returns the
exit code: 0 ok, 2 bad input, 1 anything else, 3 a run stopped on a non-finite step. Bad input
is any UserError; `fail` prints it once.
"""

from __future__ import annotations

import sys

from soapstone.comm.errors import UserError


def fail(error: UserError, rank: int = 0) -> int:
    """Print a bad-input error (no traceback) and return exit code 2.

    Under mpiexec every rank reaches the same verdict, so only rank 0 prints and every rank
    returns 2 together."""
    if rank == 0:
        print(error.format(), file=sys.stderr, flush=True)
    return 2
