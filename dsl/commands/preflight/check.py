"""`soapstone check SPEC... [--parallel P] [--verify] [--dim name=value] [--plugin P]`: parse and
validate, no torch. --verify also proves each layout (or --parallel's) before any launch: every
rank's collectives and p2p messages match and complete (dsl/compile/layout_proof.py)."""

from __future__ import annotations

import argparse
import sys

from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import load_plugins, parse_dims, report_refusals
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_spec_options
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC... and the spec options."""
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".par files to check")
    parser.add_argument("--parallel", help="the layout to check (default: every layout)")
    parser.add_argument("--verify", action="store_true",
                        help="prove every rank's collectives and p2p messages match and "
                             "complete, as launched (no ranks needed)")
    add_spec_options(parser)


def main(args: argparse.Namespace) -> int:
    """Check every spec (a bad one does not stop the rest); 2 if any is bad."""
    from soapstone.dsl.lang.spec import load

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
        try:
            chosen = [spec.parallel(args.parallel)] if args.parallel else \
                list(spec.parallels.values())
            report_refusals(spec, args.parallel)
            if spec.refused and not spec.parallels:
                raise BadInput(f"{path}: no layout can take these --dim sizes "
                               f"({', '.join(spec.refused)}: each reason above)")
            print(f"ok: {path} (models: {models}, parallels: {pars})")
            offloaded = [p.name for p in chosen if p.offload]
            if offloaded:
                from soapstone.shard.parallel.offload_plan import NOTE

                print(f"note: {', '.join(offloaded)}: {NOTE}", file=sys.stderr)
            if args.verify:
                verify(spec, chosen)
        except UserError as e:
            status = fail(e)
    return status


def verify(spec, layouts) -> None:
    """Prove each layout, one line each (VerifyError, a UserError, at the first that fails)."""
    from soapstone.dsl.compile.layout_proof import prove_layout
    from soapstone.dsl.compile.stages import lower_graph

    for par in layouts:
        model = spec.model(par.model)
        proof = prove_layout(model, lower_graph(model, par))
        print(f"verified: {model.name} / {par.name}: {proof.summary()}")
