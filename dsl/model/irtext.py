"""The IR as text (`soapstone show`) and as JSON-ready data (`show --json`)."""

from __future__ import annotations

import attrs

from soapstone.dsl.model.ir import Model, Op, Parallel, Schedule, TensorType
from soapstone.shard.plan.schedules import CHUNKED


def format_type(t: TensorType) -> str:
    """`f32[batch, seq, hidden]`."""
    return f"{t.dtype}[{', '.join(t.dims)}]"


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def format_op(op: Op) -> str:
    """`out : f32[...] = kind(arg, ..., key=value, ...)`."""
    parts = list(op.args) + [f"{k}={_value(v)}" for k, v in op.attrs]
    return f"{op.out} : {format_type(op.type)} = {op.kind}({', '.join(parts)})"


def format_model(model: Model) -> str:
    """The model: dims, inputs, params with shapes, ops one per line, outputs."""
    alias = dict(model.dim_alias)
    lines = [f"model {model.name}"]
    dims = []
    for d, n in model.dims:
        dims.append(f"{d} = {n}" + (f" (renames {alias[d]})" if d in alias else ""))
    lines.append("  dims: " + ", ".join(dims))
    if model.blocks:
        lines.append("  blocks: " + " ".join(model.blocks))
    lines.append("inputs:")
    lines += [f"  {i.name} : {format_type(i.type)}" for i in model.inputs]
    total = 0
    sizes = dict(model.dims)
    lines.append("params:")
    for p in model.params:
        n = 1
        for d in p.type.dims:
            n *= sizes[d]
        total += n
        tied = f" tied to {p.tied_to}" if p.tied_to else ""
        lines.append(f"  {p.name} : {format_type(p.type)} = {p.init}{tied}")
    lines.append(f"  # {len(model.params)} tensors, {total} elements")
    lines.append("ops:")
    block = None
    for op in model.ops:
        if op.block != block:
            block = op.block
            lines.append(f"  # {block if block else '(top level)'}")
        lines.append("  " + format_op(op))
    lines.append("outputs:")
    for o in model.outputs:
        lines.append(f"  {o.name} = {o.value}" + ("  (loss)" if o.is_loss else ""))
    return "\n".join(lines) + "\n"


def format_parallel(par: Parallel, source: bool = False) -> str:
    """The parallel block, one SOAP statement per line: what was written, and the schedule that
    runs. source=True: as .par text that `load` reads back (braces, block ranges such as
    `layer[0..3] -> pipe 0`, commas between placements)."""
    mesh = ", ".join(f"{a} = {n}" for a, n in par.mesh)
    head = f"parallel {par.name} for {par.model} on mesh({mesh})"
    lines = [head + (" {" if source else f"  # {par.world_size} ranks")]
    for kind in ("sample", "attribute", "parameter"):
        pairs = getattr(par, kind)
        if pairs:
            # only a dim's first (outermost) split is balanced: a later one cuts its local order
            first = {d: i for i, (d, _) in reversed(list(enumerate(pairs)))}
            lines.append(f"  {kind:<9} " + ", ".join(
                f"{d} -> {a}" + (" balanced" if d in par.balanced and i == first[d] else "")
                for i, (d, a) in enumerate(pairs)))
    placed = []
    for st in par.operator:
        if source:
            placed += [f"{rep}[{lo}..{hi}] -> {st.axis} {st.stage}" if hi > lo else
                       f"{rep}[{lo}] -> {st.axis} {st.stage}" for rep, lo, hi in _runs(st.blocks)]
        else:
            placed.append(f"{', '.join(st.blocks)} -> {st.axis} {st.stage}")
    placed += [f"{b.value} -> {b.axis} {b.coord}" for b in par.branches]
    for i, item in enumerate(placed):
        comma = "," if source and i < len(placed) - 1 else ""
        lines.append(("  operator  " if i == 0 else "            ") + item + comma)
    # Stages always run a schedule, so it is printed for them even when unwritten.
    s = par.schedule
    if par.operator or par.schedule_written or s != Schedule():
        chunks = f", chunks = {s.chunks}" if s.kind in CHUNKED else ""
        lines.append(f"  schedule  {s.kind}, microbatches = {s.microbatches}{chunks}")
    if par.zero:
        lines.append(f"  zero      {par.zero}")
    if par.recompute:
        lines.append(f"  recompute {par.recompute}")
    if par.offload:
        lines.append(f"  offload   {par.offload}")
    if par.overlap:
        lines.append(f"  overlap   {par.overlap}")
    return "\n".join(lines + (["}"] if source else [])) + "\n"


def _runs(blocks: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(repeat, first, last) of each run of consecutive instances of one repeat."""
    runs: list[list] = []
    for b in blocks:
        rep, i = b.rsplit(".", 1)
        if runs and runs[-1][0] == rep and runs[-1][2] + 1 == int(i):
            runs[-1][2] = int(i)
        else:
            runs.append([rep, int(i), int(i)])
    return [tuple(r) for r in runs]


def to_data(obj) -> dict:
    """attrs IR -> plain dicts/lists (locations dropped), for JSON."""
    data = attrs.asdict(obj, filter=lambda a, v: a.name != "loc")
    if isinstance(obj, Parallel):
        data["world_size"] = obj.world_size
    return data
