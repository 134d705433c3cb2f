"""The layouts `soapstone plan` searches: which dims a layout maps, and the candidates of a
model on N devices.

The space (`candidates`): data x tensor x pipeline degrees whose product is N, tensor parallel
inside a node (at most `devices_per_node`), with or without sequence parallelism on the tensor
axis, context parallelism (the sequence dims over their own axis `cp`, inside the node beside
the tensor axis, only where the batch does not divide over as many data ranks: otherwise data
parallelism does the same work without gathering keys and values), pipeline schedules (1f1b and
interleaved with 2 or 4 virtual stages per rank; gpipe keeps every microbatch in flight for the
same bubble, so 1f1b always beats it), the microbatches by count and by size (1, 2, 4 or 8
samples), ZeRO 0-3, and activation recompute
(`recompute_options`: `recompute R` for the model's largest repeat; `search` tries it as it
tries a ZeRO stage, where no stage fits without it or below the stage that does). The mesh is
`mesh(pipe, data, cp, model)`: the tensor axis innermost (inside a node), data next, the
pipeline outermost (seed 004: the chattiest parallelism on the fastest links). Which dims each
statement maps (`layout_dims`): `sample` the batch (the inputs' leading dim); `parameter` the
parameter dims that are neither input dims nor dims of the residual stream between blocks,
largest first, never two of one parameter (for a GPT: ffn, heads, vocab: Megatron's split;
for a mixture of experts the experts dim: expert parallelism over the tensor axis, or over
the data axis where the candidate says so), never a
derived dim that renames another (the router's copy of the experts dim stays whole);
`attribute` the other input dims on the tensor axis (sequence parallelism), over cp first under
context parallelism (then the tensor axis cuts each cp piece again).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import attrs

from soapstone.comm.errors import UserError
from soapstone.dsl.model import ir
from soapstone.shard.ops.einsum import FLOAT8_MULTIPLE
from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis.hardware import Profile
from soapstone.shard.plan.sizes import divisors

# (schedule, chunks) the search tries for a pipeline: each schedule's own `planned`
SCHEDULES = tuple((k.name, v) for k in schedules.SCHEDULES.values() for v in k.planned)


class PlanError(UserError, ValueError):
    """No layout of the model fits the devices (or the request cannot be planned)."""


# ---- what the statements map -------------------------------------------------------------


@attrs.frozen
class LayoutDims:
    """The dims a planned layout maps: the batch, the tensor-parallel dims, the sequence dims,
    and the experts dims of the model's mixtures of experts (which may go over data instead)."""

    batch: str
    tensor: tuple[str, ...]
    sequence: tuple[str, ...]
    experts: tuple[str, ...] = ()


def layout_dims(model: ir.Model) -> LayoutDims:
    """Which dims `sample`, `parameter` and `attribute` map (module doc)."""
    if not model.inputs or not model.inputs[0].type.dims:
        raise PlanError(f"model {model.name} has no batched input to split over data "
                        "parallel ranks")
    batch = model.inputs[0].type.dims[0]
    inputs = {d for i in model.inputs for d in i.type.dims}
    stream = _stream_dims(model)
    # a derived dim that renames another (the router's experts_r, seq_k) exists to stay whole
    # where the dim it renames is split: never a dim to map
    renames = dict(model.dim_alias)
    sizes = dict(model.dims)
    touched: dict[str, int] = {}
    for p in model.params:
        n = math.prod(sizes[d] for d in p.type.dims)
        for d in p.type.dims:
            if d not in inputs and d not in stream and d not in renames:
                touched[d] = touched.get(d, 0) + n
    # a dim two activations contract (attention's head_dim in q.k) would make the product a
    # partial sum to allreduce: such dims come last
    params = {p.name for p in model.params}
    shape = {op.out: op.type.dims for op in model.ops} | {i.name: i.type.dims
                                                          for i in model.inputs}
    poor = {d for op in model.ops if op.kind == "einsum" and not params & set(op.args)
            for a in op.args for d in shape.get(a, ()) if d not in op.type.dims}
    tensor: list[str] = []
    for d in sorted(touched, key=lambda d: (d in poor, -touched[d], d)):
        if not any(d in p.type.dims and any(t in p.type.dims for t in tensor)
                   for p in model.params):
            tensor.append(d)
    sequence = tuple(d for d in model.inputs[0].type.dims[1:] if d != batch)
    experts = tuple(sorted({dict(op.attrs)["experts"] for op in model.ops if op.kind == "moe"}))
    return LayoutDims(batch, tuple(tensor), sequence, experts)


