"""Estimates from a Program, before launch: what each rank holds and sends per training step.

All ranks of a Program hold equal shards (the compiler only splits evenly), so one rank's
figures are every rank's.

Memory (bytes per rank):
- params: the local shards in the dtype the model computes in (the spec's, or --precision's:
  precision.py), plus the fp32 masters kept apart from a narrower copy (ZeRO >= 1: 1/D of them);
  ZeRO-3: only the master shard, 1/D (D the ranks ZeRO shards over: data x context).
- grads: the optimizer's fp32 gradient buffers, one element per local parameter element
  (ZeRO-2/3: 1/D).
- optimizer: fp32 state per local parameter element: AdamW 2 x 4 bytes (exp_avg, exp_avg_sq),
  SGD with momentum 4 bytes (ZeRO >= 1: 1/D).
- activations: the bytes autograd keeps for backward at the end of the forward, per primitive
  what the runtime's kernels save (fused attention keeps q, k, v and its output, never the
  scores; an add keeps nothing; ...: shard/plan/analysis/activations.py), each tensor once;
- transient: the working set on top of them at the step's peak (values still to be read in
  forward, gradients in flight in backward), from a walk of the Program that frees each value
  after its last use as the runtime does; beside it ZeRO-3's gathered buckets (in use and
  prefetched) and ZeRO-2/3's gradient buffers in flight (zero_memory.py), never every
  bucket's, each part of backward (head, last block, the others) beside what it holds then.
  activations + transient is the step's peak above the parameter state (within a few percent
  of the measured peak on the examples: bench/bench_memory.py, tests/dsl/search/test_plan.py).

Communication (bytes this rank sends per training step, per mesh axis and collective kind):
the comm layer's convention (`soapstone.comm.bus_bytes`: ring algorithms, allreduce
2(n-1)/n of the tensor, reduce_scatter / allgather / alltoall (n-1)/n of the full tensor), so
the figures equal what the communicators' `stats` counters record during one step of
`soapstone run` (tests/shard/plan/test_explain.py checks it):
- forward: the Program's redistributions, the statistics allreduces of distributed ops (their
  records' dist_stats: layernorm 2 sums, rmsnorm 1, softmax max + sum, cross_entropy max + 2
  sums), and a moe op's own calls (its record's `calls`, shard/parallel/dispatch_plan.py:
  the counts allgather; where tokens and experts share an axis, the dispatch and combine
  alltoallv, counted as their expected bytes at the capacity bound, so these rows alone are
  estimates: the counters record what the routing sent).
- backward: the transpose of each forward collective (CopyTo -> allreduce, allgather with a
  partial gradient -> reduce_scatter, reduce_scatter/slice -> allgather, alltoall ->
  alltoall, and the backward allreduce of each statistics sum).
- grad sync (shard/parallel/data_parallel.py), per gradient bucket of the runtime's own plan
  (`plan_buckets`: the same parameters in the same buckets, padded the same way): ZeRO-0
  allreduces each bucket's fp32 gradient over its grad_sync axes; ZeRO >= 1 reduce-scatters it
  over the data axes and allreduces the shard over the other grad_sync axes; ZeRO-1/2 then
  allgather the updated parameters over the data axes; ZeRO-3 instead gathers each bucket's
  parameters twice per step, before its first use in forward and again in backward (counted
  under forward and backward: shard/parallel/zero.py frees a bucket after forward and its saved
  tensors regather it).
- grad norm: one float64 allreduce per distinct set of axes the gradient pieces are split
  over (the optimizer always computes the global norm).
- loss: the float allreduce(s) that report the global loss each step.

Pipelines (`estimate_pipeline`, from the StageGraph): each virtual stage's Program (compiled
for one microbatch on the mesh without the pipe axis) is estimated as above, and a pipe rank's
figures add up its virtual stages:
- params, grads, optimizer: the sum over the rank's stages (a tied weight counts per copy).
- activations: what the executor keeps per microbatch in flight, from the schedule itself:
  walking the rank's F/B/W actions, the peak over time of sum over its stages s of
  (microbatches past F, before their backward's last part) x s's saved bytes + (those
  before B) x the bytes s sends forward (its outputs, stored for its B; a received input is
  read by the stage's first op, which saves it). For 1F1B that is p - s microbatches on pipe
  rank s (at most m); GPipe keeps all m; interleaved keeps its warm-up depth; a split
  backward keeps the saved bytes until W, and from B to W the gradients B keeps for it
  (activations.py's Phases). The peak is per action (in_flight.py): what is held at that
  action plus its own working set (its stage's forward's at an F, backward's at a B; a
  split backward's B's and W's), the largest over the actions; activations is what is held
  there, transient that action's working set, plus the one message received ahead of the
  compute reading it; sends add nothing, each let go as it completes
  (shard/runtime/pipe_p2p.py). Flat in m but for GPipe.
- communication: a stage's forward and backward collectives run once per microbatch (x m);
  gradient sync once per step (every microbatch but the last runs in no_sync; ZeRO >= 2
  reduce-scatters every microbatch, x m); the grad-norm pieces per stage, then one float64
  allreduce over the pipe axis for the norm over every stage; the loss: the last stage's loss
  reduction per microbatch, then one float64 allreduce over the pipe axis; weights tied across
  stages: one float64 allreduce over the pipe axis of their local elements; p2p: the sender
  counts each boundary tensor per microbatch (activations forward, float gradients back).
  These equal the comm counters of one `soapstone run` step on every rank (tests).
- bubble: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved with v chunks per rank, or zb1p's
  (p-1)/(3m+p-1) (1-3m/(2m+2p-1) for m < p; shard/plan/schedules/zb1p.py derives both):
  each schedule's own (its `bubble` and `formula`).
- imbalance: per pipe rank, the parameter elements of its stages (full, unsharded), the largest
  over the mean. Parameters stand in for compute: every repeat block of a stage costs the same,
  but the embedding and the output projection are counted by their size, which overstates the
  embedding (a lookup) and understates attention's activation-only FLOPs. 1.0 without stages.
"""

