"""`soapstone show SPEC [--model M] [--parallel P] [--json]`: the checked IR as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from .check_command import add_spec_options, load_plugins, parse_dims
from .errors import SpecError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="the .par file")
    parser.add_argument("--model", help="which model (default: the only one, or --parallel's)")
    parser.add_argument("--parallel", help="also show this parallel block")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_spec_options(parser)


def render(spec, model_name: str | None = None, parallel: str | None = None,
           as_json: bool = False) -> str:
    """The text `show` prints for a loaded spec (SpecError for unknown names)."""
    from .irtext import format_model, format_parallel, to_data

    par = spec.parallel(parallel) if parallel else None
    model = spec.model(model_name if model_name else (par.model if par else None))
    if as_json:
        data = {"model": to_data(model)}
        if par is not None:
            data["parallel"] = to_data(par)
        return json.dumps(data, indent=1) + "\n"
    text = format_model(model)
    if par is not None:
        text += "\n" + format_parallel(par)
    return text


def main(args: argparse.Namespace) -> int:
    from .spec import load

    try:
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
        spec = load(args.spec, dims=dims, filename=args.spec)
        out = render(spec, args.model, args.parallel, args.json)
    except SpecError as e:
        print(e.format(), file=sys.stderr)
        return 2
    sys.stdout.write(out)
    return 0