def _stream_dims(model: ir.Model) -> set[str]:
    """Dims of values that cross from one block (or the top level) into a later block."""
    where = {op.out: op.block for op in model.ops}
    dims = {op.out: op.type.dims for op in model.ops}
    out: set[str] = set()
    for op in model.ops:
        for a in op.args:
            if a in where and where[a] != op.block:
                out.update(dims[a])
    return out


def recompute_options(model: ir.Model) -> tuple[str, ...]:
    """The `recompute` forms the search tries, the cheapest in forward work first: `recompute
    R` for the repeat with the most blocks (R: its name); none for a model without repeats."""
    counts = Counter(b.rsplit(".", 1)[0] for b in model.blocks)
    return (max(counts, key=counts.get),) if counts else ()


# ---- candidates --------------------------------------------------------------------------


@attrs.frozen
class Candidate:
    """One point of the space: degrees, schedule, microbatches, ZeRO, sequence parallelism
    (Megatron's, on the tensor axis), context parallelism (the sequence over its own axis),
    activation recompute (the `recompute` statement's argument, or None), and a mixture of
    experts' experts over the data axis (DeepSpeed-MoE: tokens travel to their experts' ranks
    by alltoall) instead of the tensor axis."""

    data: int
    tensor: int
    pipe: int
    sequence: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    context: int = 1
    recompute: str | None = None
    experts_on_data: bool = False
    # `overlap tensor` (with sequence parallelism): collective matmuls, AsyncTP
    overlap: bool = False

    @property
    def label(self) -> str:
        """A short name: d8 t8+sp p64 1f1b m96 z1 (c2 after t: context parallel 2; rc at the
        end: recompute; d8+ep: the experts over the data axis)."""
        parts = [f"d{self.data}" + ("+ep" if self.experts_on_data else ""),
                 f"t{self.tensor}" + ("+sp" if self.sequence else "")
                 + ("+async" if self.overlap else ""),
                 f"p{self.pipe}"]
        if self.context > 1:
            parts.insert(2, f"c{self.context}")
        if self.pipe > 1:
            parts.append(self.schedule + (f"x{self.chunks}" if self.chunks > 1 else ""))
        if self.microbatches > 1:
            parts.append(f"m{self.microbatches}")
        parts.append(f"z{self.zero}")
        if self.recompute:
            parts.append("rc")
        return " ".join(parts)

    @property
    def stages(self) -> int:
        """Virtual stages."""
        return self.pipe * self.chunks

    def rank_of(self, stage: int) -> int:
        """The pipe rank of virtual stage `stage` (its schedule's placement)."""
        return schedules.get(self.schedule).rank_of(stage, self.pipe)


def stage_blocks(blocks: tuple[str, ...], stages: int) -> list[tuple[str, ...]]:
    """`blocks` cut into `stages` contiguous runs, as even as they go (the extra blocks on the
    stages after the first: the first holds the embedding, the last the head)."""
    base, extra = divmod(len(blocks), stages)
    sizes = [base] * stages
    for i in range(extra):
        sizes[1 + i % max(stages - 1, 1) if stages > 1 else 0] += 1
    out, at = [], 0
    for n in sizes:
        out.append(blocks[at:at + n])
        at += n
    return out


def layout_mesh(c: Candidate) -> tuple[tuple[str, int], ...]:
    """The candidate's mesh: pipe, data, cp, model, outermost first (axes of 1 left out)."""
    return tuple((a, n) for a, n in (("pipe", c.pipe), ("data", c.data), ("cp", c.context),
                                     ("model", c.tensor)) if n > 1) or (("data", 1),)


def layout_schedule(c: Candidate) -> ir.Schedule:
    """The candidate's schedule: its own over stages, else 1F1B accumulation or none."""
    if c.pipe > 1:
        return ir.Schedule(c.schedule, c.microbatches, c.chunks)
    return ir.Schedule("1f1b", c.microbatches, 1) if c.microbatches > 1 else ir.Schedule()


@attrs.frozen
class PipelineShape:
    """What combine_pipeline reads of a layout (a StageGraph's fields), without compiling."""

    model: str
    parallel: str
    mesh: tuple[tuple[str, int], ...]
    axis: str | None
    schedule: str
    microbatches: int
    chunks: int

    @property
    def pipe(self) -> int:
        """The pipeline degree."""
        return dict(self.mesh).get(self.axis, 1) if self.axis else 1

    @property
    def world_size(self) -> int:
        """The ranks of the mesh."""
        return math.prod(n for _, n in self.mesh)


