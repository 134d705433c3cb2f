"""`soapstone check SPEC... [--dim name=value] [--plugin P]`: parse and validate, no torch."""

from __future__ import annotations

import argparse

from soapstone.comm.errors import UserError

from ..build import load_plugins, parse_dims
from . import fail
from .flags import add_spec_options


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC... and the spec options."""
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".par files to check")
    add_spec_options(parser)


def main(args: argparse.Namespace) -> int:
    """Check every spec (a bad one does not stop the rest); 2 if any is bad."""
    from ..spec import load

    try:
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
    except UserError as e:
        return fail(e)
    status = 0
    for path in args.specs:
        try:
            spec = load(path, dims=dims, filename=path)
        except UserError as e:
            status = fail(e)
            continue
        models = ", ".join(spec.models) or "none"
        pars = ", ".join(spec.parallels) or "none"
        print(f"ok: {path} (models: {models}, parallels: {pars})")
    return status
