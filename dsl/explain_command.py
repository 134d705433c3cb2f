"""`soapstone explain SPEC [--parallel P] [--json]`: per-rank memory, communication bytes per
training step per mesh axis and collective, pipeline bubble and stage imbalance, before any
process starts (the estimates and their conventions: shard/explain.py).

A pipeline layout (operator statements) is not lowered yet: explain then prints its bubble
fraction and stage imbalance, which need only the IR, and says that memory and traffic wait
for the operator-axis compiler.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .errors import SpecError
from .run_command import BadInput, add_model_options


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="whose state to count (default adamw)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def stage_figures(model, par) -> tuple[int, int, float, float]:
    """(stages, microbatches, bubble, imbalance) of a layout, from the IR alone."""
    from soapstone.shard.explain import bubble_fraction

    if par is None or not par.operator:
        return 1, 1, 0.0, 1.0
    stage_of = {b: a.stage for a in par.operator for b in a.blocks}
    stages = max(stage_of.values()) + 1
    per = [0] * stages
    seen_block = False
    for p in model.params:  # params outside blocks: before the first block -> first stage
        n = math.prod(model.size(d) for d in p.type.dims)
        if p.block is not None:
            seen_block = True
            per[stage_of.get(p.block, 0)] += n
        else:
            per[-1 if seen_block else 0] += n
    mean = sum(per) / stages
    m = par.schedule.microbatches
    return stages, m, bubble_fraction(stages, m), (max(per) / mean if mean else 1.0)


def main(args: argparse.Namespace) -> int:
    from soapstone.shard.explain import estimate, format_estimate

    from .check_command import load_plugins, parse_dims
    from .lower import lower
    from .spec import load

    try:
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
        spec = load(args.spec, dims=dims, filename=args.spec)
        par = spec.parallel(args.parallel) if args.parallel else None
        model = spec.model(args.model if args.model else (par.model if par else None))
        if par is not None and par.model != model.name:
            raise BadInput(f"parallel block '{par.name}' is for model '{par.model}', "
                           f"not '{model.name}'")
        stages, micro, bubble, imbalance = stage_figures(model, par)
        if par is not None and par.operator:
            data = {"model": model.name, "parallel": par.name, "world_size": par.world_size,
                    "stages": stages, "microbatches": micro, "bubble": bubble,
                    "imbalance": imbalance, "memory": None, "traffic": None,
                    "note": "pipeline layouts are not lowered yet: memory and traffic need "
                            "the operator-axis compiler"}
            if args.json:
                print(json.dumps(data, indent=1))
            else:
                print(f"explain {model.name} / {par.name}  {par.world_size} ranks\n"
                      f"pipeline: {stages} stages, {micro} microbatches, bubble {bubble:.3f} "
                      f"= (p-1)/(m+p-1), stage imbalance {imbalance:.2f}\n"
                      f"memory and communication: {data['note']}")
            return 0
        program = lower(model, par)
    except SpecError as e:
        print(e.format(), file=sys.stderr)
        return 2
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    est = estimate(program, zero=par.zero if par is not None else 0, optimizer=args.optimizer)
    est.stages, est.microbatches, est.bubble, est.imbalance = stages, micro, bubble, imbalance
    if args.json:
        print(json.dumps(est.to_data(), indent=1))
    else:
        sys.stdout.write(format_estimate(est))
    return 0
