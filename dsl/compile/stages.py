"""Operator-axis lowering: cut a model into pipeline stages and compile each one.

`split(model, parallel)` works on the IR: the parallel block's operator statements place
repeat blocks on pipe ranks; each maximal run of consecutive blocks on one rank is a *virtual
stage* (one per rank without interleaving, `chunks` per rank with it). Ops outside every
block go with their neighbours: those before the first block to the first stage, the rest
(final norm, head, loss) to the stage of the last block before them. Each virtual stage becomes
an ordinary `ir.Model` (a V schedule puts two stages on the last rank: its two operator
ranges there are two stages, `stage_runs`):

- inputs: the model inputs its ops read (every rank gets the batch, so targets go straight to
  the last stage and are never sent), plus the *boundary* values received from the stage
  before: every value made in an earlier stage and used in this one or a later one (a value
  skipping stages is relayed: an input and an output of each stage in between);
- params: those its ops use; one used by several stages is *shared* (tied embeddings), a copy
  per stage, gradients summed over the pipe axis;
- outputs: the boundary values for the next stage, or, on the last stage, the model outputs.

`lower_pipeline` compiles each stage model with `lower(stage, inner)` where `inner` is the
parallel block without the pipe axis and the batch dim is cut to one microbatch
(batch / microbatches), and checks that each boundary tensor has the same layout on both
sides (so a boundary is a plain p2p send, never a reshard). The received tensors are passed as
`grad_inputs`: their gradients leave the stage, so lowering's backward invariant covers them
(a replicated one feeding rank-varying work gets a `CopyTo`). The result is a `StageGraph`.

`resolve_ties` (dsl/compile/lower.py, re-exported here; `lower()` applies it too) turns
`Param.tied_to` into sharing: uses of a tied param become uses of its target (the single-rank
model and the pipelined one then agree by construction).
"""

from __future__ import annotations

import attrs

from soapstone.dsl.compile.lower import LoweringError, batch_dim, lower, resolve_ties
from soapstone.dsl.model import ir
from soapstone.shard.plan import schedules
from soapstone.shard.plan.schedules.placement import cut
from soapstone.shard.plan.stage_graph import Edge, Stage, StageGraph

__all__ = ["StageModel", "batch_dim", "check_pair", "inner_parallel", "lower_graph",
           "lower_pipeline", "resolve_ties", "split", "stage_runs"]


@attrs.frozen
class StageModel:
    """One virtual stage as IR: its index, pipe rank, chunk, blocks and sub-model."""

    index: int
    rank: int
    chunk: int
    blocks: tuple[str, ...]
    model: ir.Model
    data_inputs: tuple[str, ...]
    recv: tuple[str, ...]
    send: tuple[str, ...]


def stage_runs(model: ir.Model, parallel: ir.Parallel) -> list[tuple[int, tuple[str, ...]]]:
    """(pipe rank, blocks) of each virtual stage, in block order: a run of blocks on one rank,
    cut where the schedule's placement puts two stages on one rank (placement.cut)."""
    owner = {b: (a.stage, i) for i, a in enumerate(parallel.operator) for b in a.blocks}
    kind = schedules.get(parallel.schedule.kind)
    pipe = dict(parallel.mesh).get(parallel.operator[0].axis, 1) if parallel.operator else 1
    order = kind.ranks(pipe, kind.per_rank(parallel.schedule.chunks))
    at = cut([owner[b] for b in model.blocks], order)
    runs: list[tuple[int, list[str]]] = []
    for i, b in enumerate(model.blocks):
        if runs and at[i] == at[i - 1]:
            runs[-1][1].append(b)
        else:
            runs.append((owner[b][0], [b]))
    return [(r, tuple(bs)) for r, bs in runs]


