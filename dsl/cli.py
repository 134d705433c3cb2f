"""The `soapstone` command: one entry point that only dispatches to a subcommand.

Each subcommand is a module of soapstone.dsl.commands with `configure(parser)` and
`main(args) -> int`. Only the chosen module is imported, so `soapstone check` never pays for
torch. Exit codes: 0 ok, 2 bad input (any UserError: spec, flags, files, launch), 1 anything
else, 3 a run stopped on a non-finite step (shard/train/nonfinite.py); 141 (128 + SIGPIPE,
what a Unix tool killed by SIGPIPE reports) when stdout is closed before the output ends
(`soapstone show ... | head -1`), quietly, as Unix tools do.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import signal
import sys

# name -> (module, one-line help); every module is in soapstone.dsl.commands
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("soapstone.dsl.commands.bench", "benchmark soapstone against its peers"),
    "check": ("soapstone.dsl.commands.preflight.check", "parse and validate .par specs (no torch)"),
    "show": ("soapstone.dsl.commands.preflight.show", "print the checked IR of a spec"),
    "run": ("soapstone.dsl.commands.run",
            "train a spec's model (under mpiexec for a layout)"),
    "golden": ("soapstone.dsl.commands.golden",
               "record a single-rank run; check that a layout reproduces it"),
    "explain": ("soapstone.dsl.commands.preflight.explain",
                "per-rank memory, communication and bubble estimates before launch"),
    "debug": ("soapstone.dsl.commands.debug",
              "debug hang DIR: who diverged, from every rank's flight-recorder dump"),
    "generate": ("soapstone.dsl.commands.generate",
                 "sample text from a trained language model (--init CKPT_OR_FILE)"),
    "plot": ("soapstone.dsl.commands.plot",
             "draw loss, eval loss and tokens/s from run --metrics files (matplotlib)"),
    "tokenize": ("soapstone.dsl.commands.tokenize",
                 "text files to a token file for run --data (bytes or a tokenizer.json)"),
    "ckpt": ("soapstone.dsl.commands.ckpt",
             "inspect DIR | export DIR -o FILE: what a checkpoint holds; its full parameters"),
    "export": ("soapstone.dsl.commands.export",
               "write a GPT-2 / LLaMA model's weights as a Hugging Face directory (--hf DIR)"),
    "plan": ("soapstone.dsl.commands.preflight.plan",
             "choose a layout for N devices of a hardware profile (no torch)"),
    "gpu-check": ("soapstone.dsl.commands.gpu_check",
                  "check the CUDA path on one GPU, with a JSON report (exit 2 without a GPU)"),
}


# the commands launched under mpiexec: each rank runs under a supervisor (comm/launch/supervisor.py)
SUPERVISED = ("run", "golden", "generate")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return its exit code."""
    whole_writes()
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="soapstone", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv:  # a bare `soapstone`: the help, exit 0
        top.print_help()
        return 0
    if argv[0] not in COMMANDS:
        top.parse_args(argv)  # --help exits 0; an unknown command prints usage and exits 2
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"soapstone {name}", description=COMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(argv[1:])
    if name in SUPERVISED:  # under mpiexec: a rank killed outright is still named
        from soapstone.comm.launch.supervisor import supervise

        supervise()
    try:
        code = int(module.main(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a message and 120
    except BrokenPipeError:
        return stdout_closed()
    except SystemExit as e:  # sys.excepthook never sees it: one rank leaving alone hangs a job
        from soapstone.comm.launch.failure import end_on_exit

        end_on_exit(e, name)  # under a job of several ranks: never returns
        raise
    return code


def whole_writes() -> None:
    """Under `python -u` (PYTHONUNBUFFERED) stdout's text layer writes straight to the file,
    and what a pipe takes only part of (its reader gone mid-write: `| head`) is dropped with
    exit 0. Give it a buffer that writes all or fails (exit 141), flushed at every line as
    -u asks."""
    raw = getattr(sys.stdout, "buffer", None)
    if isinstance(raw, io.FileIO):
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding=sys.stdout.encoding,
                                      errors=sys.stdout.errors, line_buffering=True)


def stdout_closed() -> int:
    """The reader of stdout went away (`| head`): no traceback, no message, 128 + SIGPIPE.
    stdout is pointed at /dev/null so that the interpreter's last flush finds nothing to
    write either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