def pipeline_shape(model: str, c: Candidate, name: str = "planned") -> PipelineShape:
    """What `to_parallel` of model `model` (its name) and `c` gives combine_pipeline, without
    building its stage assignment of every block (the probed cost needs only this)."""
    sched = layout_schedule(c)
    return PipelineShape(model, name, layout_mesh(c), "pipe" if c.pipe > 1 else None,
                         sched.kind, sched.microbatches, sched.chunks)


def to_parallel(model: ir.Model, dims: LayoutDims, c: Candidate,
                name: str = "planned") -> ir.Parallel:
    """The candidate as a parallel block of `model`."""
    mesh = layout_mesh(c)
    sizes = dict(model.dims)
    over_data = dims.experts if c.experts_on_data else ()
    tensor = tuple((d, "model") for d in dims.tensor
                   if sizes[d] % c.tensor == 0 and d not in over_data) if c.tensor > 1 else ()
    tensor += tuple((d, "data") for d in over_data)
    # context parallel cuts the sequence over cp; sequence parallelism then cuts each cp
    # piece over the tensor axis (a dim over two axes, nested in mesh order)
    seq = tuple((d, "cp") for d in dims.sequence) if c.context > 1 else ()
    seq += tuple((d, "model") for d in dims.sequence) if c.sequence else ()
    balanced: tuple[str, ...] = ()
    if c.context > 1:
        # causal attention's work evened out over the cp ranks (zigzag chunks), as
        # Megatron's and torchtitan's context parallelism; sequence parallel then cuts each
        # cp rank's concatenated chunks over the tensor axis
        balanced = tuple(d for d in dims.sequence if model.causal_over(d)
                         and sizes[d] % (2 * c.context) == 0)
    operator: tuple[ir.StageAssignment, ...] = ()
    if c.pipe > 1:
        runs = stage_blocks(model.blocks, c.stages)
        operator = tuple(ir.StageAssignment(run, "pipe", c.rank_of(i))
                         for i, run in enumerate(runs))
    schedule = layout_schedule(c)
    return ir.Parallel(name, model.name, mesh,
                       sample=((dims.batch, "data"),) if c.data > 1 else (),
                       attribute=seq, parameter=tensor, operator=operator,
                       schedule=schedule, zero=c.zero, recompute=c.recompute,
                       balanced=balanced, overlap="tensor" if c.overlap else None)


# microbatch sizes (samples per microbatch) the search tries besides its counts: a bigger
# microbatch runs bigger kernels and fewer of them; a smaller one holds fewer activations and,
# in a pipeline, shrinks the bubble
MICROBATCH_SIZES = (1, 2, 4, 8)


