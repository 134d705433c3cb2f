"""The probes of `soapstone plan`: a candidate's figures read off small compiles.

Every candidate is costed from explain's Estimate (memory, communication) and the cost model
(shard/plan/analysis/cost.py). Compiling a 100-block model takes seconds, so a model whose repeat
blocks are all alike (the usual stack) is not compiled per candidate: `Probes` compile it
truncated to 1 and 2 blocks (and a 3-stage pipeline of 1 and 2 blocks per stage) for a local
microbatch of 1 and 2 samples, and every figure of a stage with n blocks and b samples is read
off them bilinearly (parameters, activations, collectives' calls and bytes, FLOPs are each
const + n x per-block, and linear in b; with `overlap tensor`'s rings linear from 2 samples
on, read off probes of 2 and 3). Not so the working set above the saved activations
(explain's transient, less ZeRO's buffers): a peak, at the last block's backward or the head,
so a stage of n >= 2 blocks has the 2-block probe's, and not linear in b, so it is walked on
the 1-sample probe with its batch dim scaled to b; with recompute the blocks' inputs it keeps
are in the saved bytes, which grow with n. Data-parallel degree and ZeRO stage do not change the
compiled Programs, only their estimate: the probes are compiled once on a data axis of 2 and
re-estimated on the candidate's (with a mixture's experts over the data axis the shards do
depend on it: those probes are compiled on the candidate's data degree); recompute does, so
the probes are per recompute form. tests/dsl/search/test_plan_probes.py checks the extrapolation
against a full compile. Other models (branching, several repeats, fewer than 6 blocks) compile each
layout.
"""

from __future__ import annotations

import math

import attrs

from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.model import ir
from soapstone.dsl.search.space import Candidate, LayoutDims, to_parallel
from soapstone.shard.parallel.regather_plan import without_recompute
from soapstone.shard.parallel.ring_plan import find_rings
from soapstone.shard.plan.analysis.activations import (
    activation_figures,
    phase_figures,
    weight_grad_bytes,
)
from soapstone.shard.plan.analysis.cost import Work, program_work
from soapstone.shard.plan.analysis.explain import EdgeFigures, Estimate, Traffic, estimate
from soapstone.shard.plan.analysis.precision import graph_as_run, program_as_run
from soapstone.shard.plan.analysis.zero_memory import Beside, repeat_block, zero_beside

PROBE_BLOCKS = 6  # a uniform model with at least this many blocks is probed, not compiled


Figs = dict[tuple, float]


def _figs(est: Estimate, work: Work, param_elements: int) -> Figs:
    """An estimate's additive figures as one flat dict (for extrapolation); a communicator's
    axes of size 1 are left out of its name (as a mesh without them would name it).
    The working sets are peaks, not sums: `figures` sets them (WORKING) and ZeRO's buffers
    beside them (zero_memory.py); under recompute, what the step would hold without it and
    the forward work run again come too."""
    f: Figs = {("param_bytes",): est.param_bytes, ("grad_bytes",): est.grad_bytes,
               ("optimizer_bytes",): est.optimizer_bytes,
               ("activation_bytes",): est.activation_bytes,
               ("weight_grad_bytes",): est.weight_grad_bytes,
               ("param_elements",): param_elements} | _work_figs(work, "")
    if est.without_recompute is not None:
        f |= {("plain_saved",): est.without_recompute[0],
              ("plain_working_set",): est.without_recompute[1]}
        f |= _work_figs(work.again or Work(), "again_")
    for t in est.traffic:
        axis = ",".join(a for a in t.axis.split(",") if est.mesh.get(a, 1) > 1)
        for what, v in (("calls", t.calls), ("bytes", t.bytes)):
            key = (what, t.phase, t.kind, axis, t.prefetched)
            f[key] = f.get(key, 0) + v
    return f


# a Work's additive fields (all but `again`, which is a Work of its own, and `attention`,
# whose figures go by their keys: (prefix + "attention", keys, 1 or 2))
WORK_FIELDS = tuple(a.name for a in attrs.fields(Work) if a.name not in ("again", "attention"))


