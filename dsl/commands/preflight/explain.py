"""`soapstone explain SPEC [--parallel P] [--json]`: per-rank memory, communication bytes per
training step per mesh axis and collective, pipeline bubble and stage imbalance, before any
process starts (the estimates and their conventions: shard/plan/analysis/explain.py).

A pipeline layout (operator statements) is lowered to its StageGraph: explain prints the
figures of the pipe rank holding the most memory, then every pipe rank's memory (activations:
microbatches in flight under the schedule), p2p bytes per edge, the pipe-axis collectives,
the bubble and the stage imbalance (shard/plan/analysis/explain.py, estimate_pipeline).
"""

from __future__ import annotations

import argparse
import json
import sys

from soapstone.comm.dtype_table import COMMAND_PRECISIONS
from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import compile_layout, load_layout
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_model_options, add_nodes_option


def configure(parser: argparse.ArgumentParser) -> None:
    """The model options, --optimizer and --json."""
    add_model_options(parser)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="whose state to count (default adamw)")
    parser.add_argument("--precision", choices=COMMAND_PRECISIONS, default="fp32",
                        help="what `run --precision` keeps and moves: bf16 counts bf16 "
                             "activations, collectives and p2p, fp32 masters and gradients; "
                             "float8 as bf16 with the weight matmuls at the fp8 peak "
                             "(default fp32, as `run`)")
    parser.add_argument("--profile", metavar="NAME|FILE",
                        help="compare the memory with this device's (a preset or a profile "
                             "file; default: this host's memory over the layout's ranks), and "
                             "predict the step time, TFLOP/s per device, MFU and tokens/s on it")
    add_nodes_option(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    """Print the estimate for the flags' layout."""
    from soapstone.shard.plan.analysis.explain import estimate, estimate_pipeline
    from soapstone.shard.plan.analysis.explain_text import format_estimate
    from soapstone.shard.plan.analysis.precision import graph_as_run

    try:
        model, par = load_layout(args)
        zero = par.zero if par is not None else 0
        # every layout is a stage graph, its dtypes those the run computes in
        graph = graph_as_run(compile_layout(model, par), args.precision)
        if len(graph.stages) == 1 and graph.microbatches == 1:
            est = estimate(graph.program, zero=zero, optimizer=args.optimizer)
        else:  # stages or accumulation: per microbatch x microbatches, the schedule's peak
            est = estimate_pipeline(graph, zero=zero, optimizer=args.optimizer)
        limit, where = _memory_limit(args.profile, est.world_size)
        nodes = placement(par, args.devices_per_node, args.profile)
        scored = predict(args, model, graph, est) if args.profile else None
    except UserError as e:
        return fail(e)
    fits = est.total_bytes <= limit
    from soapstone.shard.plan.analysis.checkpoint_size import (
        checkpoint_bytes,
        checkpoint_total,
        format_checkpoint,
    )

    ckpt = checkpoint_bytes(graph, args.optimizer)  # None: too many ranks to count each
    if args.json:
        extra = {}
        if par is not None and par.offload:  # device and host bytes on a GPU run
            import attrs

            from soapstone.shard.parallel.offload_plan import offload_figures

            extra["offload"] = attrs.asdict(offload_figures(est))
        print(json.dumps(est.to_data() | {"fits": fits, "memory_limit_bytes": limit,
                                          "memory_limit": where,
                                          "checkpoint_bytes_per_rank": ckpt,
                                          "async_staging_bytes": max(ckpt) if ckpt else None}
                         | extra
                         | ({"score": scored[0].to_data(), "time": scored[1].to_data()}
                            if scored else {})
                         | ({"placement": nodes[0]} if nodes else {}), indent=1))
    else:
        sys.stdout.write(format_estimate(est))
        if args.precision == "float8":
            from soapstone.shard.ops.einsum import float8_refusal
            from soapstone.shard.plan.analysis.precision import float8_line

            print(float8_line(graph))
            why = next((w for w in (float8_refusal(s.program) for s in graph.stages) if w), "")
            if why:
                print(f"warning: `run --precision float8` would refuse this layout: {why}",
                      file=sys.stderr)
        if scored:
            from soapstone.shard.plan.analysis.score import format_time

            print(scored[0].line())
            print(format_time(scored[1]))
        if par is not None and par.offload:
            from soapstone.shard.parallel.offload_plan import format_offload, offload_figures
            from soapstone.shard.plan.units import format_bytes

            print("\n".join(format_offload(offload_figures(est), format_bytes)))
        print(format_checkpoint(ckpt, checkpoint_total(graph, args.optimizer),
                                graph.world_size))
        if ckpt:  # counted rank by rank (up to COUNTED_RANKS)
            print(format_staging(ckpt))
        if nodes:
            print(nodes[1])
    for line in nodes[2] if nodes else ():
        print(f"warning: {line}", file=sys.stderr)
    if not fits:
        from soapstone.shard.plan.units import format_bytes

        print(f"warning: this layout does not fit: it needs {format_bytes(est.total_bytes)} "
              f"per rank, but a rank has {format_bytes(limit)} ({where}); `run` would refuse "
              "it. `soapstone plan SPEC --world N --profile NAME` finds layouts that fit",
              file=sys.stderr)
    return 0


def predict(args, model, graph, est):
    """(Score, StepTime) of the layout on --profile in --precision (shard/plan/analysis/
    score.py): the cost model's step, the model FLOPs as `run` counts them (its single-rank
    Program), --devices-per-node overriding the profile's."""
    import attrs

    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.plan.analysis.cost import step_time
    from soapstone.shard.plan.analysis.hardware import load_profile
    from soapstone.shard.plan.analysis.score import graph_work, score

    prof = load_profile(args.profile)
    if args.devices_per_node is not None:
        prof = attrs.evolve(prof, devices_per_node=args.devices_per_node)
    t = step_time(est, graph_work(graph), prof, args.precision)
    return score(t, lower(model, None), graph.world_size, prof, args.precision), t


def format_staging(per_rank: list[int]) -> str:
    """explain's line for `run --async-save`: the host memory a rank's staging copy takes (what
    it writes: shard/checkpoint/async_save.py keeps one such buffer per rank)."""
    from soapstone.shard.plan.units import format_bytes

    return (f"async staging (run --async-save): {format_bytes(max(per_rank))} per rank of host "
            "memory at most (a copy of what the rank writes, kept for the run)")


def placement(par, per_node: int | None, profile: str | None,
              where: str = "--devices-per-node"):
    """(JSON, line, tensor-parallel warnings) of which mesh axes cross nodes, for
    --devices-per-node or --profile's devices per node; None when neither is given or there is
    no layout. BadInput for a --devices-per-node under 1."""
    from soapstone.dsl.lang.errors import BadInput
    from soapstone.shard.plan.analysis.hardware import load_profile
    from soapstone.shard.plan.analysis.placement import (
        block_nodes,
        format_placement,
        place,
        tp_warnings,
    )

    if per_node is not None and per_node < 1:
        raise BadInput(f"--devices-per-node {per_node}: give at least 1")
    if par is None or (per_node is None and not profile):
        return None
    if per_node is None:
        prof = load_profile(profile)
        per_node, where = prof.devices_per_node, f"{prof.name}'s devices per node"
    placed = place(par.mesh, block_nodes(par.world_size, per_node))
    data = {"devices_per_node": per_node, "axes": [p.to_data() for p in placed]}
    return data, format_placement(placed, per_node, where), tp_warnings(par, placed, per_node)


def _memory_limit(profile: str | None, ranks: int) -> tuple[int, str]:
    """(bytes a rank may hold, whose): the profile's usable memory, else this host's share."""
    from soapstone.shard.plan.analysis.fit import host_memory_per_rank
    from soapstone.shard.plan.analysis.hardware import load_profile

    if profile:
        p = load_profile(profile)
        return p.usable_bytes, f"{p.name}, {p.usable_fraction:.0%} usable"
    return host_memory_per_rank(ranks)