from __future__ import annotations

import math

import attrs

from soapstone.comm.accounting import bus_bytes
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.dispatch_plan import expert_figures
from soapstone.shard.parallel.regather_plan import without_recompute
from soapstone.shard.parallel.ring_plan import (
    find_rings,
    float8_gathers_beside_rings,
    float8_rings,
    ring_chunk,
    ring_sends,
)
from soapstone.shard.parallel.selective_plan import selective_flops
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis.activations import (
    activation_figures,
    phase_figures,
    recompute_flops,
    weight_grad_bytes,
)
from soapstone.shard.plan.analysis.in_flight import ScheduleShape, in_flight
from soapstone.shard.plan.analysis.zero_memory import Beside, zero_beside
from soapstone.shard.plan.collectives import backward_bytes, backward_op, forward_bytes, forward_op
from soapstone.shard.plan.dtypes import DTYPES
from soapstone.shard.plan.layout import P, RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute

FLOAT_BYTES = {n: d.nbytes for n, d in DTYPES.items() if d.is_float}
OPTIMIZER_STATE = {"adamw": 8, "sgd": 4}


@attrs.define
class Traffic:
    """One row: this rank's calls and bytes for one collective on one axis (or axes)."""

    phase: str  # forward | backward | grad sync | grad norm | loss
    kind: str  # allreduce | reduce_scatter | allgather | alltoall | broadcast
    axis: str  # mesh axis, or "a,b" for a communicator over several
    calls: int = 0
    bytes: int = 0
    # ZeRO-3's parameter gathers, which the runtime prefetches (shard/parallel/zero.py): the
    # cost model hides them behind compute, whatever axes they span (a row of its own, as
    # context parallelism's gathers may share their phase, kind and axis)
    prefetched: bool = False


