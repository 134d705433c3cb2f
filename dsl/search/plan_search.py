"""`soapstone plan`'s search: the layouts of a model on N devices, costed, fitted and ranked.

The space (`candidates`): data x tensor x pipeline degrees whose product is N, tensor parallel
inside a node (at most `devices_per_node`), with or without sequence parallelism on the tensor
axis, context parallelism (the sequence dims over their own axis `cp`, inside the node beside
the tensor axis, only where the batch does not divide over as many data ranks: otherwise data
parallelism does the same work without gathering keys and values), pipeline schedules (1f1b and
interleaved with 2 or 4 virtual stages per rank; gpipe keeps every microbatch in flight for the
same bubble, so 1f1b always beats it), the microbatch count, ZeRO 0-3, and activation recompute
(`recompute_options`: `recompute R` for the model's largest repeat; `search` tries it as it
tries a ZeRO stage, where no stage fits without it or below the stage that does). The mesh is
`mesh(pipe, data, cp, model)`: the tensor axis innermost (inside a node), data next, the
pipeline outermost (seed 004: the chattiest parallelism on the fastest links). Which dims each
statement maps (`layout_dims`): `sample` the batch (the inputs' leading dim); `parameter` the
parameter dims that are neither input dims nor dims of the residual stream between blocks,
largest first, never two of one parameter (for a GPT: ffn, heads, vocab: Megatron's split);
`attribute` the other input dims on the tensor axis (sequence parallelism).

Every candidate is costed from explain's Estimate (memory, communication) and the cost model
(shard/plan/analysis/cost.py). Compiling a 100-block model takes seconds, so a model whose repeat
blocks are all alike (the usual stack) is not compiled per candidate: `Probes` compile it
truncated to 1 and 2 blocks (and a 3-stage pipeline of 1 and 2 blocks per stage) for a local
microbatch of 1 and 2 samples, and every figure of a stage with n blocks and b samples is read
off them bilinearly (parameters, activations, collectives' calls and bytes, FLOPs are each
const + n x per-block, and linear in b). Not so the working set above the saved activations
(explain's transient, less ZeRO's buffers): a peak, at the last block's backward or the head,
so a stage of n >= 2 blocks has the 2-block probe's, and not linear in b, so it is walked on
the 1-sample probe with its batch dim scaled to b; with recompute the blocks' inputs it keeps
are in the saved bytes, which grow with n. Data-parallel degree and ZeRO stage do not change the
compiled Programs, only their estimate: the probes are compiled once on a data axis of 2 and
re-estimated on the candidate's; recompute does, so the probes are per recompute form.
tests/test_plan.py checks the extrapolation against a full compile. Other models (branching,
several repeats, fewer than 6 blocks) compile each layout.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator

import attrs

from soapstone.comm.errors import UserError
from soapstone.dsl.compile.lower import LoweringError
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.model import ir
from soapstone.dsl.model.irtext import format_parallel
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis.activations import activation_figures
from soapstone.shard.plan.analysis.cost import (
    BACKWARD_FACTOR,
    StepTime,
    Work,
    program_work,
    step_time,
)
from soapstone.shard.plan.analysis.explain import (
    EdgeFigures,
    Estimate,
    StageFigures,
    Traffic,
    combine_pipeline,
    estimate,
    estimate_pipeline,
    format_bytes,
)
from soapstone.shard.plan.analysis.hardware import Profile

# (schedule, chunks) the search tries for a pipeline: each schedule's own `planned`
SCHEDULES = tuple((k.name, v) for k in schedules.SCHEDULES.values() for v in k.planned)
PROBE_BLOCKS = 6  # a uniform model with at least this many blocks is probed, not compiled


class PlanError(UserError, ValueError):
    """No layout of the model fits the devices (or the request cannot be planned)."""


# ---- what the statements map -------------------------------------------------------------


@attrs.frozen
class LayoutDims:
    """The dims a planned layout maps: the batch, the tensor-parallel dims, the sequence dims."""

    batch: str
    tensor: tuple[str, ...]
    sequence: tuple[str, ...]


def layout_dims(model: ir.Model) -> LayoutDims:
    """Which dims `sample`, `parameter` and `attribute` map (module doc)."""
    if not model.inputs or not model.inputs[0].type.dims:
        raise PlanError(f"model {model.name} has no batched input to split over data "
                        "parallel ranks")
    batch = model.inputs[0].type.dims[0]
    inputs = {d for i in model.inputs for d in i.type.dims}
    stream = _stream_dims(model)
    sizes = dict(model.dims)
    touched: dict[str, int] = {}
    for p in model.params:
        n = math.prod(sizes[d] for d in p.type.dims)
        for d in p.type.dims:
            if d not in inputs and d not in stream:
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
    return LayoutDims(batch, tuple(tensor), sequence)


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
    and activation recompute (the `recompute` statement's argument, or None)."""

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

    @property
    def label(self) -> str:
        """A short name: d8 t8+sp p64 1f1b m96 z1 (c2 after t: context parallel 2; rc at the
        end: recompute)."""
        parts = [f"d{self.data}", f"t{self.tensor}" + ("+sp" if self.sequence else ""),
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


def to_parallel(model: ir.Model, dims: LayoutDims, c: Candidate,
                name: str = "planned") -> ir.Parallel:
    """The candidate as a parallel block of `model`."""
    mesh = tuple((a, n) for a, n in (("pipe", c.pipe), ("data", c.data), ("cp", c.context),
                                     ("model", c.tensor)) if n > 1) or (("data", 1),)
    sizes = dict(model.dims)
    tensor = tuple((d, "model") for d in dims.tensor if sizes[d] % c.tensor == 0) \
        if c.tensor > 1 else ()
    seq = tuple((d, "model") for d in dims.sequence) if c.sequence else ()
    if c.context > 1:
        seq = tuple((d, "cp") for d in dims.sequence)
    operator: tuple[ir.StageAssignment, ...] = ()
    schedule = ir.Schedule()
    if c.pipe > 1:
        runs = stage_blocks(model.blocks, c.stages)
        operator = tuple(ir.StageAssignment(run, "pipe", c.rank_of(i))
                         for i, run in enumerate(runs))
        schedule = ir.Schedule(c.schedule, c.microbatches, c.chunks)
    elif c.microbatches > 1:
        schedule = ir.Schedule("1f1b", c.microbatches, 1)
    return ir.Parallel(name, model.name, mesh,
                       sample=((dims.batch, "data"),) if c.data > 1 else (),
                       attribute=seq, parameter=tensor, operator=operator,
                       schedule=schedule, zero=c.zero, recompute=c.recompute)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_options(per_replica: int, pipe: int) -> list[int]:
    """Microbatch counts to try: without stages 1 (and accumulation, for memory); with stages
    pipe x 1, 2, 4, 8 and one sample per microbatch, and what divides below that."""
    divs = _divisors(per_replica)
    if pipe == 1:
        return [d for d in divs if d & (d - 1) == 0][:6]
    want = {pipe * k for k in (1, 2, 4, 8)} | {per_replica}
    opts = [d for d in divs if d in want]
    below = [d for d in divs if d < pipe]
    if below:
        opts.append(below[-1])
    return sorted(set(opts))


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
    for t in _divisors(world):
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
                    for sp in ((False, True) if seq_ok and cp == 1 else (False,)):
                        for z in (range(4) if d > 1 else (0,)):
                            yield Candidate(d, t, p, sp, z, sched, m, v, cp)


def _context_pipe(dims: LayoutDims, sizes: dict[str, int], world: int, tensor: int,
                  profile: Profile, rejected: list[Rejection]) -> Iterator[tuple[int, int]]:
    """(context, pipeline) degrees beside tensor parallel `tensor`. Context parallelism c
    holds the tokens, computes and reduces gradients as data parallelism c over the same
    devices would, and gathers keys and values every layer on top: the caller keeps it only
    where the batch does not divide over that many data ranks. It stays inside a node with the
    tensor axis (both innermost there), and only for sequence dims it divides."""
    for cp in _divisors(world // tensor):
        if cp > 1:
            if not dims.sequence or tensor * cp > profile.devices_per_node:
                continue
            if any(sizes[d] % cp for d in dims.sequence):
                rejected.append(Rejection(f"context {cp}", "divides none of " + ", ".join(
                    f"{d} = {sizes[d]}" for d in dims.sequence)))
                continue
        for p in _divisors(world // (tensor * cp)):
            yield cp, p


# ---- figures of a candidate --------------------------------------------------------------


Figs = dict[tuple, float]


def _figs(est: Estimate, work: Work, param_elements: int, working_set: int) -> Figs:
    """An estimate's additive figures as one flat dict (for extrapolation); a communicator's
    axes of size 1 are left out of its name (as a mesh without them would name it).
    `working_set` (the activation walk's peak above the saved bytes) is kept apart from the
    rest of the transient (ZeRO's full gradient buffers and gathered bucket), which grows with
    the blocks; under recompute, what the step would hold without it and the forward work run
    again come too."""
    f: Figs = {("param_bytes",): est.param_bytes, ("grad_bytes",): est.grad_bytes,
               ("optimizer_bytes",): est.optimizer_bytes,
               ("activation_bytes",): est.activation_bytes,
               ("transient_bytes",): est.transient_bytes - working_set,
               ("working_set",): working_set,
               ("flops",): work.matmul_flops, ("moved",): work.other_bytes, ("ops",): work.ops,
               ("param_elements",): param_elements}
    if est.without_recompute is not None:
        again = work.again or Work()
        f |= {("plain_saved",): est.without_recompute[0],
              ("plain_working_set",): est.without_recompute[1],
              ("again_flops",): again.matmul_flops, ("again_moved",): again.other_bytes,
              ("again_ops",): again.ops}
    for t in est.traffic:
        axis = ",".join(a for a in t.axis.split(",") if est.mesh.get(a, 1) > 1)
        for what, v in (("calls", t.calls), ("bytes", t.bytes)):
            f[(what, t.phase, t.kind, axis)] = f.get((what, t.phase, t.kind, axis), 0) + v
    return f


# Figures that are a step's peak, not a sum over blocks (module doc): Probes.working_set
# replaces their extrapolation
PEAKS = (("working_set",), ("plain_working_set",))


def _lin(*terms: tuple[float, Figs]) -> Figs:
    out: Figs = {}
    for k, f in terms:
        for key, v in f.items():
            out[key] = out.get(key, 0.0) + k * v
    return out


def _from_figs(f: Figs, model: str, mesh: dict[str, int], zero: int,
               optimizer: str) -> tuple[Estimate, Work, int]:
    g = {k: max(0, round(v)) for k, v in f.items()}
    traffic = [Traffic(k[1], k[2], k[3], g[k], g[("bytes", *k[1:])])
               for k in sorted(g) if k[0] == "calls" and (g[k] or g[("bytes", *k[1:])])]
    rc = ("again_flops",) in f
    est = Estimate(model, None, math.prod(mesh.values()), mesh, zero, optimizer,
                   g[("param_bytes",)], g[("grad_bytes",)], g[("optimizer_bytes",)],
                   g[("activation_bytes",)], traffic,
                   transient_bytes=g[("transient_bytes",)] + g[("working_set",)],
                   without_recompute=(g[("plain_saved",)], g[("plain_working_set",)])
                   if rc else None, recompute_flops=f[("again_flops",)] if rc else 0.0)
    again = Work(f[("again_flops",)], f[("again_moved",)], f[("again_ops",)]) if rc else None
    return est, Work(f[("flops",)], f[("moved",)], f[("ops",)], again), g[("param_elements",)]


def _remesh(program, data: int):
    mesh = tuple((a, data if a == "data" else n) for a, n in program.mesh)
    return attrs.evolve(program, mesh=mesh)


def _block_signature(model: ir.Model, i: int) -> tuple:
    me, prev = model.blocks[i] + ".", model.blocks[i - 1] + "."

    def norm(name: str) -> str:
        if name.startswith(me):
            return "@." + name[len(me):]
        return "^." + name[len(prev):] if name.startswith(prev) else name

    ops = tuple((op.kind, op.type, op.attrs, op.layer, op.shard, norm(op.out),
                 tuple(norm(a) for a in op.args))
                for op in model.ops if op.block == model.blocks[i])
    params = tuple((norm(p.name), p.type, p.init, p.tied_to) for p in model.params
                   if p.block == model.blocks[i])
    return ops, params


def _plain(program):
    """`program` as it runs without its `recompute` statement."""
    return attrs.evolve(program, recompute=())


def _with_batch(program, batch: str, b: int):
    """`program` (compiled for one sample per data rank) with its batch dim scaled to b
    samples: each value's local extent of that dim times b."""
    if b == 1:
        return program
    values = tuple(attrs.evolve(v, local_shape=tuple(
        n * b if d == batch else n for d, n in zip(v.dims, v.local_shape, strict=True)))
        if batch in v.dims else v for v in program.values)
    return attrs.evolve(program, values=values)


def uniform(model: ir.Model) -> bool:
    """Whether blocks 1.. are alike up to their names (block 0 reads the top level) and every
    value a block makes is named under it: the probes' premise."""
    if len(model.blocks) < PROBE_BLOCKS:
        return False
    if any(op.block is not None and not op.out.startswith(op.block + ".") for op in model.ops):
        return False
    made = {op.out: op.block for op in model.ops}
    inner = set(model.blocks[:-1])
    if any(made.get(a) in inner for op in model.ops if op.block is None for a in op.args) or \
            any(made.get(o.value) in inner for o in model.outputs):
        return False  # the top level reads only the last block
    first = _block_signature(model, 1)
    return all(_block_signature(model, i) == first for i in range(2, len(model.blocks)))


def truncate(model: ir.Model, k: int) -> ir.Model:
    """The model with its first k blocks (of a uniform model): what followed the last block
    reads the k-th block's values instead."""
    keep = set(model.blocks[:k])
    last, mine = model.blocks[-1] + ".", model.blocks[k - 1] + "."

    def rename(a: str) -> str:
        return mine + a[len(last):] if a.startswith(last) else a

    ops = tuple(attrs.evolve(op, args=tuple(rename(a) for a in op.args))
                for op in model.ops if op.block is None or op.block in keep)
    used = {a for op in ops for a in op.args}
    params = tuple(p for p in model.params if p.name in used)
    outputs = tuple(attrs.evolve(o, value=rename(o.value)) for o in model.outputs)
    return attrs.evolve(model, ops=ops, params=params, outputs=outputs,
                        blocks=model.blocks[:k])


class Probes:
    """One (tensor, sequence, context, recompute) setting's probe compiles and their
    re-estimates (module doc). `compiled` (kind, n, b) -> Program, filled on first use, may be
    shared with the same setting under another recompute form: its Programs are compiled
    under `recompute compiled_form`, and `recompute R` changes nothing of a Program but its
    recompute ranges, so the form without it is the same Program without them."""

    def __init__(self, model: ir.Model, dims: LayoutDims, tensor: int, sequence: bool,
                 optimizer: str, context: int = 1, recompute: str | None = None,
                 compiled: dict | None = None, compiled_form: str | None = None):
        if recompute not in (None, compiled_form):
            raise ValueError(f"probes of recompute {recompute} from {compiled_form}'s")
        self.optimizer = optimizer
        self.stage: dict[tuple, Figs] = {}
        self.programs: dict[tuple[str, int, int], object] = {}  # (kind, n, b) -> Program
        # (kind, n, b) -> the walk's figures, with and without recompute, and the work
        self.acts: dict[tuple[str, int, int], tuple] = {}
        self.cache: dict[tuple, tuple] = {}
        self.batch = dims.batch
        self.peaks: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self._model, self._dims = model, dims
        self._recompute = recompute
        self._compiled = {} if compiled is None else compiled
        self._one = Candidate(2, tensor, 1, sequence, context=context, recompute=compiled_form)
        # the mesh axes a stage's Program has (the pipe axis never)
        self.axes = {a for a, _ in to_parallel(model, dims, self._one).mesh}

    def program(self, kind: str, n: int, b: int):
        """The Program of a probe stage (compiled on first use: a search without stages
        never compiles the pipelines, nor one with only stages the single programs)."""
        if (kind, n, b) not in self.programs:
            prog = self._compile(kind, n, b)
            self.programs[kind, n, b] = prog if self._recompute else _plain(prog)
        return self.programs[kind, n, b]

    def _compile(self, kind: str, n: int, b: int):
        done = self._compiled
        if (kind, n, b) not in done:
            base = attrs.evolve(self._model, dims=tuple(
                (d, 2 * b if d == self._dims.batch else s) for d, s in self._model.dims))
            if kind == "only":
                par = to_parallel(base, self._dims, self._one)
                done[kind, n, b] = lower_graph(truncate(base, n), par).program
            else:
                three = truncate(base, 3 * n)
                pipe = to_parallel(three, self._dims, attrs.evolve(self._one, pipe=3))
                graph = lower_graph(three, pipe)
                for st, k in zip(graph.stages, ("first", "middle", "last"), strict=True):
                    done[k, n, b] = st.program
                e = graph.edges[1]
                done["edge", 1, b] = EdgeFigures(0, 1, 0, 1, len(e.tensors), e.nbytes,
                                                 sum(1 for t in e.tensors if t.is_float),
                                                 sum(t.nbytes for t in e.tensors
                                                     if t.is_float))
        return done[kind, n, b]

    def _at(self, kind: str, n: int, b: int, data: int, zero: int) -> Figs:
        key = (kind, n, b, data, zero)
        if key not in self.stage:
            prog = self.program(kind, n, b)
            if (kind, n, b) not in self.acts:  # the same for every data degree and ZeRO stage
                plain = activation_figures(_plain(prog)) if prog.recompute else None
                self.acts[kind, n, b] = (activation_figures(prog), plain, program_work(prog))
            acts, plain, work = self.acts[kind, n, b]
            est = estimate(_remesh(prog, data), zero, self.optimizer, activations=acts,
                           plain=plain)
            self.stage[key] = _figs(est, work, sum(math.prod(p.shape) for p in prog.params),
                                    acts[1])
        return self.stage[key]

    def figures(self, kind: str, n: int, b: int, data: int, zero: int) -> Figs:
        """A stage of `kind` (only | first | middle | last) with n blocks and b samples per
        microbatch per data rank, on `data` ranks under ZeRO `zero`: bilinear in (n, b); the
        b-slope (activations, tensor-parallel traffic, work) is the same for every data
        degree and ZeRO stage, so it is read at data 2, ZeRO 0. The PEAKS are not sums over
        blocks and not linear in b: they come from `working_set`."""
        f11, f21 = self._at(kind, 1, 1, data, zero), self._at(kind, 2, 1, data, zero)
        s1 = _lin((1, self._at(kind, 1, 2, 2, 0)), (-1, self._at(kind, 1, 1, 2, 0)))
        s2 = _lin((1, self._at(kind, 2, 2, 2, 0)), (-1, self._at(kind, 2, 1, 2, 0)))
        out = _lin((1, f11), (n - 1, f21), (1 - n, f11), (b - 1, s1), ((b - 1) * (n - 1), s2),
                   ((b - 1) * (1 - n), s1))
        for key, v in zip(PEAKS, self.working_set(kind, min(n, 2), b), strict=False):
            out[key] = v
        return out

    def working_set(self, kind: str, n: int, b: int) -> tuple[int, ...]:
        """The PEAKS of a stage of n <= 2 blocks and b samples: the walk of the b = 1 probe
        with its batch dim scaled to b (a peak is a max over the step: not linear in b);
        under recompute, without it too."""
        key = (kind, n, b)
        if key not in self.peaks:
            prog = _with_batch(self.program(kind, n, 1), self.batch, b)
            walks = (prog, _plain(prog)) if prog.recompute else (prog,)
            self.peaks[key] = tuple(activation_figures(p)[1] for p in walks)
        return self.peaks[key]

    def edge_at(self, b: int) -> EdgeFigures:
        """The boundary tensors per microbatch of b samples per data rank."""
        self._compile("middle", 1, 1)
        self._compile("middle", 1, 2)
        e1, e2 = self._compiled["edge", 1, 1], self._compiled["edge", 1, 2]
        return attrs.evolve(e1, nbytes=e1.nbytes + (b - 1) * (e2.nbytes - e1.nbytes),
                            float_bytes=e1.float_bytes + (b - 1) * (e2.float_bytes -
                                                                    e1.float_bytes))


@attrs.frozen
class _Shape:
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
        return dict(self.mesh).get(self.axis, 1) if self.axis else 1

    @property
    def world_size(self) -> int:
        return math.prod(n for _, n in self.mesh)


@attrs.frozen
class Result:
    """A costed candidate."""

    candidate: Candidate
    estimate: Estimate
    time: StepTime
    fits: bool
    memory: int  # the fullest device's bytes
    exact: bool  # from a full compile (else from the probes)
    work: tuple[Work, ...] = ()  # each pipe rank's forward work per microbatch

    @property
    def state_bytes(self) -> int:
        """The fullest device's parameters, gradients and optimizer state."""
        e = self.estimate
        return e.param_bytes + e.grad_bytes + e.optimizer_bytes

    @property
    def recompute_summary(self) -> str:
        """What recompute trades: "activations 61 GiB -> 9 GiB, +33% FLOPs" (the fullest
        pipe rank's saved bytes without and with it; the matmul FLOPs of a step, forward and
        backward, that running the blocks' forward again adds; '' without recompute)."""
        est = self.estimate
        if not self.candidate.recompute or est.without_recompute is None:
            return ""
        flops = sum(w.matmul_flops for w in self.work)
        again = sum(w.again.matmul_flops for w in self.work if w.again)
        return (f"activations {format_bytes(est.without_recompute[0])} -> "
                f"{format_bytes(est.activation_bytes)}, "
                f"+{again / (flops * (1 + BACKWARD_FACTOR)) if flops else 0:.0%} FLOPs")

    @property
    def comm_per_axis(self) -> dict[str, int]:
        """Bytes the fullest pipe rank sends per step, per mesh axis."""
        out: dict[str, int] = {}
        for t in self.estimate.traffic:
            out[t.axis] = out.get(t.axis, 0) + t.bytes
        return out


class Planner:
    """Costs candidates of one model on one profile (module doc)."""

    def __init__(self, model: ir.Model, profile: Profile, *, precision: str = "fp32",
                 optimizer: str = "adamw", exact: bool | None = None,
                 recompute: tuple[str, ...] | None = None):
        self.model, self.profile = model, profile
        self.precision, self.optimizer = precision, optimizer
        self.dims = layout_dims(model)
        # the recompute forms to try (default: recompute_options; () searches without)
        self.recompute = recompute_options(model) if recompute is None else recompute
        # the form that only adds recompute ranges (`recompute R`), compiled with the plain
        repeats = {b.rsplit(".", 1)[0] for b in model.blocks}
        self._ranges = next((f for f in self.recompute if f in repeats), None)
        self._compiled: dict[tuple, dict] = {}
        self.exact = not uniform(model) if exact is None else exact
        self._probes: dict[tuple[int, bool, int, str | None], Probes] = {}
        self._graphs: dict[Candidate, object] = {}

    def probes(self, tensor: int, sequence: bool, context: int = 1,
               recompute: str | None = None) -> Probes:
        """The probes of one tensor / sequence / context / recompute setting (compiled on
        first use)."""
        key = (tensor, sequence, context, recompute)
        if key not in self._probes:
            # without recompute and with `recompute R` the probes share their compiles
            form = recompute if recompute != self._ranges else None
            compiled = self._compiled.setdefault((tensor, sequence, context, form), {})
            self._probes[key] = Probes(self.model, self.dims, tensor, sequence, self.optimizer,
                                       context, recompute, compiled, form or self._ranges)
        return self._probes[key]

    def cost(self, c: Candidate, exact: bool | None = None) -> Result:
        """The candidate's estimate, step time and fit."""
        exact = self.exact if exact is None else exact
        est, work = self._exact(c) if exact else self._probed(c)
        t = step_time(est, work, self.profile, self.precision,
                      ("data",) if c.data > 1 else ())
        return Result(c, est, t, est.total_bytes <= self.profile.usable_bytes,
                      est.total_bytes, exact, tuple(work))

    def _exact(self, c: Candidate) -> tuple[Estimate, list[Work]]:
        key = attrs.evolve(c, zero=0)
        if key not in self._graphs:
            self._graphs[key] = lower_graph(self.model, to_parallel(self.model, self.dims, c))
        graph = self._graphs[key]
        est = estimate_pipeline(graph, c.zero, self.optimizer)
        work = [Work()] * graph.pipe
        for st in graph.stages:
            work[st.rank] = work[st.rank] + program_work(st.program)
        return est, work

    def _probed(self, c: Candidate) -> tuple[Estimate, list[Work]]:
        probes = self.probes(c.tensor, c.sequence, c.context, c.recompute)
        b = dict(self.model.dims)[self.dims.batch] // (c.data * c.microbatches)
        runs = stage_blocks(self.model.blocks, c.stages)
        s = len(runs)
        kinds = ["only"] if s == 1 else \
            ["first"] + ["middle"] * (s - 2) + ["last"]
        per_stage, stages, work = {}, [], [Work()] * c.pipe
        inner = {"data": c.data, "cp": c.context, "model": c.tensor}
        inner = {a: n for a, n in inner.items() if a in probes.axes}
        for i, (kind, run) in enumerate(zip(kinds, runs, strict=True)):
            key = (kind, len(run), b, c.data, c.zero)
            if key not in probes.cache:
                f = probes.figures(*key)
                probes.cache[key] = _from_figs(f, self.model.name, inner, c.zero, self.optimizer)
            est, w, elements = probes.cache[key]
            per_stage[i] = est
            stages.append(StageFigures(i, c.rank_of(i), run, elements))
            work[c.rank_of(i)] = work[c.rank_of(i)] + w
        edge = probes.edge_at(b)
        edges = [attrs.evolve(edge, src=i, dst=i + 1, src_rank=c.rank_of(i),
                              dst_rank=c.rank_of(i + 1)) for i in range(s - 1)]
        par = to_parallel(self.model, self.dims, c)
        shape = _Shape(self.model.name, par.name, par.mesh, "pipe" if c.pipe > 1 else None,
                       par.schedule.kind, par.schedule.microbatches, par.schedule.chunks)
        est = combine_pipeline(shape, per_stage, stages, edges, 0, c.zero, self.optimizer)
        return est, work


# ---- the search --------------------------------------------------------------------------


@attrs.define
class Plan:
    """The outcome: ranked fitting layouts, the best non-fitting ones, and why."""

    model: ir.Model
    dims: LayoutDims
    profile: Profile
    world: int
    ranked: list[Result]
    unfit: list[Result]
    rejected: list[Rejection]
    evaluated: int
    exact: bool

    @property
    def best(self) -> Result:
        """The winner."""
        return self.ranked[0]

    def parallel(self, name: str = "planned") -> ir.Parallel:
        """The winner as a parallel block."""
        return to_parallel(self.model, self.dims, self.best.candidate, name)

    def source(self, name: str = "planned") -> str:
        """The winner as .par text."""
        return format_parallel(self.parallel(name), source=True)

    def header(self) -> str:
        """What was planned, on what."""
        p = self.profile
        how = "each compiled" if self.exact else "extrapolated from probes of 1 and 2 blocks"
        return (f"plan {self.model.name} on {self.world} x {p.name} "
                f"({format_bytes(p.usable_bytes)} usable per device, {p.devices_per_node} per "
                f"node), {self.dims.batch} = {self.model.size(self.dims.batch)}\n"
                f"searched {self.evaluated} layouts ({how}): {len(self.ranked)} fit, "
                f"{len(self.unfit)} do not\n")

    def format(self, planner: Planner, top: int = 10, name: str = "planned",
               seconds: float | None = None) -> str:
        """The table, the reasons and the block (`soapstone plan`)."""
        out = [self.header()]
        rows = [("rank", "layout", "memory/dev", "step s", "bubble", "comm/step per axis",
                 "why")]
        for i, r in enumerate(self.ranked[:top]):
            rows.append((str(i + 1), r.candidate.label, format_bytes(r.memory),
                         f"{r.time.total:.4g}", f"{r.estimate.bubble:.0%}", _comm(r),
                         why(self, r)))
        for r in self.unfit[:max(1, top // 3)]:
            rows.append(("-", r.candidate.label, format_bytes(r.memory), f"{r.time.total:.4g}",
                         f"{r.estimate.bubble:.0%}", _comm(r),
                         f"does not fit: {format_bytes(r.memory)} > "
                         f"{format_bytes(self.profile.usable_bytes)}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
                       + "  " + row[-1] + "\n")
        out.append("\nwhy this layout (seed 004's order):\n")
        out += [f"  - {line}\n" for line in decisions(self, planner)]
        took = f" (planned in {seconds:.1f} s)" if seconds is not None else ""
        out.append(f"\nthe winner as a parallel block{took}:\n\n{self.source(name)}")
        return "".join(out)

    def to_data(self, planner: Planner, top: int = 10, name: str = "planned") -> dict:
        """`soapstone plan --json`."""
        def row(r: Result) -> dict:
            return {"layout": r.candidate.label, "candidate": attrs.asdict(r.candidate),
                    "fits": r.fits, "memory_bytes": r.memory, "step_time_s": r.time.total,
                    "time": r.time.to_data(), "bubble": r.estimate.bubble,
                    "comm_bytes_per_axis": r.comm_per_axis, "exact": r.exact,
                    "why": why(self, r) if r.fits else "does not fit"}

        return {"model": self.model.name, "world": self.world,
                "profile": self.profile.to_data(), "batch_dim": self.dims.batch,
                "global_batch": self.model.size(self.dims.batch),
                "evaluated": self.evaluated, "exact": self.exact,
                "ranked": [row(r) for r in self.ranked[:top]],
                "unfit": [row(r) for r in self.unfit[:top]],
                "decisions": decisions(self, planner), "parallel": self.source(name)}


def _comm(r: Result) -> str:
    return ", ".join(f"{a} {format_bytes(n)}" for a, n in sorted(r.comm_per_axis.items())) \
        or "none"


def search(planner: Planner, world: int) -> Plan:
    """Cost the space; keep what fits; rank by step time (PlanError if nothing fits).

    For each layout the ZeRO stages are tried from 0 up until one fits (a higher stage only
    adds communication), and the microbatch counts without stages from 1 up likewise
    (accumulation only saves memory). Recompute is tried as a ZeRO stage is, after them:
    where no stage fits without it, or below the stage that does (it runs more forward work,
    so at that stage or above it can only be slower)."""
    rejected: list[Rejection] = []
    fits: list[Result] = []
    unfit: list[Result] = []
    n = 0
    done: set[tuple] = set()  # fits without recompute: more microbatches only cost time
    floor: dict[tuple, int] = {}  # (group, form) -> the lowest ZeRO stage it fit at

    def climb(ladder: list[Candidate], costed: dict[int, Result]) -> int | None:
        """Cost the ladder's ZeRO stages from the lowest until one fits: its stage, or None.
        A stage whose parameter state alone overflows in `costed` (the same layout without
        recompute) is skipped: recompute saves activations only."""
        nonlocal n
        for c in ladder:
            was = costed.get(c.zero)
            if was and was.state_bytes > planner.profile.usable_bytes:
                continue
            try:
                r = planner.cost(c)
            except LoweringError as e:  # a layout the compiler refuses (no sharding of an op)
                rejected.append(Rejection(c.label, e.diagnostics[0].message))
                continue
            n += 1
            costed[c.zero] = r
            (fits if r.fits else unfit).append(r)
            if r.fits:
                return c.zero
        return None

    found = candidates(planner.model, planner.dims, world, planner.profile, rejected)
    for _, same in itertools.groupby(found, key=lambda c: attrs.evolve(c, zero=0)):
        ladder = list(same)
        c = ladder[0]
        group = (c.data, c.tensor, c.pipe, c.sequence, c.context, c.schedule, c.chunks) + \
            ((c.microbatches,) if c.pipe > 1 else ())
        if group in done:
            continue
        plain: dict[int, Result] = {}
        top = climb(ladder, plain)
        if top is not None:
            done.add(group)
        top = 4 if top is None else top
        for form in planner.recompute:  # the cheapest in compute first
            below = min(top, floor.get((group, form), 4))
            z = climb([attrs.evolve(x, recompute=form) for x in ladder if x.zero < below],
                      dict(plain))
            if z is not None:
                floor[group, form] = min(z, floor.get((group, form), 4))
                top = min(top, z)  # a costlier form pays only below it
    if not fits:
        raise PlanError(no_fit_message(planner, world, unfit, rejected))
    fits.sort(key=lambda r: (r.time.total, r.memory))
    unfit.sort(key=lambda r: r.memory)
    return Plan(planner.model, planner.dims, planner.profile, world, fits, unfit, rejected,
                n, planner.exact)


def no_fit_message(planner: Planner, world: int, unfit: list[Result],
                   rejected: list[Rejection]) -> str:
    """Why no layout of `world` devices works: memory (the least the best one needs) or
    divisibility (what does not divide)."""
    prof = planner.profile
    lines = [f"no layout of {planner.model.name} fits {world} x {prof.name}"]
    if unfit:
        r = min(unfit, key=lambda r: r.memory)
        lines.append(f"memory: the smallest layout ({r.candidate.label}) needs "
                     f"{format_bytes(r.memory)} per device, the profile holds "
                     f"{format_bytes(prof.usable_bytes)} ({prof.usable_fraction:.0%} of "
                     f"{format_bytes(prof.memory_bytes)})")
    seen = set()
    for rej in rejected:
        if (rej.what, rej.why) not in seen:
            seen.add((rej.what, rej.why))
            lines.append(f"{rej.what}: {rej.why}")
    return "\n  ".join(lines)


# ---- reasons -----------------------------------------------------------------------------


def why(plan: Plan, r: Result) -> str:
    """One table row's reason: what dominates its step time."""
    t = r.time
    parts = {"compute": t.compute, "tensor comm": t.blocking_comm, "bubble": t.bubble,
             "grad sync": t.grad_sync + t.after_step, "optimizer": t.optimizer}
    top = max(parts, key=parts.get)
    share = parts[top] / t.total if t.total else 0
    rc = f"; recompute: {r.recompute_summary}" if r.candidate.recompute else ""
    if r is plan.best:
        return f"fastest; {top} {share:.0%} of the step{rc}"
    slower = t.total / plan.best.time.total - 1
    return f"{slower:+.0%} vs best; {top} {share:.0%}{rc}"


def _versus(plan: Plan, what: str, keep) -> str:
    """How the best layout that differs from the winner as `keep` selects fares: slower by
    how much, or how much memory it would need."""
    best = plan.best
    fits = [r for r in plan.ranked if keep(r.candidate)]
    if fits:
        r = fits[0]
        return (f"the best with {what} ({r.candidate.label}) is "
                f"{r.time.total / best.time.total - 1:.0%} slower")
    unfit = [r for r in plan.unfit if keep(r.candidate)]
    if unfit:
        r = min(unfit, key=lambda r: r.memory)
        return (f"with {what} nothing fits (the smallest, {r.candidate.label}, needs "
                f"{format_bytes(r.memory)})")
    return f"no layout with {what} divides"


def decisions(plan: Plan, planner: Planner) -> list[str]:
    """The winner explained in seed 004's order (tensor parallel until a layer fits, pipeline
    until the model fits, data parallel for the rest), each against the best layout that
    decides otherwise."""
    best, prof, c = plan.best, plan.profile, plan.best.candidate
    model, usable = plan.model, prof.usable_bytes
    sizes = dict(model.dims)
    state = 16 if planner.optimizer == "adamw" else 12  # f32 param + grad + state, per element
    layer = _block_elements(model) * state
    total = sum(math.prod(sizes[d] for d in p.type.dims) for p in model.params) * state
    out = []
    if c.tensor > 1:
        split = ", ".join(d for d, _ in plan.parallel().parameter)
        seq = f" + sequence {', '.join(plan.dims.sequence)}" if c.sequence else ""
        out.append(f"tensor parallel {c.tensor} ({split}{seq}): one block's weights, grads "
                   f"and optimizer state are {format_bytes(layer)} "
                   f"({format_bytes(layer / c.tensor)} per device with {c.tensor}); "
                   + _versus(plan, f"tensor < {c.tensor}", lambda x: x.tensor < c.tensor)
                   + f"; kept inside a node of {prof.devices_per_node} (links "
                   f"{prof.intra_node.bandwidth / 1e9:.0f} GB/s, between nodes "
                   f"{prof.inter_node.bandwidth / 1e9:.0f} GB/s)")
    else:
        out.append(f"tensor parallel 1: one block's state is {format_bytes(layer)}; "
                   + _versus(plan, "tensor > 1", lambda x: x.tensor > 1))
    if c.context > 1:
        seqs = ", ".join(plan.dims.sequence)
        out.append(f"context parallel {c.context} ({seqs} over its own axis, beside the tensor "
                   f"axis inside a node): each device holds 1/{c.context} of every activation "
                   "and gathers keys and values per layer; "
                   + _versus(plan, "no context parallelism", lambda x: x.context == 1))
    where = "across nodes" if c.tensor * c.context * c.pipe > prof.devices_per_node \
        else "inside a node"
    if c.pipe > 1:
        chunks = f", {c.chunks} virtual stages per rank" if c.chunks > 1 else ""
        out.append(f"pipeline {c.pipe} ({c.schedule}{chunks}, {c.microbatches} microbatches, "
                   f"bubble {best.estimate.bubble:.0%}, {where}): the model's state is "
                   f"{format_bytes(total)}, {format_bytes(total / c.tensor)} per device with "
                   f"tensor {c.tensor} alone vs {format_bytes(usable)} usable; "
                   + _versus(plan, f"fewer than {c.pipe} stages", lambda x: x.pipe < c.pipe))
    else:
        out.append(f"pipeline 1: the model's state is {format_bytes(total / c.tensor)} per "
                   f"device with tensor {c.tensor}; "
                   + _versus(plan, "stages", lambda x: x.pipe > 1))
    if c.data > 1:
        z = ZeroStage.of(c.zero).summary
        lower = [r for r in plan.unfit if attrs.evolve(r.candidate, zero=c.zero) == c
                 and r.candidate.zero < c.zero]
        below = max(lower, key=lambda r: r.candidate.zero) if lower else None
        need = (f" (with ZeRO-{below.candidate.zero} it needs "
                f"{format_bytes(below.memory)})") if below else ""
        cp = f" x {c.context}" if c.context > 1 else ""
        out.append(f"data parallel {c.data}: the remaining {plan.world} / ({c.tensor}{cp} x "
                   f"{c.pipe}) devices replicate the {'pipeline' if c.pipe > 1 else 'model'}; "
                   f"{z}{need}")
    if c.recompute:
        out.append(f"recompute {c.recompute}: {best.recompute_summary}; each block keeps only "
                   "its inputs and backward runs its forward again; "
                   + _versus(plan, "no recompute", lambda x: x.recompute is None))
    t = best.time
    out.append(f"memory per device {format_bytes(best.memory)} of {format_bytes(usable)} "
               f"usable; step {t.total:.4g} s: compute {t.compute:.3g}, tensor comm "
               f"{t.blocking_comm:.3g}, bubble {t.bubble:.3g}, grad sync {t.grad_sync:.3g}, "
               f"after the step {t.after_step:.3g}, optimizer {t.optimizer:.3g}")
    return out


def _block_elements(model: ir.Model) -> int:
    sizes = dict(model.dims)
    if not model.blocks:
        return sum(math.prod(sizes[d] for d in p.type.dims) for p in model.params)
    b = model.blocks[0]
    return sum(math.prod(sizes[d] for d in p.type.dims) for p in model.params if p.block == b)
