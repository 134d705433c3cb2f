"""The text and JSON of `soapstone show` for a loaded spec: the checked IR and, for a layout,
the lowered Program (every tensor's layout, every collective with its bytes) or a pipeline's
stage graph and schedule. Torch-free; the golden compile files under tests/golden/ are this
text.
"""

from __future__ import annotations

import json

from soapstone.shard.plan.sizes import DRAWN_MICROBATCHES


def render(spec, model_name: str | None = None, parallel: str | None = None,
           as_json: bool = False, precision: str = "fp32") -> str:
    """The text `show` prints for a loaded spec (SpecError for unknown names); `precision`:
    the layout as `run --precision` runs it (its dtypes, float8's steps and gathers)."""
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.dsl.model.irtext import format_model, format_parallel, to_data
    from soapstone.shard.plan.program_text import (
        format_program,
        format_stage_graph,
        program_to_data,
        stage_graph_to_data,
    )

    par = spec.parallel(parallel) if parallel else None
    model = spec.model(model_name if model_name else (par.model if par else None))
    # What runs: every layout is a stage graph. A pipeline prints its stages, p2p edges and
    # the schedule every pipe rank runs; one stage prints its Program (compiled for one
    # microbatch when the schedule accumulates gradients over several).
    graph = lower_graph(model, par) if par is not None else None
    if graph is not None and precision != "fp32":
        from soapstone.shard.plan.analysis.precision import graph_as_run

        graph = graph_as_run(graph, precision)
    staged = graph is not None and graph.axis is not None
    program = graph.program if graph is not None and not staged else None
    schedule = grouping = None
    drawn = staged and graph.microbatches * graph.chunks <= DRAWN_MICROBATCHES
    if drawn:  # above that, the action lists alone would be huge: the bubble's formula
        from soapstone.shard.plan import p2p_groups
        from soapstone.shard.plan.schedules import build
        from soapstone.shard.plan.verify import p2p_proof

        schedule = build(graph.schedule, graph.pipe, graph.microbatches, graph.chunks)
        grouping = p2p_proof.choose(schedule)
    if as_json:
        data = {"model": to_data(model)}
        if par is not None:
            data["parallel"] = to_data(par)
            data["program"] = program_to_data(program, par.zero) if program else None
            if staged:
                data["stage_graph"] = stage_graph_to_data(graph, par.zero)
            if drawn:
                data["schedule"] = [[str(a) for a in schedule.with_comm(r)]
                                    for r in range(schedule.pipe)]
                data["p2p_grouping"] = grouping  # None: cannot run on cuda
                data["p2p_grouped"] = None if grouping is None else [
                    [str(x) for x in p2p_groups.rank_plan(schedule, r, False, grouping)]
                    for r in range(schedule.pipe)]
        return json.dumps(data, indent=1) + "\n"
    text = format_model(model)
    if par is not None:
        text += "\n" + format_parallel(par) + "\n"
        if staged:
            text += format_stage_graph(graph, programs=False) + "\n"
            if drawn:
                text += schedule.format()
                # the schedule above posts receives ahead (MPI tags); NCCL runs p2p in groups
                text += (p2p_groups.format_plans(schedule, grouping) if grouping is not None
                         else f"p2p: cannot run on cuda ({p2p_proof.unproven(schedule)})\n")
            else:
                text += undrawn(graph)
            for s in graph.stages:
                text += f"\n--- stage {s.index} ({graph.axis} {s.rank}) ---\n"
                text += format_program(s.program, par.zero, graph.deferred(s), stage=True)
        elif graph.microbatches > 1:
            text += (f"gradient accumulation: {graph.microbatches} microbatches of "
                     f"{graph.batch_dim} {graph.microbatch}, {graph.schedule} order\n")
            text += format_program(program, par.zero, stage=True)
        else:
            text += format_program(program, par.zero)
    return text


def undrawn(graph) -> str:
    """The schedule's line when it has too many microbatches to draw: its theory bubble."""
    from soapstone.shard.plan.schedules import theory_bubble

    bubble = theory_bubble(graph.schedule, graph.pipe, graph.microbatches, graph.chunks)
    return (f"schedule {graph.schedule}: pipe={graph.pipe} microbatches={graph.microbatches}"
            + (f" chunks={graph.chunks}" if graph.chunks > 1 else "")
            + f"  theory bubble {bubble:.1%} (not drawn: more than {DRAWN_MICROBATCHES} "
            "microbatches x chunks; nor its p2p groups)\n")