@attrs.define
class Estimate:
    """Per-rank memory and per-step communication of one layout."""

    model: str
    parallel: str | None
    world_size: int
    mesh: dict[str, int]
    zero: int
    optimizer: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    traffic: list[Traffic]
    bubble: float = 0.0
    imbalance: float = 1.0
    stages: int = 1
    microbatches: int = 1
    schedule: str | None = None
    pipe_rank: int | None = None  # pipelines: whose figures the memory and traffic are
    pipe_ranks: list[dict] = attrs.field(factory=list)  # pipelines: every pipe rank's figures
    edges: list[dict] = attrs.field(factory=list)  # pipelines: p2p bytes per step per edge
    transient_bytes: int = 0  # the working set above the saved activations at the peak
    # the working sets of activations.py's Phases, added at each action (in_flight.py);
    # transient_bytes the larger of forward's and backward's. None: all transient_bytes
    phase_transients: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    # `recompute`: (saved, working set) without it, and the matmul FLOPs backward runs again
    # (one microbatch)
    without_recompute: tuple[int, int] | None = None
    recompute_flops: float = 0.0
    # a split backward (zb1p): the gradients B keeps for W, one microbatch (activations.py)
    weight_grad_bytes: int = 0
    # per moe op: experts per rank, their parameter bytes, the capacity bound (dispatch.py)
    experts: list[dict] = attrs.field(factory=list)
    # of param_bytes, the fp32 master copies kept apart from a narrower (bf16) model copy
    master_bytes: int = 0
    compute_dtype: str | None = None  # the parameters' dtype as the model computes with them
    # pipelines: every pipe rank's traffic rows (the cost model's; not in to_data)
    rank_traffic: list[list[Traffic]] = attrs.field(factory=list, repr=False)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + \
            self.activation_bytes + self.transient_bytes

    def comm_by(self, *, merge_phases: bool = True) -> dict[tuple[str, str], tuple[int, int]]:
        """(axis, kind) -> (calls, bytes), summed over phases: what `stats` counters show."""
        out: dict[tuple[str, str], list[int]] = {}
        for t in self.traffic:
            key = (t.axis, t.kind) if merge_phases else (t.phase, t.axis, t.kind)
            row = out.setdefault(key, [0, 0])
            row[0] += t.calls
            row[1] += t.bytes
        return {k: (c, b) for k, (c, b) in out.items()}

    def to_data(self) -> dict:
        """The estimate as plain data (`explain --json`), with total and per-axis bytes."""
        d = attrs.asdict(self)
        del d["rank_traffic"], d["phase_transients"]
        d["total_bytes"] = self.total_bytes
        d["comm_bytes_per_axis"] = {}
        for t in self.traffic:
            d["comm_bytes_per_axis"][t.axis] = d["comm_bytes_per_axis"].get(t.axis, 0) + t.bytes
        return d


