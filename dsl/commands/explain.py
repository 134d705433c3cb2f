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

from ..build import compile_layout, load_layout
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

    try:
        model, par = load_layout(args)
        zero = par.zero if par is not None else 0
        graph = compile_layout(model, par)  # every layout is a stage graph
        if len(graph.stages) == 1 and graph.microbatches == 1:
            est = estimate(graph.program, zero=zero, optimizer=args.optimizer)
        else:  # stages or accumulation: per microbatch x microbatches, the schedule's peak
            est = estimate_pipeline(graph, zero=zero, optimizer=args.optimizer)
    except UserError as e:
        return fail(e)
    if args.json:
        print(json.dumps(est.to_data(), indent=1))
    else:
        sys.stdout.write(format_estimate(est))
    return 0
