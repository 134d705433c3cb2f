"""Printing a Program and a stage graph: the text `soapstone show` prints and golden files
pin, and its JSON.

Every collective appears twice over: in place, in the step list (with its payload: the bytes
of the tensor it moves), and totalled per phase, kind and mesh axis at the end. The totals are
`soapstone explain`'s traffic rows (shard/plan/analysis/explain.py `estimate`, the one traffic
model): calls and the bytes this rank sends per training step under the ring convention, gradient
sync per
bucket under the layout's ZeRO stage.
"""

from __future__ import annotations

import json
import math

import attrs

from soapstone.shard.parallel.dispatch_plan import VARIES, Call, kernel_calls
from soapstone.shard.parallel.ring_plan import (
    Ring,
    find_rings,
    float8_gathers_beside_rings,
    float8_rings,
)
from soapstone.shard.parallel.selective_plan import rebuild_steps
from soapstone.shard.plan.analysis.explain import Traffic, estimate
from soapstone.shard.plan.analysis.explain_text import format_traffic
from soapstone.shard.plan.collectives import backward_op
from soapstone.shard.plan.layout import Layout, Placement, RedistributeKind, placement_to_data
from soapstone.shard.plan.program import Compute, CopyTo, Program, Step
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.units import format_bytes


def _shape(program: Program, name: str) -> str:
    v = program.value(name)
    dims = " ".join(f"{d}:{s}" for d, s in zip(v.dims, v.local_shape, strict=True))
    return f"{v.dtype}[{dims}]"


def _layout(layout: Layout) -> str:
    return "{" + str(layout) + "}"


def traffic(program: Program, zero: int = 0,
            deferred: tuple[str, ...] = ()) -> list[Traffic]:
    """This rank's collectives per training step: explain's rows
    (shard/plan/analysis/explain.py)."""
    return estimate(program, zero=zero, deferred=deferred).traffic


def format_step(program: Program, step: Step) -> str:
    """One line of the step list."""
    if isinstance(step, Compute):
        dist = f"  dist@{','.join(step.dist)}" if step.dist else ""
        if step.owner:
            dist += f"  only {step.owner[0]}={step.owner[1]}"
        if step.exchange:
            dist += f"  exchange@{','.join(step.exchange)}"
        call = f"{step.kind}({', '.join(step.args)})"
        return (f"  {step.out} = {call}\n      -> {_shape(program, step.out)} "
                f"{_layout(program.value(step.out).layout)}{dist}"
                + "".join(f"\n      {_kernel_call(c)}" for c in kernel_calls(program, step)))
    if isinstance(step, CopyTo):
        return (f"  copy_to[{step.axis}] {step.src} -> {step.out}   "
                f"(backward allreduce {format_bytes(step.nbytes)})")
    dims = f" {step.frm}->{step.to}"
    bwd = backward_op(step)
    back = f", backward {bwd}" if bwd else ""
    return (f"  {step.kind}[{step.axis}]{dims} {step.src} -> {step.out}   "
            f"({format_bytes(step.nbytes)}{back})")


def _kernel_call(c: Call) -> str:
    """One collective an op's kernel makes, under its step (alltoallv: expected bytes)."""
    shape = ",".join("?" if n == VARIES else str(n) for n in c.shape)
    est = " expected at the capacity bound" if VARIES in c.shape else ""
    return f"{c.phase} {c.kind}[{','.join(c.axes)}] {c.dtype}[{shape}] {c.what}   " \
        f"({format_bytes(c.payload)}{est})"