def split(model: ir.Model, parallel: ir.Parallel) -> list[StageModel]:
    """The virtual stages of `model` under `parallel`'s operator statements (see module doc)."""
    model = resolve_ties(model)
    runs = stage_runs(model, parallel)
    stage_of_block = {b: i for i, (_, bs) in enumerate(runs) for b in bs}
    # Each op's stage: its block's, or (outside blocks) the stage of the last block before it.
    op_stage: list[int] = []
    current = 0
    for op in model.ops:
        if op.block is not None:
            current = stage_of_block[op.block]
        op_stage.append(current)
    nstages = len(runs)
    made_in: dict[str, int] = {op.out: s for op, s in zip(model.ops, op_stage, strict=True)}
    used_in: dict[str, set[int]] = {}
    for op, s in zip(model.ops, op_stage, strict=True):
        for a in op.args:
            used_in.setdefault(a, set()).add(s)
    last = nstages - 1
    for o in model.outputs:
        used_in.setdefault(o.value, set()).add(last)
    # crossing[s]: values made at or before stage s and used after it, in op order
    crossing: list[list[str]] = [[] for _ in range(nstages)]
    for op in model.ops:
        src = made_in[op.out]
        latest = max(used_in.get(op.out, {src}))
        for s in range(src, latest):
            crossing[s].append(op.out)
    op_type = {op.out: op.type for op in model.ops}
    inputs = {i.name: i for i in model.inputs}
    params = {p.name: p for p in model.params}
    chunk_count: dict[int, int] = {}
    out = []
    for s, (rank, blocks) in enumerate(runs):
        ops = tuple(op for op, st in zip(model.ops, op_stage, strict=True) if st == s)
        args = {a for op in ops for a in op.args}  # a set: membership below, per name
        recv = tuple(crossing[s - 1]) if s > 0 else ()
        send = tuple(crossing[s]) if s < last else ()
        data_inputs = tuple(n for n in inputs if n in args or (s == last and any(
            o.value == n for o in model.outputs)))
        stage_inputs = tuple(inputs[n] for n in data_inputs) + tuple(
            ir.Input(n, op_type[n]) for n in recv)
        stage_params = tuple(p for n, p in params.items() if n in args)
        outputs = tuple(ir.Output(n, n, False) for n in send) if s < last else \
            tuple(o for o in model.outputs if made_in.get(o.value, last) == last
                  or o.value in recv or o.value in inputs)
        sub = attrs.evolve(model, name=f"{model.name}.stage{s}", inputs=stage_inputs,
                           params=stage_params, ops=ops, outputs=outputs, blocks=blocks)
        chunk = chunk_count.get(rank, 0)
        chunk_count[rank] = chunk + 1
        out.append(StageModel(s, rank, chunk, blocks, sub, data_inputs, recv, send))
    return out


def inner_parallel(parallel: ir.Parallel) -> ir.Parallel:
    """The parallel block without its pipe axis, operator and schedule statements."""
    axis = parallel.operator[0].axis
    return attrs.evolve(parallel, mesh=tuple((a, n) for a, n in parallel.mesh if a != axis),
                        operator=(), schedule=ir.Schedule())


def check_pair(model: ir.Model, parallel: ir.Parallel | None) -> None:
    """LoweringError unless `model` is a checked model and `parallel` None or a parallel block
    written for it: another model's block would lower silently where their dims agree."""
    if not isinstance(model, ir.Model):
        raise LoweringError.at(f"model: {type(model).__name__} {model!r} is no checked model",
                               None, hint="pass spec.model(NAME) (spec = soapstone.dsl.load)")
    if parallel is not None and not isinstance(parallel, ir.Parallel):
        raise LoweringError.at(f"parallel: {type(parallel).__name__} {parallel!r} is no "
                               "parallel block", None,
                               hint="pass spec.parallel(NAME), or None for one rank")
    if parallel is not None and parallel.model != model.name:
        raise LoweringError.at(f"parallel block '{parallel.name}' is for model "
                               f"{parallel.model}, not {model.name}", parallel.loc,
                               hint=f"pass spec.model('{parallel.model}'), or a parallel "
                               f"block written for {model.name}")


