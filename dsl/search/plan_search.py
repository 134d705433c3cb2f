"""`soapstone plan`'s search: the layouts of a model on N devices (space.py), costed from
explain's Estimate and the cost model (shard/plan/analysis/cost.py), exactly or from probes
(probes.py), fitted and ranked, and the winner's decisions explained.
"""

from __future__ import annotations

import itertools
import math

import attrs

from soapstone.dsl.compile.lower import LoweringError, lower
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.model import ir
from soapstone.dsl.model.irtext import format_parallel
from soapstone.dsl.search.probes import Probes, uniform
from soapstone.dsl.search.space import (
    Candidate,
    LayoutDims,
    PlanError,
    Rejection,
    candidates,
    float8_chunk_misfit,
    layout_dims,
    pipeline_shape,
    recompute_options,
    stage_blocks,
    to_parallel,
)
from soapstone.shard.parallel.zero_stage import ZeroStage
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
    combine_pipeline,
    estimate_pipeline,
)
from soapstone.shard.plan.analysis.hardware import Profile
from soapstone.shard.plan.analysis.precision import graph_as_run
from soapstone.shard.plan.analysis.score import Score, model_flops, peak_of, tokens_per_step
from soapstone.shard.plan.units import format_bytes


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
    score: Score | None = None  # TFLOP/s per device, MFU, tokens/s at the predicted step

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
    """Costs candidates of one model on one profile: compiled, or from probes (probes.py)."""

    def __init__(self, model: ir.Model, profile: Profile, *, precision: str = "fp32",
                 optimizer: str = "adamw", exact: bool | None = None,
                 recompute: tuple[str, ...] | None = None, always_recompute: bool = False):
        self.model, self.profile = model, profile
        # every layout recomputes (`plan --recompute always`): none is costed without
        self.always_recompute = always_recompute
        self.precision, self.optimizer = precision, optimizer
        self.dims = layout_dims(model)
        # the recompute forms to try (default: recompute_options; () searches without)
        self.recompute = recompute_options(model) if recompute is None else recompute
        # the form that only adds recompute ranges (`recompute R`), compiled with the plain
        repeats = {b.rsplit(".", 1)[0] for b in model.blocks}
        self._ranges = next((f for f in self.recompute if f in repeats), None)
        self._compiled: dict[tuple, dict] = {}
        self.exact = not uniform(model) if exact is None else exact
        self._probes: dict[tuple[int, bool, int, str | None, int], Probes] = {}
        self._besides: dict[tuple, object] = {}  # the probes' ZeRO buffers (Probes._beside_of)
        self._graphs: dict[Candidate, object] = {}
        # what every layout's score shares: run's model FLOPs and tokens of a step (score.py)
        single = lower(model, None)
        self._flops, self._tokens = model_flops(single), tokens_per_step(single)

    def probes(self, tensor: int, sequence: bool, context: int = 1,
               recompute: str | None = None, experts_data: int = 0,
               overlap: bool = False) -> Probes:
        """The probes of one tensor / sequence / context / recompute setting (compiled on
        first use); `experts_data`: the data degree the experts are split over (0: not);
        `overlap`: collective matmuls."""
        key = (tensor, sequence, context, recompute, experts_data, overlap)
        if key not in self._probes:
            # without recompute and with `recompute R` the probes share their compiles
            form = recompute if recompute != self._ranges else None
            compiled = self._compiled.setdefault(
                (tensor, sequence, context, form, experts_data, overlap), {})
            self._probes[key] = Probes(self.model, self.dims, tensor, sequence, self.optimizer,
                                       context, recompute, compiled, form or self._ranges,
                                       experts_data, self.precision, overlap,
                                       self._besides)
        return self._probes[key]

    def cost(self, c: Candidate, exact: bool | None = None) -> Result:
        """The candidate's estimate, step time and fit."""
        exact = self.exact if exact is None else exact
        est, work = self._exact(c) if exact else self._probed(c)
        t = step_time(est, work, self.profile, self.precision)
        devices = c.data * c.tensor * c.pipe * c.context
        scored = Score(t.total, self._flops, self._tokens, devices,
                       peak_of(self.profile, self.precision), self.profile.name, self.precision)
        return Result(c, est, t, est.total_bytes <= self.profile.usable_bytes,
                      est.total_bytes, exact, tuple(work), scored)

    def _exact(self, c: Candidate) -> tuple[Estimate, list[Work]]:
        key = attrs.evolve(c, zero=0)
        if key not in self._graphs:
            self._graphs[key] = graph_as_run(lower_graph(
                self.model, to_parallel(self.model, self.dims, c)), self.precision)
        graph = self._graphs[key]
        est = estimate_pipeline(graph, c.zero, self.optimizer)
        work = [Work()] * graph.pipe
        for st in graph.stages:
            work[st.rank] = work[st.rank] + program_work(st.program)
        return est, work

    def _probed(self, c: Candidate) -> tuple[Estimate, list[Work]]:
        probes = self.probes(c.tensor, c.sequence, c.context, c.recompute,
                             c.data if c.experts_on_data else 0, c.overlap)
        b = dict(self.model.dims)[self.dims.batch] // (c.data * c.microbatches)
        runs = stage_blocks(self.model.blocks, c.stages)
        s = len(runs)
        kinds = ["only"] if s == 1 else \
            ["first"] + ["middle"] * (s - 2) + ["last"]
        # a rank's first stage's Work is its sum (adding it to Work() changes no value)
        per_stage, stages, work, rank = {}, [], [None] * c.pipe, [c.rank_of(i) for i in range(s)]
        inner = {"data": c.data, "cp": c.context, "model": c.tensor}
        inner = {a: n for a, n in inner.items() if a in probes.axes}
        for i, (kind, run) in enumerate(zip(kinds, runs, strict=True)):
            est, w, elements = probes.stage_estimate(kind, len(run), b, c.data, c.zero, inner)
            per_stage[i] = est
            stages.append(StageFigures(i, rank[i], run, elements))
            work[rank[i]] = w if work[rank[i]] is None else work[rank[i]] + w
        edge = probes.edge_at(b) if s > 1 else None  # one stage: no edge, no pipeline probes
        edges = [EdgeFigures(i, i + 1, rank[i], rank[i + 1], edge.tensors, edge.nbytes,
                             edge.float_tensors, edge.float_bytes) for i in range(s - 1)]
        shape = pipeline_shape(self.model.name, c)
        est = combine_pipeline(shape, per_stage, stages, edges, 0, c.zero, self.optimizer)
        return est, [Work() if w is None else w for w in work]


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
        rows = [("rank", "layout", "memory/dev", "step s", "TFLOP/s/dev", "MFU", "tokens/s",
                 "bubble", "comm/step per axis", "why")]
        for i, r in enumerate(self.ranked[:top]):
            rows.append((str(i + 1), r.candidate.label, format_bytes(r.memory),
                         f"{r.time.total:.4g}", *_rates(r), f"{r.estimate.bubble:.0%}",
                         _comm(r), why(self, r)))
        for r in self.unfit[:max(1, top // 3)]:
            rows.append(("-", r.candidate.label, format_bytes(r.memory), f"{r.time.total:.4g}",
                         *_rates(r), f"{r.estimate.bubble:.0%}", _comm(r),
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
                    "tflops_per_device": r.score.tflops_per_device if r.score else None,
                    "mfu": r.score.mfu if r.score else None,
                    "tokens_per_s": r.score.tokens_per_s if r.score else None,
                    "why": why(self, r) if r.fits else "does not fit"}

        return {"model": self.model.name, "world": self.world,
                "profile": self.profile.to_data(), "batch_dim": self.dims.batch,
                "global_batch": self.model.size(self.dims.batch),
                "evaluated": self.evaluated, "exact": self.exact,
                "ranked": [row(r) for r in self.ranked[:top]],
                "unfit": [row(r) for r in self.unfit[:top]],
                "decisions": decisions(self, planner), "parallel": self.source(name)}


def _rates(r: Result) -> tuple[str, str, str]:
    """TFLOP/s per device, MFU and tokens/s at the predicted step."""
    s = r.score
    if s is None:
        return "-", "-", "-"
    return f"{s.tflops_per_device:.4g}", f"{s.mfu:.1%}", f"{s.tokens_per_s:.4g}"


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
        group = (c.data, c.tensor, c.pipe, c.sequence, c.context, c.schedule, c.chunks,
                 c.experts_on_data, c.overlap) + \
            ((c.microbatches,) if c.pipe > 1 else ())
        if group in done:
            continue
        why = float8_chunk_misfit(planner.model, planner.dims, planner.precision, c)
        if why:
            rejected.append(Rejection(c.label, why))
            done.add(group)
            continue
        plain: dict[int, Result] = {}
        top = None if planner.always_recompute else climb(ladder, plain)
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
    fits = winner_first(fits, planner.profile, len(planner.model.blocks))
    unfit.sort(key=lambda r: r.memory)
    return Plan(planner.model, planner.dims, planner.profile, world, fits, unfit, rejected,
                n, planner.exact)


def model_parallel(c: Candidate, blocks: int = 0) -> tuple[int, bool, int, int]:
    """How far a layout departs from the simplest: (ZeRO stage, stages that do not divide the
    `blocks` evenly, tensor x context x pipeline, pipeline) — less is simpler: ZeRO adds
    collectives, an uneven cut idles the shorter stages, model parallelism splits each step
    into more and smaller collectives and a bubble; at one size tensor before pipeline (seed
    004's order, Megatron's takeaways)."""
    uneven = bool(blocks) and c.pipe > 1 and blocks % c.stages != 0
    return c.zero, uneven, c.tensor * c.context * c.pipe, c.pipe


def winner_first(ranked: list[Result], profile: Profile, blocks: int = 0) -> list[Result]:
    """`ranked` (fastest first) with the winner moved to the front. The cost model's measured
    error (the profile's `step_error`) is the margin it can tell layouts apart by, so plan
    departs from a simpler layout only for one faster by more than that: from the simplest
    (`model_parallel`: no ZeRO, even stages, then Megatron's takeaway: t x p just large enough
    to fit, tensor first inside a node; `blocks`: the model's repeat blocks; the fastest of a
    kind first) it walks to ever less simple layouts and takes one only where it beats the
    one it holds by more than the error, counting as fitting only what leaves the profile's
    fitted memory headroom (`fit.memory_fraction` of usable memory: the memory estimate's own
    margin) where any does. Without a fit (error 0) the fastest wins."""
    if not ranked or profile.step_error <= 0:
        return ranked
    cap = profile.usable_bytes * float(profile.fit.get("memory_fraction", 1.0))
    roomy = [r for r in ranked if r.memory <= cap] or ranked
    order = sorted(roomy, key=lambda r: (model_parallel(r.candidate, blocks), r.time.total))
    win = order[0]
    for r in order[1:]:
        if r.time.total * (1 + profile.step_error) < win.time.total:
            win = r
    return [win] + [r for r in ranked if r is not win]


def versus_published(plan: Plan, tensor: int, pipe: int) -> str:
    """How the winner compares with the best layout of tensor x pipeline degrees (t, p): the
    predicted gain, against the model's measured error, and why the winner won."""
    best = plan.best
    same = [r for r in plan.ranked if (r.candidate.tensor, r.candidate.pipe) == (tensor, pipe)]
    err = plan.profile.step_error
    if not same:
        unfit = [r for r in plan.unfit if (r.candidate.tensor, r.candidate.pipe) ==
                 (tensor, pipe)]
        if not unfit:
            return f"t{tensor} p{pipe} is not in the space"
        need = format_bytes(min(r.memory for r in unfit))
        return f"t{tensor} p{pipe} does not fit (needs {need})"
    r = same[0]
    if r is best:
        return "the winner"
    gain = r.time.total / best.time.total - 1
    fastest = min(plan.ranked, key=lambda x: x.time.total)
    if gain > err:
        why_ = "faster by more than the model's error"
    elif (simpler := _simpler(best.candidate, r.candidate, len(plan.model.blocks))):
        why_ = f"within the model's error: {simpler}"
    else:
        why_ = (f"within the model's error: {format_bytes(r.memory)} per device "
                f"leaves less headroom" if r.memory > best.memory else
                "within the model's error")
    return (f"{r.candidate.label}: predicted gain {gain:+.1%} (error ±{err:.1%}; fastest "
            f"{fastest.candidate.label} {fastest.time.total / best.time.total - 1:+.1%}); "
            + why_)


def _simpler(a: Candidate, b: Candidate, blocks: int) -> str:
    """Why layout a is simpler than b (`model_parallel`), or ''."""
    ka, kb = model_parallel(a, blocks), model_parallel(b, blocks)
    if ka >= kb:
        return ""
    if ka[0] < kb[0]:
        return f"ZeRO {ka[0]} < {kb[0]}"
    if ka[1] < kb[1]:
        return f"{b.stages} stages do not divide {blocks} blocks evenly"
    if ka[2] < kb[2]:
        return f"less model parallelism (t x p {ka[2]} < {kb[2]})"
    return f"tensor before pipeline (p {ka[3]} < {kb[3]})"


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
        faster = [x for x in plan.ranked if x.time.total < r.time.total]
        if faster:
            return (f"chosen: no less simple layout is faster by more than the model's "
                    f"error (±{plan.profile.step_error:.0%}); {top} {share:.0%}{rc}")
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
        gain = r.time.total / best.time.total - 1
        if gain < 0:  # the winner was kept within the model's error (winner_first)
            return (f"the best with {what} ({r.candidate.label}) is {-gain:.0%} faster, "
                    "within the model's error")
        return f"the best with {what} ({r.candidate.label}) is {gain:.0%} slower"
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
        zigzag = " in balanced zigzag chunks" if plan.parallel().balanced else ""
        out.append(f"context parallel {c.context} ({seqs} over its own axis{zigzag}, beside "
                   f"the tensor axis inside a node): each device holds 1/{c.context} of every "
                   "activation and gathers keys and values per layer; "
                   + _versus(plan, "no context parallelism", lambda x: x.context == 1))
    # the pipe axis is the mesh's outermost (space.py: mesh(pipe, data, cp, model)): a group
    # of it spans the whole world, so it stays inside a node only when the world does
    world = c.pipe * c.data * c.context * c.tensor
    where = "across nodes" if world > prof.devices_per_node else "inside a node"
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
    if c.data * c.context > 1 and (c.data > 1 or c.zero):
        z = ZeroStage.of(c.zero).summary
        lower = [r for r in plan.unfit if attrs.evolve(r.candidate, zero=c.zero) == c
                 and r.candidate.zero < c.zero]
        below = max(lower, key=lambda r: r.candidate.zero) if lower else None
        need = (f" (with ZeRO-{below.candidate.zero} it needs "
                f"{format_bytes(below.memory)})") if below else ""
        cp = f" x {c.context}" if c.context > 1 else ""
        over = f" (ZeRO shards over data x context: {c.data * c.context} ranks)" if cp else ""
        out.append(f"data parallel {c.data}: the remaining {plan.world} / ({c.tensor}{cp} x "
                   f"{c.pipe}) devices replicate the {'pipeline' if c.pipe > 1 else 'model'}; "
                   f"{z}{over}{need}")
    if c.recompute:
        out.append(f"recompute {c.recompute}: {best.recompute_summary}; each block keeps only "
                   "its inputs and backward runs its forward again; "
                   + ("every layout recomputes (--recompute always)" if planner.always_recompute
                      else _versus(plan, "no recompute", lambda x: x.recompute is None)))
    fastest = min(plan.ranked, key=lambda r: r.time.total)
    if fastest is not best:
        reason = _simpler(c, fastest.candidate, len(model.blocks)) or \
            f"{format_bytes(fastest.memory)} per device leaves less headroom"
        out.append(f"within the cost model's measured error (±{prof.step_error:.1%}, "
                   f"profiles.json's fit) of the fastest, {fastest.candidate.label} "
                   f"({fastest.time.total / best.time.total - 1:+.1%}), the simpler wins: "
                   f"{reason}")
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
