"""`soapstone check SPEC... [--dim name=value] [--plugin P]`: parse and validate, no torch."""

from __future__ import annotations

import argparse
import sys

from .errors import Diagnostic, SpecError


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """--dim and --plugin, shared by check and show."""
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="override a dim size (repeatable)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                        help="import a module or .py file that registers custom layers")


def parse_dims(items: list[str]) -> dict[str, int]:
    """`["seq=64", ...]` -> {"seq": 64}; SpecError on a malformed item or a size < 1."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name.isidentifier() or not value.lstrip("-").isdigit():
            raise SpecError([Diagnostic("--dim", 0, 0, f"--dim {item!r}: expected NAME=INTEGER",
                                        "e.g. --dim seq=256")])
        if int(value) < 1:
            raise SpecError([Diagnostic("--dim", 0, 0, f"--dim {name}={int(value)}: dim sizes "
                                        "are integers >= 1", f"e.g. --dim {name}=16")])
        dims[name] = int(value)
    return dims


def load_plugins(refs: list[str]) -> None:
    """Import each plugin; a failure is bad input (SpecError), not a traceback."""
    from .custom import load_plugin

    for ref in refs:
        try:
            load_plugin(ref)
        except SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported
            raise SpecError([Diagnostic(ref, 0, 0, f"cannot load plugin: "
                                        f"{type(e).__name__}: {e}")]) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".par files to check")
    add_spec_options(parser)


def main(args: argparse.Namespace) -> int:
    from .spec import load

    try:
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
    except SpecError as e:
        print(e.format(), file=sys.stderr)
        return 2
    status = 0
    for path in args.specs:
        try:
            spec = load(path, dims=dims, filename=path)
        except SpecError as e:
            print(e.format(), file=sys.stderr)
            status = 2
            continue
        models = ", ".join(spec.models) or "none"
        pars = ", ".join(spec.parallels) or "none"
        print(f"ok: {path} (models: {models}, parallels: {pars})")
    return status