def lower_graph(model: ir.Model, parallel: ir.Parallel | None = None) -> StageGraph:
    """Compile any layout (None: one rank) into the StageGraph the executor runs: a pipeline
    layout's stages, else one stage holding lower()'s Program. Without stages, the schedule's
    microbatches are gradient accumulation: the Program is compiled for one microbatch."""
    check_pair(model, parallel)
    if parallel is not None and parallel.operator:
        return lower_pipeline(model, parallel)
    sched = parallel.schedule if parallel is not None else ir.Schedule()
    bdim, dims = _microbatch_dims(model, parallel, sched.microbatches)
    program = lower(attrs.evolve(model, dims=dims), parallel)
    stage = Stage(0, 0, 0, tuple(model.blocks), program, program.inputs, (), ())
    return StageGraph(
        model=model.name, parallel=parallel.name if parallel else None,
        mesh=parallel.mesh if parallel else (), axis=None, stages=(stage,), edges=(),
        schedule=sched.kind, microbatches=sched.microbatches, chunks=1, batch_dim=bdim,
        batch=model.size(bdim) if bdim else 0)


def _microbatch_dims(model: ir.Model, parallel: ir.Parallel | None, mb: int):
    """(batch dim, the model's dims with the batch dim cut to one of `mb` microbatches)."""
    bdim = batch_dim(model, parallel)
    if mb == 1:
        return bdim, model.dims
    loc = parallel.loc if parallel is not None else model.loc
    if bdim is None:
        raise LoweringError.at(f"model {model.name} has no batched input to cut into "
                               "microbatches", loc)
    batch = model.size(bdim)
    if batch % mb:
        raise LoweringError.at(f"microbatches = {mb} does not divide {bdim} = {batch}", loc)
    return bdim, tuple((d, n // mb if d == bdim else n) for d, n in model.dims)


def lower_pipeline(model: ir.Model, parallel: ir.Parallel) -> StageGraph:
    """Compile a pipeline layout: split, lower every stage for one microbatch, link them."""
    check_pair(model, parallel)
    if not parallel.operator:
        raise LoweringError.at(f"parallel block '{parallel.name}' has no operator statement",
                               parallel.loc, hint="use lower() for layouts without stages")
    axis = parallel.operator[0].axis
    sched = parallel.schedule
    mb = sched.microbatches
    bdim, dims = _microbatch_dims(model, parallel, mb)
    batch = model.size(bdim) if bdim else 0
    inner = inner_parallel(parallel)
    stages: list[Stage] = []
    for sm in split(model, parallel):
        # received tensors send their gradients back: lowering keeps them replicated too
        program = lower(attrs.evolve(sm.model, dims=dims), inner,
                        grad_inputs=frozenset(sm.recv), send=frozenset(sm.send))
        program = attrs.evolve(program, model=model.name, parallel=parallel.name)
        stages.append(Stage(sm.index, sm.rank, sm.chunk, sm.blocks, program, sm.data_inputs,
                            sm.recv, sm.send))
    edges = []
    for a, b in zip(stages, stages[1:], strict=False):
        tensors = []
        sent = {o.name: o.value for o in a.program.outputs}
        for name in a.send:
            # the value that leaves (redistributed to the receiver's layout), under its name
            out = attrs.evolve(a.program.value(sent[name]), name=name)
            into = b.program.value(name)
            if out.layout != into.layout or out.local_shape != into.local_shape:
                raise LoweringError.at(
                    f"{name} leaves stage {a.index} laid out as {{{out.layout}}} "
                    f"{list(out.local_shape)} but stage {b.index} expects {{{into.layout}}} "
                    f"{list(into.local_shape)}; boundary resharding is not supported",
                    parallel.loc, hint="move the stage boundary, or map the boundary "
                    "tensor's dims so that it leaves its stage in the input layout")
            tensors.append(out)
        edges.append(Edge(a.index, b.index, a.rank, b.rank, tuple(tensors)))
    users: dict[str, list[int]] = {}
    for s in stages:
        for p in s.program.params:
            users.setdefault(p.name, []).append(s.index)
    shared = tuple((n, tuple(w)) for n, w in users.items() if len(w) > 1)
    return StageGraph(
        model=model.name, parallel=parallel.name, mesh=parallel.mesh, axis=axis,
        stages=tuple(stages), edges=tuple(edges), schedule=sched.kind,
        microbatches=mb, chunks=sched.chunks, batch_dim=bdim, batch=batch, shared=shared,
        unread=tuple(i.name for i in model.inputs
                     if not any(i.name in s.data_inputs for s in stages)))