def _work_figs(work: Work, prefix: str) -> Figs:
    f = {(prefix + name,): getattr(work, name) for name in WORK_FIELDS}
    for entry in work.attention:
        f |= {(prefix + "attention", entry[0], i): entry[i] for i in (1, 2)}
    return f


def _work_of(f: Figs, prefix: str, again: Work | None = None) -> Work:
    attention = tuple((k[1], f[k], f[(*k[:2], 2)]) for k in sorted(
        k for k in f if k[0] == prefix + "attention" and k[2] == 1))
    return Work(**{name: f[(prefix + name,)] for name in WORK_FIELDS}, again=again,
                attention=attention)


# Figures that are a step's peak, not a sum over blocks (module doc): Probes.working_set
# and Probes.phases replace their extrapolation. WORKING: the working set of each phase,
# in in_flight.py's order (activations.py's Phases.working)
PLAIN_PEAK = ("plain_working_set",)
WORKING = (("working_fwd",), ("working_bwd",), ("working_b",), ("working_w",))
# a whole backward's parts (Phases.head, .last, .rest, .tail), each beside ZeRO's buffers
# then; the tail's above nothing (what it holds does not grow with the blocks, the saved do)
PARTS = (("working_head",), ("working_last",), ("working_rest",), ("working_tail_abs",))


def _lin(*terms: tuple[float, Figs]) -> Figs:
    out: Figs = {}
    get = out.get  # bound once: the search's innermost loop
    for k, f in terms:
        for key, v in f.items():
            out[key] = get(key, 0.0) + k * v
    return out