def _microbatch_options(per_replica: int, pipe: int) -> list[int]:
    """Microbatch counts to try, by count and by size: without stages 1 (and accumulation, for
    memory) up to 32; with stages pipe x 1, 2, 4, 8, and what divides below that; and the
    counts of the microbatch sizes MICROBATCH_SIZES that divide the replica's batch. Tests of
    divisibility, never a walk over 1..per_replica (any batch is cheap)."""
    by_size = {per_replica // s for s in MICROBATCH_SIZES if per_replica % s == 0}
    if pipe == 1:
        return sorted({1 << k for k in range(6) if per_replica % (1 << k) == 0} | by_size)
    want = {pipe * k for k in (1, 2, 4, 8)} | {per_replica}
    opts = [d for d in want if per_replica % d == 0]
    below = next((d for d in range(min(pipe, per_replica + 1) - 1, 0, -1)
                  if per_replica % d == 0), None)  # pipe <= the model's blocks: short
    if below:
        opts.append(below)
    return sorted(set(opts) | by_size)


@attrs.frozen
class Rejection:
    """Why a part of the space was left out (for the table and the no-fit message)."""

    what: str
    why: str


def candidates(model: ir.Model, dims: LayoutDims, world: int, profile: Profile,
               rejected: list[Rejection]) -> Iterator[Candidate]:
    """Every structurally valid candidate (divisibility, blocks, schedules), in a fixed order;
    the combinations that do not divide are recorded in `rejected`."""
    sizes = dict(model.dims)
    batch, nblocks = sizes[dims.batch], len(model.blocks)
    for t in divisors(world):
        if t > profile.devices_per_node and t > 1:
            rejected.append(Rejection(f"tensor {t}", f"larger than a node "
                                      f"({profile.devices_per_node} devices)"))
            continue
        if t > 1:
            split = [d for d in dims.tensor if sizes[d] % t == 0]
            if not split:
                rejected.append(Rejection(f"tensor {t}", "divides none of " + ", ".join(
                    f"{d} = {sizes[d]}" for d in dims.tensor) if dims.tensor else
                    "the model has no parameter dim to split"))
                continue
        seq_ok = t > 1 and bool(dims.sequence) and all(sizes[d] % t == 0 for d in dims.sequence)
        for cp, p in _context_pipe(dims, sizes, world, t, profile, rejected):
            d = world // (t * cp * p)
            if cp > 1 and batch % (d * cp) == 0:
                continue  # dominated: see _context_pipe
            if p > 1 and nblocks < p:
                rejected.append(Rejection(f"pipeline {p}", f"the model has {nblocks} repeat "
                                          "blocks" if nblocks else "the model has no repeat "
                                          "blocks to cut into stages"))
                continue
            if batch % d:
                rejected.append(Rejection(f"data {d}", f"{dims.batch} = {batch} does not "
                                          f"divide over {d}"))
                continue
            for m in _microbatch_options(batch // d, p):
                for sched, v in (SCHEDULES if p > 1 else (("1f1b", 1),)):
                    if v > 1 and (m % p or nblocks < p * v):
                        continue
                    # under cp, sequence parallel cuts each cp piece of the sequence again
                    sp_ok = seq_ok and all(sizes[d] % (t * cp) == 0 for d in dims.sequence)
                    # sequence parallel with and without collective matmuls (AsyncTP; not
                    # under a split backward, which runs a ring's backward in two parts)
                    rings = () if schedules.get(sched).split else ((True, True),)
                    for sp, ov in ((False, False), (True, False), *rings) if sp_ok \
                            else ((False, False),):
                        for ep in _experts_options(dims, sizes, d):  # ZeRO innermost:
                            for z in (range(4) if d * cp > 1 else (0,)):  # climbs it
                                yield Candidate(d, t, p, sp, z, sched, m, v, cp,
                                                experts_on_data=ep, overlap=ov)


def _experts_options(dims: LayoutDims, sizes: dict[str, int], data: int) -> tuple[bool, ...]:
    """Whether to try the experts over the data axis as well as on the tensor axis: where the
    model has experts and their count divides over the data ranks."""
    if data > 1 and dims.experts and all(sizes[e] % data == 0 for e in dims.experts):
        return (False, True)
    return (False,)


def _context_pipe(dims: LayoutDims, sizes: dict[str, int], world: int, tensor: int,
                  profile: Profile, rejected: list[Rejection]) -> Iterator[tuple[int, int]]:
    """(context, pipeline) degrees beside tensor parallel `tensor`. Context parallelism c
    holds the tokens, computes and reduces gradients as data parallelism c over the same
    devices would, and gathers keys and values every layer on top: the caller keeps it only
    where the batch does not divide over that many data ranks. It stays inside a node with the
    tensor axis (both innermost there), and only for sequence dims it divides."""
    for cp in divisors(world // tensor):
        if cp > 1:
            if not dims.sequence or tensor * cp > profile.devices_per_node:
                continue
            if any(sizes[d] % cp for d in dims.sequence):
                rejected.append(Rejection(f"context {cp}", "divides none of " + ", ".join(
                    f"{d} = {sizes[d]}" for d in dims.sequence)))
                continue
        for p in divisors(world // (tensor * cp)):
            yield cp, p


def float8_chunk_misfit(model: ir.Model, dims: LayoutDims, precision: str, c: Candidate) -> str:
    """Why `run --precision float8` would refuse candidate `c`'s rings ('' if it would not):
    a ring runs its float8 matmuls a 1/tensor chunk of the local tokens at a time, and
    torch._scaled_mm needs those rows a multiple of FLOAT8_MULTIPLE (ring_plan's refusal)."""
    if not (c.overlap and precision == "float8"):
        return ""
    sizes = dict(model.dims)
    batch = sizes[dims.batch] // (c.data * c.microbatches)
    seq = math.prod(sizes[d] for d in dims.sequence) // c.context
    rows = batch * seq // c.tensor
    if rows % FLOAT8_MULTIPLE == 0:
        return ""
    return (f"`overlap tensor` under float8 runs {rows} tokens a chunk; torch._scaled_mm needs "
            f"a multiple of {FLOAT8_MULTIPLE}")
