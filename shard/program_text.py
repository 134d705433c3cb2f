"""Printing a Program: the text `soapstone show` prints and golden files pin, and its JSON.

Every collective appears twice over: in place, in the step list, and totalled per direction,
kind and mesh axis at the end, with the bytes this rank sends into it each step.
"""

from __future__ import annotations

import json

import attrs

from soapstone.shard.layout import Layout
from soapstone.shard.program import DIST_STATS, Compute, CopyTo, Program, Redistribute, Step

# The backward of each forward redistribution (allgather depends on its `grad` field).
BACKWARD = {"allreduce": None, "reduce_scatter": "allgather", "slice": "allgather",
            "alltoall": "alltoall", "zero_fill": None, "broadcast": None}



def _kib(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _shape(program: Program, name: str) -> str:
    v = program.value(name)
    dims = " ".join(f"{d}:{s}" for d, s in zip(v.dims, v.local_shape, strict=True))
    return f"{v.dtype}[{dims}]"


def _layout(layout: Layout) -> str:
    return "{" + str(layout) + "}"


def backward_collective(step: Step) -> str | None:
    """The collective that runs in the backward pass for this forward step, if any."""
    if isinstance(step, CopyTo):
        return "allreduce"
    if isinstance(step, Redistribute):
        if step.kind == "allgather":
            return "reduce_scatter" if step.grad == "partial" else None
        return BACKWARD[step.kind]
    return None


def collective_totals(program: Program) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(direction, kind, axis) -> (count, bytes sent by this rank) for one step of training."""
    totals: dict[tuple[str, str, str], list[int]] = {}

    def add(direction: str, kind: str, axis: str, n: int) -> None:
        t = totals.setdefault((direction, kind, axis), [0, 0])
        t[0] += 1
        t[1] += n

    for step in program.steps:
        if isinstance(step, Redistribute) and step.kind not in ("slice", "zero_fill"):
            add("forward", step.kind, step.axis, step.nbytes)
        if isinstance(step, Compute):
            for axis in step.dist:
                for _, backward in DIST_STATS.get(step.kind, ()):
                    add("forward", "allreduce(stats)", axis, 0)
                    if backward:
                        add("backward", "allreduce(stats)", axis, 0)
        bwd = backward_collective(step)
        if bwd:
            v = program.value(step.out)
            add("backward", bwd, step.axis, v.nbytes)
    # Parameters whose gradients are partial over the same axes share one flat allreduce.
    groups: dict[tuple[str, ...], int] = {}
    for p in program.params:
        if p.grad_sync:
            groups[p.grad_sync] = groups.get(p.grad_sync, 0) + program.value(p.name).nbytes
    for axes, n in groups.items():
        add("grad sync", "allreduce", ",".join(axes), n)
    return {k: (c, b) for k, (c, b) in totals.items()}


def format_step(program: Program, step: Step) -> str:
    """One line of the step list."""
    if isinstance(step, Compute):
        dist = f"  dist@{','.join(step.dist)}" if step.dist else ""
        if step.owner:
            dist += f"  only {step.owner[0]}={step.owner[1]}"
        call = f"{step.kind}({', '.join(step.args)})"
        return (f"  {step.out} = {call}\n      -> {_shape(program, step.out)} "
                f"{_layout(program.value(step.out).layout)}{dist}")
    if isinstance(step, CopyTo):
        return (f"  copy_to[{step.axis}] {step.src} -> {step.out}   "
                f"(backward allreduce {_kib(step.nbytes)})")
    names = {"R": "replicate", "P": "partial", **{p: p.replace("@", "owned:")
                                                   for p in (step.frm, step.to)
                                                   if p.startswith("@")}}
    dims = f" {names.get(step.frm, step.frm)}->{names.get(step.to, step.to)}"
    bwd = backward_collective(step)
    back = f", backward {bwd}" if bwd else ""
    return (f"  {step.kind}[{step.axis}]{dims} {step.src} -> {step.out}   "
            f"({_kib(step.nbytes)}{back})")


def format_program(program: Program) -> str:
    """The whole program as text: params, inputs, steps, grad sync, collective totals."""
    mesh = ", ".join(f"{a}={s}" for a, s in program.mesh) or "single rank"
    lines = [f"program {program.model}" + (f" / {program.parallel}" if program.parallel else "")
             + f"  mesh({mesh})  ranks {program.world_size}"]
    lines.append("params (local shapes):")
    for p in program.params:
        sync = f"  grad-sync@{','.join(p.grad_sync)}" if p.grad_sync else ""
        lines.append(f"  {p.name} : {_shape(program, p.name)} {_layout(p.layout)}{sync}")
    lines.append("inputs:")
    for name in program.inputs:
        lines.append(f"  {name} : {_shape(program, name)} "
                     f"{_layout(program.value(name).layout)}")
    lines.append("steps:")
    lines.extend(format_step(program, s) for s in program.steps)
    lines.append("outputs:")
    for o in program.outputs:
        tag = " (loss)" if o.is_loss else ""
        lines.append(f"  {o.name}{tag} = {o.value} {_layout(program.value(o.value).layout)}")
    lines.append("collectives per training step (count, bytes sent by this rank):")
    totals = collective_totals(program)
    if not totals:
        lines.append("  none")
    for (direction, kind, axis), (count, n) in sorted(totals.items()):
        size = f"  {_kib(n)}" if n else ""
        lines.append(f"  {direction:<9} {kind}[{axis}] x{count}{size}")
    return "\n".join(lines) + "\n"


def program_to_json(program: Program) -> str:
    """The program as JSON (layouts as {axis: placement})."""
    return json.dumps(program_to_data(program), indent=1)


def program_to_data(program: Program) -> dict:
    """The program as plain data: lists, dicts, strings and numbers."""

    def convert(obj):
        if isinstance(obj, Layout):
            return dict(obj.placements)
        if attrs.has(type(obj)):
            d = {"type": type(obj).__name__}
            d.update({f.name: convert(getattr(obj, f.name)) for f in attrs.fields(type(obj))})
            return d
        if isinstance(obj, tuple | list):
            return [convert(x) for x in obj]
        return obj

    data = convert(program)
    data["collectives"] = [
        {"direction": d, "kind": k, "axis": a, "count": c, "bytes": b}
        for (d, k, a), (c, b) in sorted(collective_totals(program).items())
    ]
    return data
