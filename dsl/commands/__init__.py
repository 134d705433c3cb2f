"""soapstone.dsl.commands: one module per `soapstone` subcommand (dsl/cli.py dispatches).

Each module has `configure(parser)` and `main(args) -> int`; it parses flags, calls library
code (dsl/app/build.py, dsl/app/golden_run.py, dsl/app/show_text.py, ...), prints and returns the
exit code: 0 ok, 2 bad input, 1 anything else, 3 a run stopped on a non-finite step. Bad input
is any UserError; `fail` prints it once. preflight/ holds the torch-free ones run before a
launch (check, show, explain, plan).
"""

from __future__ import annotations

import sys

from soapstone.comm import moved
from soapstone.comm.errors import UserError

# the commands that moved into preflight/ keep their old paths for a release (DeprecationWarning)
__getattr__ = moved.keep_old_paths(__name__, {
    "check": "preflight.check",
    "explain": "preflight.explain",
    "plan": "preflight.plan",
    "show": "preflight.show",
})


def fail(error: UserError, rank: int = 0) -> int:
    """Print a bad-input error (no traceback) and return exit code 2.

    Under mpiexec every rank reaches the same verdict, so only rank 0 prints and every rank
    returns 2 together."""
    if rank == 0:
        print(error.format(), file=sys.stderr, flush=True)
    return 2
