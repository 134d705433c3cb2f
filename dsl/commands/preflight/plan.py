"""`soapstone plan SPEC --world N --profile NAME|FILE [--global-batch B] [--recompute auto|always|
never] [--top K] [--json]`:
choose a layout for the model on N devices of a hardware profile.

Searches data x tensor (with or without sequence parallelism) x pipeline (stages, schedule,
microbatches, virtual stages) x ZeRO x activation recompute, drops the layouts that do not fit
the device's memory (explain's estimate), ranks the rest by the cost model's step time
(dsl/search/plan_search.py, shard/plan/analysis/cost.py), prints the table with a reason per row,
explains the winner in seed 004's order, and prints it as a `parallel` block that check, explain
and run
accept; `-o FILE` writes a spec that includes SPEC and holds the block. Nothing that fits:
exit 2 saying what is missing (memory, or which dim does not divide). No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import attrs

from soapstone.comm.dtype_table import COMMAND_PRECISIONS
from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import load_plugins, parse_dims
from soapstone.dsl.app.outputs import cannot_write, check_file, spec_inputs
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_nodes_option, add_spec_options
from soapstone.dsl.lang.errors import BadInput
from soapstone.shard.plan.sizes import MAX_DIM, MAX_RANKS

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # grammar/par.lark's NAME


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC, --world, --profile, --global-batch, --top, --json and the spec options."""
    parser.add_argument("spec", metavar="SPEC", help="the .par file")
    parser.add_argument("--model", help="which model (default: the only one)")
    parser.add_argument("--world", type=int, required=True, metavar="N",
                        help="how many devices")
    parser.add_argument("--profile", required=True, metavar="NAME|FILE",
                        help="a hardware preset (a100-40gb, a100-80gb, h100-80gb, h100-96gb, "
                             "h200, cpu-2core) or a profile file (`soapstone bench calibrate -o`)")
    parser.add_argument("--global-batch", type=int, metavar="B",
                        help="the batch per step (default: the spec's batch dim)")
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="table rows (default 10)")
    parser.add_argument("--precision", choices=COMMAND_PRECISIONS, default="fp32",
                        help="what `run --precision` computes in: the peak the compute runs "
                             "at and the bytes it keeps and moves (bf16 activations and "
                             "collectives, fp32 masters; float8: bf16's, the weight "
                             "matmuls at the fp8 peak; default fp32, as `run`)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="whose state to count (default adamw)")
    parser.add_argument("--recompute", choices=("auto", "always", "never"), default="auto",
                        help="activation recompute: auto tries it where nothing fits without "
                             "it (default); always recomputes every layout's largest repeat "
                             "(Megatron's full recompute); never leaves it out")
    parser.add_argument("--name", default="planned", help="the block's name (default planned)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write a spec holding `include SPEC` and the winning block")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_nodes_option(parser)
    add_spec_options(parser)


def main(args: argparse.Namespace) -> int:
    """Plan, print, and write the block."""
    from soapstone.dsl.lang.spec import load
    from soapstone.dsl.search.plan_search import search
    from soapstone.shard.plan.analysis.hardware import load_profile

    t0 = time.perf_counter()
    try:
        if not 1 <= args.world <= MAX_RANKS:
            raise BadInput(f"--world {args.world}: give 1 to {MAX_RANKS} devices (MPI numbers "
                           "ranks with 32-bit ints)")
        if args.top < 1:
            raise BadInput(f"--top {args.top}: give at least 1 row")
        if args.global_batch is not None and not 1 <= args.global_batch <= MAX_DIM:
            raise BadInput(f"--global-batch {args.global_batch}: give 1 to {MAX_DIM}")
        if not NAME.fullmatch(args.name):  # str.isidentifier takes é, which specs do not
            raise BadInput(f"--name {args.name!r}: a block name is a spec's name: ASCII "
                           "letters, digits and _, not starting with a digit (e.g. planned)")
        if args.output and not Path(args.output).resolve().parent.is_dir():
            raise BadInput(f"-o {args.output}: the directory does not exist")
        if args.output:  # the spec is read after this: never written over
            check_file(args.output, "-o", "planned.par",
                       spec_inputs(args) + [("--profile", args.profile)])
        profile = load_profile(args.profile)
        if args.devices_per_node is not None:  # the search's links and the placement alike
            if args.devices_per_node < 1:
                raise BadInput(f"--devices-per-node {args.devices_per_node}: give at least 1")
            profile = attrs.evolve(profile, devices_per_node=args.devices_per_node)
        dims = parse_dims(args.dim)
        load_plugins(args.plugin)
        spec = load(args.spec, dims=dims, filename=args.spec)
        if args.name in spec.parallels or args.name in spec.refused:
            raise BadInput(f"--name {args.name}: {args.spec} already has a parallel block "
                           f"'{args.name}', so the planned one would be defined twice; give "
                           "--name another name")
        model = spec.model(args.model)
        planner = _planner(model, profile, args)
        batch = planner.dims.batch
        if args.global_batch is not None and args.global_batch != model.size(batch):
            dims[batch] = args.global_batch
            model = load(args.spec, dims=dims, filename=args.spec).model(args.model)
            planner = _planner(model, profile, args)
        plan = search(planner, args.world)
    except UserError as e:
        return fail(e)
    seconds = time.perf_counter() - t0
    block = plan.source(args.name)
    from soapstone.dsl.commands.preflight.explain import placement

    nodes = placement(plan.parallel(args.name), profile.devices_per_node, None,
                      "--devices-per-node" if args.devices_per_node else
                      f"{profile.name}'s devices per node")
    if args.output:
        try:
            Path(args.output).write_text(spec_file(args, block, dims))
        except OSError as e:
            return fail(cannot_write("-o", args.output, e))
    if args.json:
        print(json.dumps(plan.to_data(planner, args.top, args.name) | {
            "seconds": seconds, "dims": dims, "placement": nodes[0]}, indent=1))
    else:
        sys.stdout.write(plan.format(planner, args.top, args.name, seconds))
        print(nodes[1])
        sys.stdout.write(_usage(args, dims))
    for line in nodes[2]:
        print(f"warning: {line}", file=sys.stderr)
    if args.precision == "float8":
        why = _float8_refusal(model, plan.parallel(args.name))
        if why:
            print(f"warning: `run --precision float8` would refuse this layout: {why}",
                  file=sys.stderr)
    return 0


def _float8_refusal(model, parallel) -> str:
    """Why `run --precision float8` refuses the chosen layout ('' if it runs it): the
    search costs every layout, and only a compiled one knows its widths per rank."""
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.parallel.ring_plan import float8_ring_refusal

    graph = lower_graph(model, parallel)
    return next((why for why in map(float8_ring_refusal, (s.program for s in graph.stages))
                 if why), "")


def _planner(model, profile, args: argparse.Namespace):
    """The Planner of `--precision`, `--optimizer` and `--recompute`."""
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import recompute_options

    forms = () if args.recompute == "never" else None
    if args.recompute == "always" and not recompute_options(model):
        raise BadInput(f"--recompute always: model {model.name} has no repeat to recompute "
                       "(use --recompute auto)")
    return Planner(model, profile, precision=args.precision, optimizer=args.optimizer,
                   recompute=forms, always_recompute=args.recompute == "always")


def spec_file(args: argparse.Namespace, block: str, dims: dict[str, int]) -> str:
    """A spec that includes SPEC (by a path relative to the output) and holds the block."""
    rel = os.path.relpath(Path(args.spec).resolve(), Path(args.output).resolve().parent)
    flags = "".join(f" --dim {k}={v}" for k, v in dims.items())
    return (f"# soapstone plan {args.spec} --world {args.world} --profile {args.profile}"
            + (f" --global-batch {args.global_batch}" if args.global_batch else "")
            + (f" --recompute {args.recompute}" if args.recompute != "auto" else "") + "\n"
            + (f"# run it with{flags}\n" if flags else "")
            + f'include "{rel}"\n\n{block}')


def _usage(args: argparse.Namespace, dims: dict[str, int]) -> str:
    flags = "".join(f" --dim {k}={v}" for k, v in dims.items())
    where = args.output or "a copy of " + args.spec
    return (f"\nappend the block to {args.spec} (or use -o FILE), then:\n"
            f"  soapstone explain {where if args.output else args.spec} --parallel {args.name}"
            f"{flags}\n"
            f"  mpiexec -n {args.world} soapstone run ... --parallel {args.name}{flags}\n")
