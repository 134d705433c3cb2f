"""`soapstone explain SPEC [--parallel P] [--json]`: per-rank memory, communication bytes per
training step per mesh axis and collective, pipeline bubble and stage imbalance, before any
process starts (the estimates and their conventions: shard/plan/explain.py).

A pipeline layout (operator statements) is lowered to its StageGraph: explain prints the
figures of the pipe rank holding the most memory, then every pipe rank's memory (activations:
microbatches in flight under the schedule), p2p bytes per edge, the pipe-axis collectives,
the bubble and the stage imbalance (shard/plan/explain.py, estimate_pipeline).
"""

from __future__ import annotations

import argparse
import json
import sys

from soapstone.comm.errors import UserError

from ..build import load_layout
from . import fail
from .flags import add_model_options


def configure(parser: argparse.ArgumentParser) -> None:
    """The model options, --optimizer and --json."""
    add_model_options(parser)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="whose state to count (default adamw)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    """Print the estimate for the flags' layout."""
    from soapstone.shard.plan.explain import estimate, estimate_pipeline, format_estimate

    from ..lower import lower

    try:
        model, par = load_layout(args)
        zero = par.zero if par is not None else 0
        if par is not None and par.operator:
            from ..stages import lower_pipeline

            est = estimate_pipeline(lower_pipeline(model, par), zero=zero,
                                    optimizer=args.optimizer)
        else:
            est = estimate(lower(model, par), zero=zero, optimizer=args.optimizer)
    except UserError as e:
        return fail(e)
    if args.json:
        print(json.dumps(est.to_data(), indent=1))
    else:
        sys.stdout.write(format_estimate(est))
    return 0
