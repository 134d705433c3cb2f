"""`soapstone show SPEC [--model M] [--parallel P] [--json] [--precision P]`: the checked IR,
and with --parallel the lowered Program (every tensor's layout, every collective with its
bytes; under --precision, as that run keeps and moves them)."""

from __future__ import annotations

import argparse
import sys

from soapstone.comm.dtype_table import COMMAND_PRECISIONS
from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import load_plugins, parse_dims, report_refusals
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_spec_options


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC, --model, --parallel, --json and the spec options."""
    parser.add_argument("spec", metavar="SPEC", help="the .par file")
    parser.add_argument("--model", help="which model (default: the only one, or --parallel's)")
    parser.add_argument("--parallel", help="also show this parallel block")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--precision", choices=COMMAND_PRECISIONS, default="fp32",
                        help="the layout as run --precision runs it (default fp32, the "
                        "spec's dtypes; float8 marks its float8 gathers)")
    add_spec_options(parser)


def main(args: argparse.Namespace) -> int:
    """Print the spec's IR (and the layout's plan)."""
    from soapstone.dsl.app.show_text import render
    from soapstone.dsl.lang.spec import load

    try:
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
        spec = load(args.spec, dims=dims, filename=args.spec)
        out = render(spec, args.model, args.parallel, args.json, args.precision)
        report_refusals(spec, args.parallel)
    except UserError as e:
        return fail(e)
    sys.stdout.write(out)
    if args.parallel and spec.parallel(args.parallel).offload:
        from soapstone.shard.parallel.offload_plan import NOTE

        print(f"note: {NOTE}", file=sys.stderr)
    return 0