def format_program(program: Program, zero: int = 0, deferred: tuple[str, ...] = (),
                   stage: bool = False) -> str:
    """The whole program as text: params, inputs, steps, outputs, and explain's collective
    totals per training step under ZeRO `zero` (deferred: see explain.estimate). stage: a
    pipeline stage's Program, whose totals are for one microbatch and grad sync once."""
    mesh = ", ".join(f"{a}={s}" for a, s in program.mesh) or "single rank"
    lines = [f"program {program.model}" + (f" / {program.parallel}" if program.parallel else "")
             + f"  mesh({mesh})  ranks {program.world_size}"]
    if program.balanced:  # a split of these holds zigzag chunks r and 2n-1-r on rank r
        lines.append(f"balanced (zigzag chunks): {', '.join(program.balanced)}")
    lines.append("params (local shapes):")
    for p in program.params:
        sync = f"  grad-sync@{','.join(p.grad_sync)}" if p.grad_sync else ""
        lines.append(f"  {p.name} : {_shape(program, p.name)} {_layout(p.layout)}{sync}")
    lines.append("inputs:")
    for name in program.inputs:
        lines.append(f"  {name} : {_shape(program, name)} "
                     f"{_layout(program.value(name).layout)}")
    lines.append("steps:")
    starts = {a: b for a, b in program.recompute}
    dropped = {n: [program.steps[i].kind for i in rebuild_steps(program, n)]
               for n in program.dropped}
    f8 = float8_gathers_beside_rings(program, marked=True)  # show --precision float8
    rings = find_rings(program)
    f8_rings = float8_rings(program, marked=True)  # and the rings that run float8
    for i, s in enumerate(program.steps):
        if i in starts:  # what backward runs again: the range's steps, from its inputs
            lines.append(f"  # recompute: steps {i}..{starts[i] - 1} keep only their inputs; "
                         "backward runs them again")
        lines.append(format_step(program, s))
        e4m3 = math.prod(program.value(s.out).local_shape) if i in f8 else None
        if i in rings:  # `overlap tensor`: the p2p calls the ring makes instead
            lines.append(ring_line(program, rings[i], float8=i in f8_rings))
        if s.out in program.regathered:  # sequence parallelism's linear inputs
            lines.append(f"      # kept as its shard {s.src}: freed after forward's last use, "
                         f"gathered again for backward (backward allgather "
                         f"{format_bytes(s.nbytes if e4m3 is None else e4m3)})")
        if e4m3 is not None:  # float8's gather of a float8 linear's input (float8_gathers)
            lines.append(f"      # float8: each rank casts its shard at the amax allreduced "
                         f"over {s.axis} (4 B), then the gather moves e4m3, "
                         f"{format_bytes(e4m3)}")
        if s.out in dropped:  # `recompute selective` or `recompute ops`
            lines.append(f"      # recompute {program.drop_rule}: freed after forward's last "
                         f"use, rebuilt for backward ({' -> '.join(dropped[s.out])} again)")
        if s.out in program.held:  # `recompute ops`: an anchor no kernel keeps
            lines.append("      # recompute ops: held for backward, where the dropped values "
                         "are rebuilt from it")
    lines.append("outputs:")
    for o in program.outputs:
        tag = " (loss)" if o.is_loss else ""
        lines.append(f"  {o.name}{tag} = {o.value} {_layout(program.value(o.value).layout)}")
    if stage:
        lines.append(f"collectives of this stage for one microbatch, grad sync once (zero "
                     f"{zero}; explain's per-step figures add microbatches and p2p):")
    else:
        lines.append(f"collectives per training step (zero {zero}; as explain: calls, bytes "
                     "this rank sends):")
    lines.extend(format_traffic(traffic(program, zero, deferred)))
    return "\n".join(lines) + "\n"


def program_to_json(program: Program, zero: int = 0) -> str:
    """The program as JSON (layouts as {axis: {"kind": ..., ...}})."""
    return json.dumps(program_to_data(program, zero), indent=1)


def program_to_data(program: Program, zero: int = 0,
                    deferred: tuple[str, ...] = ()) -> dict:
    """The program as plain data: lists, dicts, strings and numbers; "collectives" are
    explain's traffic rows under ZeRO `zero`."""

    def convert(obj):
        if isinstance(obj, Layout):
            return {axis: placement_to_data(p) for axis, p in obj.placements}
        if isinstance(obj, Placement):
            return placement_to_data(obj)
        if attrs.has(type(obj)):
            d = {"type": type(obj).__name__}
            d.update({f.name: convert(getattr(obj, f.name)) for f in attrs.fields(type(obj))})
            return d
        if isinstance(obj, tuple | list):
            return [convert(x) for x in obj]
        return obj

    data = convert(program)
    data["collectives"] = [attrs.asdict(t) for t in traffic(program, zero, deferred)]
    return data