def _from_figs(f: Figs, model: str, mesh: dict[str, int], zero: int,
               optimizer: str) -> tuple[Estimate, Work, int]:
    g = {k: max(0, round(v)) for k, v in f.items()}
    # each phase's working set (in_flight.py's order: forward, backward, a split one's B
    # and W) and ZeRO's buffers beside it, as explain adds them
    end = g[("beside_end",)] - g[("activation_bytes",)]
    head, last, rest, tail = (round(f[key]) for key in PARTS)  # below zero, maybe
    tail -= g[("activation_bytes",)]
    work = (g[("working_fwd",)] + g[("beside_fwd",)],
            max(head + g[("beside_head",)], last + g[("beside_last",)],
                max(rest, tail) + g[("beside",)], end),
            *(max(g[key] + g[("beside",)], end) for key in WORKING[2:]))
    traffic = [Traffic(*k[1:4], g[k], g[("bytes", *k[1:])], prefetched=k[4])
               for k in sorted(g) if k[0] == "calls" and (g[k] or g[("bytes", *k[1:])])]
    rc = ("again_matmul_flops",) in f
    est = Estimate(model, None, math.prod(mesh.values()), mesh, zero, optimizer,
                   g[("param_bytes",)], g[("grad_bytes",)], g[("optimizer_bytes",)],
                   g[("activation_bytes",)], traffic,
                   transient_bytes=max(work[:2]), phase_transients=work,
                   without_recompute=(g[("plain_saved",)], g[("plain_working_set",)])
                   if rc else None, recompute_flops=f[("again_matmul_flops",)] if rc else 0.0,
                   weight_grad_bytes=g[("weight_grad_bytes",)])
    again = _work_of(f, "again_") if rc else None
    return est, _work_of(f, "", again), g[("param_elements",)]


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
    return without_recompute(program)


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
                 compiled: dict | None = None, compiled_form: str | None = None,
                 experts_data: int = 0, precision: str = "fp32", overlap: bool = False,
                 besides: dict | None = None):
        if recompute not in (None, compiled_form):  # the Planner's pairing: not user input
            raise ValueError(f"probes of recompute {recompute} from {compiled_form}'s")
        self.optimizer = optimizer
        self.precision = precision  # the probes' Programs hold what `run --precision` keeps
        self.stage: dict[tuple, Figs] = {}
        self.programs: dict[tuple[str, int, int], object] = {}  # (kind, n, b) -> Program
        # (kind, n, b) -> the walk's figures, with and without recompute, and the work
        self.acts: dict[tuple[str, int, int], tuple] = {}
        self.cache: dict[tuple, object] = {}  # stage estimates; ("beside", ...) -> Beside
        self.batch = dims.batch
        self.peaks: dict[tuple, object] = {}  # (kind, n, b) and ("phases", ...)
        self._rings: dict[str, bool] = {}  # kind -> whether its stages have rings
        self._model, self._dims = model, dims
        self._recompute = recompute
        self._compiled = {} if compiled is None else compiled
        # zero_beside's answers by what it reads (parameters, mesh, ZeRO axes, stage): shared
        # with the probes of other recompute forms and overlap, whose parameters are the same
        self._besides = {} if besides is None else besides
        # compiled on a data axis of 2, re-estimated on the candidate's; with the experts over
        # data their shards depend on its size, so those probes are compiled on the very axis
        self.data = experts_data or 2
        self._one = Candidate(self.data, tensor, 1, sequence, context=context,
                              recompute=compiled_form, experts_on_data=experts_data > 0,
                              overlap=overlap)
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
                (d, self.data * b if d == self._dims.batch else s)
                for d, s in self._model.dims))
            if kind == "only":
                par = to_parallel(base, self._dims, self._one)
                done[kind, n, b] = program_as_run(lower_graph(truncate(base, n), par).program,
                                                  self.precision)
            else:
                three = truncate(base, 3 * n)
                pipe = to_parallel(three, self._dims, attrs.evolve(self._one, pipe=3))
                graph = graph_as_run(lower_graph(three, pipe), self.precision)
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
                self.acts[kind, n, b] = (activation_figures(prog), plain, program_work(prog),
                                         weight_grad_bytes(prog))
            acts, plain, work, kept = self.acts[kind, n, b]
            prog = _remesh(prog, data)
            est = estimate(prog, zero, self.optimizer, activations=acts, plain=plain,
                           beside=self._beside_of(prog, 2, zero), kept=kept)
            self.stage[key] = _figs(est, work, sum(math.prod(p.shape) for p in prog.params))
        return self.stage[key]

    def figures(self, kind: str, n: int, b: int, data: int, zero: int) -> Figs:
        """A stage of `kind` (only | first | middle | last) with n blocks and b samples per
        microbatch per data rank, on `data` ranks under ZeRO `zero`: bilinear in (n, b); the
        b-slope (activations, tensor-parallel traffic, work) is the same for every data
        degree and ZeRO stage, so it is read at the probes' data degree, ZeRO 0. The working
        sets are not sums over blocks and not linear in b: they come from `phases` (and,
        under recompute, `working_set`)."""
        # `overlap tensor`: a scatter ring keeps its input's chunks as views at one sample (the
        # sequence leads) and as copies from two on (ring_memory.py): linear from two samples
        lo = 2 if b > 1 and self.has_rings(kind) else 1
        f11, f21 = self._at(kind, 1, lo, data, zero), self._at(kind, 2, lo, data, zero)
        d = self.data
        s1 = _lin((1, self._at(kind, 1, lo + 1, d, 0)), (-1, self._at(kind, 1, lo, d, 0)))
        s2 = _lin((1, self._at(kind, 2, lo + 1, d, 0)), (-1, self._at(kind, 2, lo, d, 0)))
        out = _lin((1, f11), (n - 1, f21), (1 - n, f11), (b - lo, s1),
                   ((b - lo) * (n - 1), s2), ((b - lo) * (1 - n), s1))
        if self.program(kind, min(n, 2), 1).recompute:
            out[PLAIN_PEAK] = self.working_set(kind, min(n, 2), b)
        out |= dict(zip(WORKING + PARTS, self.phases(kind, min(n, 2), b), strict=True))
        # B's peak is where it has walked back to the stage's first block, holding the
        # gradients it keeps for W of every block: those grow with the blocks
        out[WORKING[2]] += out[("weight_grad_bytes",)]
        beside = self.beside(kind, n, data, zero)
        out[("beside_fwd",)], out[("beside",)] = beside.forward, beside.backward
        out[("beside_head",)], out[("beside_last",)] = beside.head, beside.last
        out[("beside_end",)] = beside.end
        return out

    def has_rings(self, kind: str) -> bool:
        """Whether a stage of `kind` has collective matmuls (found once per kind)."""
        if kind not in self._rings:
            self._rings[kind] = bool(find_rings(self.program(kind, 1, 1)))
        return self._rings[kind]

    def beside(self, kind: str, n: int, data: int, zero: int) -> Beside:
        """What ZeRO holds beside the working set in a stage of n blocks (zero_memory.py: a
        function of its parameters, the 2-block probe's with its last block repeated)."""
        key = ("beside", kind, n, data, zero)
        if key not in self.cache:
            prog = _remesh(self.program(kind, min(n, 2), 1), data)
            self.cache[key] = self._beside_of(prog, n, zero)
        return self.cache[key]

    def _beside_of(self, prog, n: int, zero: int) -> Beside:
        """zero_beside of `prog` (a probe of at most 2 blocks) as a stage of n blocks."""
        key = (prog.params, prog.mesh, prog.zero_axes, max(n, 2), zero)
        if key not in self._besides:
            if n > 2:  # the repeated parameters are the same on every data degree and stage
                again = ("blocks", prog.params, n)
                if again not in self._besides:
                    self._besides[again] = repeat_block(prog, n).params
                prog = attrs.evolve(prog, params=self._besides[again])
            self._besides[key] = zero_beside(prog, zero)
        return self._besides[key]

    def stage_estimate(self, kind: str, n: int, b: int, data: int, zero: int,
                       mesh: dict[str, int]) -> tuple[Estimate, Work, int]:
        """A stage's (estimate, forward work, parameter elements) read off the probes
        (`figures`) on `mesh`, the stage's axes and sizes (cached)."""
        key = (kind, n, b, data, zero)
        if key not in self.cache:
            self.cache[key] = _from_figs(self.figures(*key), self._model.name, mesh, zero,
                                         self.optimizer)
        return self.cache[key]

    def working_set(self, kind: str, n: int, b: int) -> int:
        """The working set a recomputing stage of n <= 2 blocks and b samples would have
        without its recompute: the walk of the b = 1 probe with its batch dim scaled to b (a
        peak is a max over the step: not linear in b)."""
        key = (kind, n, b)
        if key not in self.peaks:
            prog = _with_batch(self.program(kind, n, 1), self.batch, b)
            self.peaks[key] = activation_figures(_plain(prog))[1]
        return self.peaks[key]

    def phases(self, kind: str, n: int, b: int) -> tuple[int, ...]:
        """The working sets of a stage of n <= 2 blocks and b samples per phase (forward, a
        whole backward, a split one's B less the gradients it keeps for W, and W:
        activations.py's Phases.working), then a whole backward's four parts (head, last
        block, rest, and the tail's above nothing), walked as `working_set` is."""
        key = ("phases", kind, n, b)
        if key not in self.peaks:
            ph = phase_figures(_with_batch(self.program(kind, n, 1), self.batch, b))
            self.peaks[key] = (ph.forward, ph.backward, ph.input_grad - ph.kept,
                               ph.weight_grad, ph.head, ph.last, ph.rest, ph.tail + ph.saved)
        return self.peaks[key]

    def edge_at(self, b: int) -> EdgeFigures:
        """The boundary tensors per microbatch of b samples per data rank."""
        self._compile("middle", 1, 1)
        self._compile("middle", 1, 2)
        e1, e2 = self._compiled["edge", 1, 1], self._compiled["edge", 1, 2]
        return attrs.evolve(e1, nbytes=e1.nbytes + (b - 1) * (e2.nbytes - e1.nbytes),
                            float_bytes=e1.float_bytes + (b - 1) * (e2.float_bytes -
                                                                    e1.float_bytes))