def estimate(program: Program, zero: int | ZeroStage = 0, optimizer: str = "adamw",
             deferred: tuple[str, ...] = (), activations: tuple[int, int] | None = None,
             plain: tuple[int, int] | None = None, beside: Beside | None = None,
             kept: int | None = None) -> Estimate:
    """The estimate of one step of training `program` with `optimizer` under ZeRO `zero`.
    deferred: params with a gradient bucket of their own (pipeline tied weights);
    activations: activation_figures(program) when the caller has them already; plain: the
    same of the program without recompute (one that has it); beside, kept: zero_beside's
    and weight_grad_bytes' answers, where the caller has them (the planner's probes)."""
    mesh = dict(program.mesh)
    z = ZeroStage.of(zero)
    dp_axes = program.zero_axes if z.shards_optimizer else ()
    d = math.prod(mesh[a] for a in dp_axes) if dp_axes else 1
    rows: dict[tuple[str, str, str, bool], Traffic] = {}

    def add(phase: str, kind: str, axes: tuple[str, ...] | str, nbytes: int, calls: int = 1,
            prefetched: bool = False):
        axes = (axes,) if isinstance(axes, str) else tuple(a for a in mesh if a in axes)
        n = math.prod(mesh[a] for a in axes)
        if n <= 1:
            return
        key = (phase, kind, ",".join(axes), prefetched)
        row = rows.setdefault(key, Traffic(phase, kind, ",".join(axes), prefetched=prefetched))
        row.calls += calls
        row.bytes += bus_bytes(kind, nbytes, n) * calls

    float_params = [p for p in program.params if p.dtype in FLOAT_BYTES]
    elems = sum(math.prod(p.local_shape) for p in float_params)
    param_bytes = sum(program.value(p.name).nbytes for p in program.params)
    phases = phase_figures(program) if activations is None else None
    activations, transient = activations or (phases.saved, max(phases.forward, phases.backward))
    again = {i for a, b in program.recompute for i in range(a, b)}
    f8 = float8_gathers_beside_rings(program, marked=True)
    rings = find_rings(program)
    f8_rings = float8_rings(program, marked=True)
    for i, step in enumerate(program.steps):
        if i in rings:  # `overlap tensor`: a ring of sends each way instead of the collective
            v = program.value(ring_chunk(program, rings[i]))
            gather = rings[i].kind is RedistributeKind.ALLGATHER
            for phase in ("forward", "backward", "recompute")[:3 if i in again else 2]:
                chunk = v.nbytes
                if i in f8_rings and gather == (phase != "backward"):  # float8.py's rings:
                    add(phase, "allreduce", step.axis, 4)  # the amax, then 1 byte an element
                    chunk = math.prod(v.local_shape)
                add(phase, "send", step.axis, chunk, calls=ring_sends(program, rings[i]))
        elif isinstance(step, Redistribute | CopyTo):  # shard/plan/collectives.py's table
            gathers = [("forward", True), ("recompute", i in again),
                       ("backward", step.out in program.regathered)]  # kept as its shard
            for phase in (p for p, runs in gathers if runs and forward_op(step)):
                if i in f8:  # float8's gather (einsum.float8_gathers): 1 byte an element,
                    # after the amax's allreduce (one fp32 scalar)
                    add(phase, "allreduce", step.axis, 4)
                    add(phase, "allgather", step.axis, forward_bytes(program, step)
                        // FLOAT_BYTES[program.value(step.out).dtype])
                else:
                    add(phase, forward_op(step), step.axis, forward_bytes(program, step))
            if backward_op(step) and program.value(step.src).is_float:
                add("backward", backward_op(step), step.axis, backward_bytes(program, step))
        if not isinstance(step, Compute):
            continue
        rec = record_of(step.kind)
        for c in rec.calls(program, step):  # a routing kernel's own (parallel/dispatch_plan.py)
            add(c.phase, c.kind, c.axes, c.payload)
            if i in again and c.phase == "forward":
                add("recompute", c.kind, c.axes, c.payload)
        if step.dist and rec.dist_stats:
            x = program.value(step.args[0])
            item = FLOAT_BYTES.get(x.dtype, 4)
            over = str(step.attr("over"))
            stat = math.prod(s for dim, s in zip(x.dims, x.local_shape, strict=True)
                             if dim != over) * item
            for axis in step.dist:
                for backward in (s.backward for s in rec.dist_stats):
                    add("forward", "allreduce", axis, stat)
                    if i in again:
                        add("recompute", "allreduce", axis, stat)
                    if backward:
                        add("backward", "allreduce", axis, stat)
    # gradient sync, as shard/parallel/data_parallel.py does it: its own bucket plan (plan_buckets),
    # fp32 gradient buffers padded to a multiple of the data-parallel size
    from soapstone.shard.parallel.bucket_plan import plan_buckets

    norm_keys: set[tuple[str, ...]] = set()
    # master copies are fp32, or as wide as the params (fp64)
    master = max(4, FLOAT_BYTES[float_params[0].dtype]) if float_params else 4
    # elements no data axis shards: a param whose gradient arrives summed over the data axes
    # already (through an activation's copy_to: a position table) has no data-axis sync,
    # so ZeRO leaves it, its gradient and its optimizer state whole
    whole = 0
    plans = plan_buckets(program, zero, program.zero_axes, deferred)
    for plan in plans:
        n_dp = math.prod(mesh[a] for a in plan.dp)
        if n_dp == 1:
            whole += plan.numel
        padded = -(-plan.numel // n_dp) * n_dp
        item = FLOAT_BYTES[program.value(plan.names[0]).dtype]
        # a weight tied across pipeline stages is reduced once, at the step, after its sum
        # over the pipe axis; every other bucket in backward (each microbatch's at ZeRO >= 2)
        sync = "tied sum" if plan.deferred else "grad sync"
        if not z.on(n_dp).shards_optimizer:
            add(sync, "allreduce", plan.sync, padded * master)
            norm_keys.add(tuple(a for a in mesh if a in plan.split))
            continue
        rest = tuple(a for a in plan.sync if a not in plan.dp)
        add(sync, "reduce_scatter", plan.dp, padded * master)
        add(sync, "allreduce", rest, padded // n_dp * master)
        if z.publishes_params:  # the updated shards, gathered after the optimizer step
            add("grad sync", "allgather", plan.dp, padded * item)
        else:  # ZeRO-3: gathered before use in forward, and again for backward (zero.py)
            add("forward", "allgather", plan.dp, padded * item, prefetched=True)
            add("backward", "allgather", plan.dp, padded * item, prefetched=True)
        norm_keys.add(tuple(a for a in mesh if a in set(plan.split) | set(plan.dp)))
    for key in norm_keys:
        add("grad norm", "allreduce", key, 8)
    loss = program.loss
    if loss is not None:
        lv = program.value(loss.value)
        for axis, placement in lv.layout.placements:
            if placement == P:
                add("loss", "allreduce", axis, lv.nbytes)
            else:
                add("loss", "allgather", axis, lv.nbytes * mesh[axis])
    def held(total: int, item: float, sharded: bool) -> int:
        """The bytes of `total` (item bytes an element) a rank holds where ZeRO shards it
        (`sharded`): all but the `whole` elements over the data axes."""
        if not sharded:
            return total
        kept = int(whole * item)
        return kept + (total - kept) // d

    grad_bytes = held(elems * 4, 4, z.shards_grads)
    if z.shards_optimizer and z.keeps_full_grad:
        # ZeRO-1: the full buffer persists (it accumulates) beside the reduced shard
        grad_bytes += held(elems * 4, 4, True) - int(whole * 4)
    state = OPTIMIZER_STATE.get(optimizer, 8)
    opt_bytes = held(elems * state, state, z.shards_optimizer)
    params, masters = held_params(param_bytes, sum(program.value(p.name).nbytes
                                                   for p in float_params), elems, master, held, z)
    if beside is None:
        beside = zero_beside(program, z, deferred)  # zero_memory.py
    end = beside.end - activations
    # per phase (in_flight.py's order): a split backward's B and W beside the buffers too
    # a whole backward in its parts (activations.py's Phases), each beside ZeRO's buffers then
    work = phases and (phases.forward + beside.forward,
                       max(phases.head + beside.head, phases.last + beside.last,
                           max(phases.rest, phases.tail) + beside.backward, end),
                       *(max(w + beside.backward, end) for w in phases.working[2:]))
    return Estimate(program.model, program.parallel, program.world_size, mesh, z.level,
                    optimizer, params, grad_bytes, opt_bytes, activations,
                    sorted(rows.values(), key=lambda t: (t.phase, t.axis, t.kind, t.prefetched)),
                    transient_bytes=max(work[:2] if work else (transient + beside.backward, end)),
                    phase_transients=work or None,
                    without_recompute=(plain or activation_figures(
                        without_recompute(program, selective=True)))
                    if program.recompute or program.dropped else None,
                    recompute_flops=recompute_flops(program) + selective_flops(program),
                    weight_grad_bytes=phases.kept if phases else
                    weight_grad_bytes(program) if kept is None else kept,
                    experts=expert_figures(program), master_bytes=masters,
                    compute_dtype=float_params[0].dtype if float_params else None)


def held_params(param_bytes: int, float_bytes: int, elems: int, master: int, held,
                z: ZeroStage) -> tuple[int, int]:
    """A rank's parameter bytes as shard/parallel/data_parallel.py keeps them: the model's copy
    (in its compute dtype) and, where that is narrower than the master width (bf16 or f16
    parameters), the fp32 master copy beside it (ZeRO >= 1: a 1/D shard of it); ZeRO-3 keeps
    only the master shard (the model's copy is gathered for use). `held(total, item,
    sharded)` is explain's rule for what ZeRO shards. (total, of which masters kept apart)"""
    if z.shards_params:
        masters = held(elems * master, master, True)
        return param_bytes - float_bytes + masters, masters if float_bytes != elems * master \
            else 0
    apart = float_bytes != elems * master  # a narrower model copy: the masters are apart
    masters = held(elems * master, master, z.shards_optimizer) if apart else 0
    return param_bytes + masters, masters


@attrs.frozen
class StageFigures:
    """What `combine_pipeline` needs of one virtual stage besides its Estimate."""

    index: int
    rank: int  # the pipe rank running it
    blocks: tuple[str, ...]
    param_elements: int  # full (unsharded) parameter elements: the imbalance's measure


@attrs.frozen
class EdgeFigures:
    """One stage-graph edge per microbatch: what its sender sends forward and gets back."""

    src: int
    dst: int
    src_rank: int
    dst_rank: int
    tensors: int
    nbytes: int
    float_tensors: int  # those whose gradients come back
    float_bytes: int


def estimate_pipeline(graph, zero: int | ZeroStage = 0, optimizer: str = "adamw",
                      rank: int | None = None) -> Estimate:
    """A pipeline layout's estimate (module doc). Memory and traffic are pipe rank `rank`'s;
    default: the rank holding the most memory. `pipe_ranks` lists every pipe rank."""
    shared = {n: w for n, w in graph.shared}
    per_stage = {}
    for st in graph.stages:
        per_stage[st.index] = estimate(st.program, zero, optimizer,
                                       deferred=tuple(n for n in shared
                                                      if n in {p.name for p in
                                                               st.program.params}))
    stages = [StageFigures(st.index, st.rank, st.blocks,
                           sum(math.prod(p.shape) for p in st.program.params))
              for st in graph.stages]
    edges = [EdgeFigures(e.src, e.dst, e.src_rank, e.dst_rank, len(e.tensors), e.nbytes,
                         sum(1 for t in e.tensors if t.is_float),
                         sum(t.nbytes for t in e.tensors if t.is_float)) for e in graph.edges]
    tied = sum(math.prod(graph.stages[w[0]].program.value(name).local_shape)
               for name, w in shared.items())
    return combine_pipeline(graph, per_stage, stages, edges, tied, zero, optimizer, rank)


def combine_pipeline(graph, per_stage: dict[int, Estimate], stages: list[StageFigures],
                     edges: list[EdgeFigures], tied_elements: int, zero: int | ZeroStage,
                     optimizer: str, rank: int | None = None) -> Estimate:
    """The pipeline estimate from each virtual stage's estimate (module doc): `graph` gives
    the layout (model, parallel, mesh, axis, pipe, schedule, microbatches, chunks); the
    planner passes stage estimates it extrapolated instead of compiling every stage."""
    m, pipe, axis = graph.microbatches, graph.pipe, graph.axis
    mesh = dict(graph.mesh)
    z = ZeroStage.of(zero)
    # never built: in_flight's closed forms and short walks, and the bubble's formula
    sched = ScheduleShape(graph.schedule, pipe, m, graph.chunks)
    act = {i: e.activation_bytes for i, e in per_stage.items()}
    of_rank: dict[int, list[StageFigures]] = {}
    sends: dict[int, list[EdgeFigures]] = {}  # edges by sending rank
    backs: dict[int, list[EdgeFigures]] = {}  # edges by receiving rank (it sends gradients)
    sent: dict[int, int] = {}  # stage -> bytes it sends forward per microbatch
    kept = {i: e.weight_grad_bytes for i, e in per_stage.items()}  # split: B keeps for W
    for st in stages:
        of_rank.setdefault(st.rank, []).append(st)
    for e in edges if pipe > 1 else ():
        if e.src_rank != e.dst_rank:  # a V's turn is handed over in memory: no message
            sends.setdefault(e.src_rank, []).append(e)
            backs.setdefault(e.dst_rank, []).append(e)
        sent[e.src] = sent.get(e.src, 0) + e.nbytes
    for e in edges if pipe > 1 else ():
        # a stage without float inputs has no B to run: W keeps its outputs and their
        # gradients instead (split_backward.py: the roots off B's path)
        if not any(x.dst == e.src and x.float_tensors for x in edges):
            kept[e.src] = sent[e.src] + sum(x.float_bytes for x in edges if x.src == e.src)
    # each stage's working set per phase (explain's and the planner's probes' alike)
    work = {i: e.phase_transients for i, e in per_stage.items()}
    ranks = []
    made: dict[tuple, list[Traffic]] = {}  # ranks alike (the middle of a pipeline): one tally
    for r in range(pipe):
        mine = of_rank.get(r, [])
        peak = in_flight(sched, r, act, sent, kept, work)
        alike = (tuple(id(per_stage[st.index]) for st in mine),
                 tuple((e.tensors, e.nbytes) for e in sends.get(r, ())),
                 tuple((e.float_tensors, e.float_bytes) for e in backs.get(r, ())))
        if alike not in made:
            rows: dict[tuple[str, str, str, bool], Traffic] = {}

            def add(phase, kind, ax, calls, nbytes, rows=rows, prefetched=False):
                row = rows.setdefault((phase, kind, ax, prefetched),
                                      Traffic(phase, kind, ax, prefetched=prefetched))
                row.calls += calls
                row.bytes += nbytes

            for st in mine:
                for t in per_stage[st.index].traffic:
                    times = m if t.phase in ("forward", "backward", "loss", "recompute") or (
                        z.shards_grads and t.phase == "grad sync" and t.kind != "allgather") \
                        else 1
                    add(t.phase, t.kind, t.axis, t.calls * times, t.bytes * times,
                        prefetched=t.prefetched)
            if pipe > 1:
                for e in sends.get(r, ()):
                    add("p2p", "send", axis, e.tensors * m, e.nbytes * m)
                for e in backs.get(r, ()):
                    add("p2p", "send", axis, e.float_tensors * m, e.float_bytes * m)
                if tied_elements:
                    add("tied sum", "allreduce", axis, 1,
                        bus_bytes("allreduce", 8 * tied_elements, pipe))
                add("grad norm", "allreduce", axis, 1, bus_bytes("allreduce", 8, pipe))
                add("loss", "allreduce", axis, 1, bus_bytes("allreduce", 8, pipe))
            made[alike] = sorted(rows.values(),
                                 key=lambda t: (t.phase, t.axis, t.kind, t.prefetched))
        traffic = made[alike]  # shared by the ranks alike: read only from here on
        ranks.append({
            "pipe_rank": r, "stages": [st.index for st in mine],
            "blocks": [b for st in mine for b in st.blocks],
            "param_bytes": sum(per_stage[st.index].param_bytes for st in mine),
            "master_bytes": sum(per_stage[st.index].master_bytes for st in mine),
            "grad_bytes": sum(per_stage[st.index].grad_bytes for st in mine),
            "optimizer_bytes": sum(per_stage[st.index].optimizer_bytes for st in mine),
            # at the action where held + its working set peaks (in_flight.py)
            "activation_bytes": peak.held,
            "transient_bytes": peak.working + received_ahead(r, sends, backs),
            "activation_bytes_per_microbatch": {st.index: act[st.index] + sent.get(st.index, 0)
                                                for st in mine},
            "microbatches_in_flight": {st.index: peak.live.get(st.index, 0) for st in mine},
            "param_elements": sum(st.param_elements for st in mine),
            "traffic": traffic,
        })
    for row in ranks:
        row["total_bytes"] = sum(row[k] for k in ("param_bytes", "grad_bytes",
                                                  "optimizer_bytes", "activation_bytes",
                                                  "transient_bytes"))
    pick = ranks[rank] if rank is not None else max(ranks, key=lambda x: x["total_bytes"])
    mean = sum(x["param_elements"] for x in ranks) / pipe
    edge_data = [{"src": e.src, "dst": e.dst, "src_rank": e.src_rank, "dst_rank": e.dst_rank,
                  "activation_bytes": e.nbytes * m, "gradient_bytes": e.float_bytes * m}
                 for e in edges]
    return Estimate(graph.model, graph.parallel, graph.world_size, mesh, z.level, optimizer,
                    pick["param_bytes"], pick["grad_bytes"], pick["optimizer_bytes"],
                    pick["activation_bytes"], pick["traffic"],
                    transient_bytes=pick["transient_bytes"],
                    bubble=schedules.theory_bubble(*sched),
                    imbalance=max(x["param_elements"] for x in ranks) / mean if mean else 1.0,
                    stages=len(stages), microbatches=m, schedule=graph.schedule,
                    pipe_rank=pick["pipe_rank"],
                    pipe_ranks=[{k: v for k, v in x.items() if k != "traffic"}
                                | {"comm_bytes": sum(t.bytes for t in x["traffic"])}
                                for x in ranks],
                    edges=edge_data, rank_traffic=[x["traffic"] for x in ranks],
                    master_bytes=pick["master_bytes"],
                    compute_dtype=next((e.compute_dtype for e in per_stage.values()
                                        if e.compute_dtype), None),
                    **_recompute_figures(sched, pick, per_stage, sent, kept,
                                         received_ahead(pick["pipe_rank"], sends, backs)))


def received_ahead(rank: int, sends: dict[int, list], backs: dict[int, list]) -> int:
    """The receive buffer pipe rank `rank` holds beside a compute: the next compute's message,
    posted before this one runs (the largest it receives: an activation on an edge into it,
    a gradient on one out of it). Its own sends are let go as they complete, so they add
    nothing here: what it sends forward is stored for its B anyway (`in_flight`), and a
    gradient goes as soon as its B is done."""
    return max([e.nbytes for e in backs.get(rank, ())]
               + [e.float_bytes for e in sends.get(rank, ())] + [0])


def _recompute_figures(sched, pick: dict, per_stage: dict[int, Estimate],
                       sent: dict[int, int], kept: dict[int, int], ahead: int) -> dict:
    """A pipe rank's figures without `recompute` (activations in flight, working set) and
    the FLOPs it runs again per microbatch, as Estimate's fields; {} without recompute."""
    mine = pick["stages"]
    if all(per_stage[i].without_recompute is None for i in mine):
        return {}
    plain = {i: (e.without_recompute or (e.activation_bytes, e.transient_bytes))
             for i, e in per_stage.items()}
    peak = in_flight(sched, pick["pipe_rank"], {i: a for i, (a, _) in plain.items()}, sent,
                     kept, {i: (w, w) for i, (_, w) in plain.items()})
    return {"without_recompute": (peak.held, peak.working + ahead),
            "recompute_flops": sum(per_stage[i].recompute_flops for i in mine)}