def format_stage_graph(graph: StageGraph, programs: bool = True, zero: int = 0) -> str:
    """The text `soapstone show` prints for a stage graph: stages, edges with bytes, then each
    program (its collective totals for one microbatch of that stage under ZeRO `zero`)."""
    inner = [(a, n) for a, n in graph.mesh if a != graph.axis]
    others = " x ".join(f"{a}={n}" for a, n in inner) or "nothing else"
    lines = [f"stage graph: {len(graph.stages)} virtual stages over {graph.axis}="
             f"{graph.pipe} ({graph.schedule}, microbatches={graph.microbatches}"
             + (f", chunks={graph.chunks}" if graph.chunks > 1 else "") + "); "
             f"each stage on {others}",
             f"  microbatch: {graph.batch_dim} {graph.batch} / {graph.microbatches} = "
             f"{graph.microbatch}"]
    for s in graph.stages:
        blocks = f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0]
        extra = []
        if s.data_inputs:
            extra.append("reads " + ", ".join(s.data_inputs))
        if s.is_last:
            extra.append("loss")
        lines.append(f"  stage {s.index}  {graph.axis} {s.rank}  blocks {blocks}  "
                     f"{len(s.program.params)} params, {len(s.program.steps)} steps"
                     + (f"  ({'; '.join(extra)})" if extra else ""))
    for e in graph.edges:
        # a V's turn: two stages of one rank, handed over in memory (no message)
        how = ("handed over in memory, no p2p" if e.src_rank == e.dst_rank else
               "the same back as gradients")
        lines.append(f"  edge {e.src} -> {e.dst}  ({graph.axis} {e.src_rank} -> "
                     f"{e.dst_rank}): {format_bytes(e.nbytes)} per microbatch per rank, {how}")
        for t in e.tensors:
            dims = " ".join(f"{d}:{n}" for d, n in zip(t.dims, t.local_shape, strict=True))
            lines.append(f"    {t.name}  {t.dtype}[{dims}]  {{{t.layout}}}  "
                         f"{format_bytes(t.nbytes)}")
    for name, where in graph.shared:
        lines.append(f"  shared {name}: stages {', '.join(map(str, where))} hold copies; "
                     f"gradient summed over {graph.axis}")
    per_step = sum(e.nbytes for e in graph.edges
                   if e.src_rank != e.dst_rank) * graph.microbatches * 2
    lines.append("  p2p per step (all edges, forward + backward): "
                 f"{format_bytes(per_step)} per rank column")
    text = "\n".join(lines) + "\n"
    if programs:
        for s in graph.stages:
            text += f"\n--- stage {s.index} ({graph.axis} {s.rank}) ---\n"
            text += format_program(s.program, zero, graph.deferred(s), stage=True)
    return text


def stage_graph_to_data(graph: StageGraph, zero: int = 0) -> dict:
    """A stage graph's JSON-ready summary (the programs via program_to_data, under ZeRO
    `zero`)."""
    return {
        "model": graph.model, "parallel": graph.parallel, "axis": graph.axis,
        "schedule": graph.schedule, "microbatches": graph.microbatches,
        "chunks": graph.chunks, "batch_dim": graph.batch_dim, "batch": graph.batch,
        "stages": [{"index": s.index, "rank": s.rank, "chunk": s.chunk,
                    "blocks": list(s.blocks), "data_inputs": list(s.data_inputs),
                    "recv": list(s.recv), "send": list(s.send),
                    "program": program_to_data(s.program, zero, graph.deferred(s))}
                   for s in graph.stages],
        "edges": [{"src": e.src, "dst": e.dst, "bytes": e.nbytes,
                   "tensors": [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims),
                                "local_shape": list(t.local_shape),
                                "layout": str(t.layout), "bytes": t.nbytes}
                               for t in e.tensors]} for e in graph.edges],
        "shared": [{"param": n, "stages": list(w)} for n, w in graph.shared],
    }


def ring_line(program: Program, ring: Ring, float8: bool = False) -> str:
    """The comment under a collective matmul's step: its p2p calls, forward and backward;
    `float8`: a ring of float8 matmuls (ring_plan.float8_rings), whose gathered chunks
    travel as float8 after their amax's allreduce."""
    step = program.steps[ring.at]
    n = dict(program.mesh)[ring.axis]
    gather = ring.kind is RedistributeKind.ALLGATHER
    v = program.value(step.src if gather else step.out)
    mms = ", ".join(program.steps[j].out for j in ring.matmuls)
    steps = f"{n - 1} async p2p step{'s' if n > 2 else ''}"
    if not float8:
        fwd, bwd = ("chunks", "partial sums") if gather else ("partial sums", "chunks")
        return (f"      # overlap tensor: a ring of {steps} (isend next, irecv previous, "
                f"{format_bytes(v.nbytes)} each) carrying the {fwd} while the matmuls {mms} "
                f"run chunk by chunk; backward the same ring carrying the {bwd}")
    # the gathered direction's chunks: 1 byte an element, cast at the allreduced amax
    f8 = (f"{'e4m3' if gather else 'e5m2'} chunks ({format_bytes(math.prod(v.local_shape))} "
          f"each, after the amax's 4 B allreduce)")
    wide = f"partial sums ({format_bytes(v.nbytes)} each)"  # bf16 both ways
    fwd, bwd = (f8, wide) if gather else (wide, f8)
    return (f"      # overlap tensor, float8: a ring of {steps} (isend next, irecv previous) "
            f"carrying the {fwd} while the float8 matmuls {mms} run chunk by chunk; backward "
            f"the same ring carrying the {bwd}")
