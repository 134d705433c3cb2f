"""Semantics of a parallel block (-> ir.Parallel), checked against its model before launch.

The mesh axes exist and are used; each dim maps to at most one axis and divides over it;
`sample` maps the batch dim; a tensor (input or parameter) splits along at most one dim per
axis; `operator` places repeat blocks on pipeline stages (every block
once, stages in order, none empty) or branches (top-level values) on coordinates of an axis;
the schedule's microbatches divide the per-replica batch (without stages they are gradient
accumulation); the interleaved schedule needs pipeline stages and
`zero N` (N >= 1) a sample mapping. Pure Python; never imports torch.

One function per statement kind reads a statement into `Facts` and returns its diagnostics;
one function per rule across statements reads the facts and returns its diagnostics;
`check_parallel` runs them in a fixed order (the order of the reports).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import Diagnostic, did_you_mean, nearest_divisible
from soapstone.dsl.lang.parser import Sources
from soapstone.dsl.model.ir import (
    OPS,
    SELECTIVE,
    Branch,
    Loc,
    Model,
    Parallel,
    Schedule,
    StageAssignment,
)
from soapstone.dsl.model.parallel_facts import Ctx, Diags, Facts
from soapstone.dsl.model.schedule_rules import block_order, schedule_rules
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan import schedules
from soapstone.shard.plan.sizes import MAX_RANKS, divisors


def _missing_axis(ctx: Ctx, mesh: dict[str, int], axis: str, loc: Loc) -> Diagnostic | None:
    """An error if the mesh has no axis `axis`."""
    if axis in mesh:
        return None
    return ctx.diag(loc, f"mesh has no axis '{axis}'",
                    did_you_mean(axis, mesh) or f"axes: {', '.join(mesh)}")


# ---- the mesh


def _mesh(ctx: Ctx) -> tuple[Facts, Diags]:
    """The mesh axes, each declared once with a size >= 1."""
    mesh: dict[str, int] = {}
    diags: Diags = []
    for axis, size, loc in ctx.p.mesh:
        if axis in mesh:
            diags.append(ctx.diag(loc, f"mesh axis '{axis}' is declared twice"))
        elif size < 1:
            diags.append(ctx.diag(loc, f"mesh axis '{axis}' has size {size}; sizes must be >= 1"))
        else:
            mesh[axis] = size
    if not diags and math.prod(mesh.values()) > MAX_RANKS:
        loc = ctx.p.mesh[0][2] if ctx.p.mesh else ctx.p.loc
        diags.append(ctx.diag(loc, f"mesh({', '.join(f'{a} = {n}' for a, n in mesh.items())}) "
                              f"has {math.prod(mesh.values())} ranks; MPI numbers ranks with "
                              f"32-bit ints: at most {MAX_RANKS}", "use smaller axes"))
    return Facts(mesh), diags


# ---- sample / attribute / parameter


def _sample_rule(ctx: Ctx, facts: Facts, d: str, loc: Loc, axis: str) -> Diagnostic | None:
    if d != ctx.batch:
        return ctx.diag(loc, f"sample maps the batch dim '{ctx.batch}' (the inputs' leading "
                        f"dim), not '{d}'", f"use 'attribute {d} -> {axis}' to split a data dim")
    if facts.soap["sample"]:
        return ctx.diag(loc, "only one sample mapping is allowed")
    return None


def _attribute_rule(ctx: Ctx, facts: Facts, d: str, loc: Loc, axis: str) -> Diagnostic | None:
    if d == ctx.batch:
        return ctx.diag(loc, f"'{d}' is the batch dim; split it with sample",
                        f"sample {d} -> {axis}")
    return None


def _parameter_rule(ctx: Ctx, facts: Facts, d: str, loc: Loc, axis: str) -> Diagnostic | None:
    if not any(d in prm.type.dims for prm in ctx.model.params):
        return ctx.diag(loc, f"'{d}' is no dim of any parameter",
                        f"use 'attribute {d} -> {axis}' to split activations")
    return None


# What each mapping statement may map, by its kind.
_SOAP_RULES: dict[str, Callable[..., Diagnostic | None]] = {
    "sample": _sample_rule, "attribute": _attribute_rule, "parameter": _parameter_rule}


def _dim_error(ctx: Ctx, facts: Facts, kind: str, d: str, loc: Loc,
               axis: str) -> Diagnostic | None:
    """Why `kind d -> axis` cannot map d (whatever the axis), or None."""
    if d not in ctx.dims:
        return ctx.diag(loc, f"model '{ctx.model.name}' has no dim '{d}'",
                        did_you_mean(d, ctx.dims))
    if d in facts.mapped:
        return _second_axis_error(ctx, facts, kind, d, loc, axis)
    return _SOAP_RULES[kind](ctx, facts, d, loc, axis)


def _second_axis_error(ctx: Ctx, facts: Facts, kind: str, d: str, loc: Loc,
                       axis: str) -> Diagnostic | None:
    """Why an already mapped dim may not also go to `axis`, or None: only an activation dim
    (`attribute`) splits over several axes, each later in the mesh than the last (its pieces
    nest in mesh order: sequence parallel inside context parallel, `attribute seq -> cp` then
    `attribute seq -> model` on mesh(cp, model))."""
    k, ax = facts.mapped[d]
    axes = [a for m, a in facts.soap["attribute"] if m == d]
    order = list(facts.mesh)
    if kind != "attribute" or k != "attribute" or axis not in order:
        return ctx.diag(loc, f"dim '{d}' is already mapped ({k} {d} -> {ax})",
                        "a dim maps to at most one mesh axis, except an activation dim "
                        "(attribute) split over several")
    if axis in axes or order.index(axis) < max(order.index(a) for a in axes):
        return ctx.diag(loc, f"'{d}' is split over {', '.join(axes)} already; a dim split "
                        "over several axes nests their pieces in mesh order, so each further "
                        "axis must come later in the mesh",
                        f"list '{axis}' after '{axes[-1]}' in mesh(...), or map '{d}' once")
    return None


def _map_dim(ctx: Ctx, facts: Facts, kind: str, d: str, loc: Loc, axis: str,
             axis_ok: bool) -> Diags:
    """Map one dim to an axis, if it may and divides over it."""
    err = _dim_error(ctx, facts, kind, d, loc, axis)
    if err is not None:
        return [err]
    if not axis_ok:
        return []
    facts.used.setdefault(axis, kind)  # even a dim that does not divide: no second error
    size, n = ctx.dims[d], facts.mesh[axis]
    # a second axis cuts each piece of the first: the dim divides over their product
    outer = [a for k, a in facts.soap[kind] if k == d]
    if outer and size // math.prod(facts.mesh[a] for a in outer) % n:
        facts.failed.add(kind)
        cut = " x ".join(f"{a} = {facts.mesh[a]}" for a in (*outer, axis))
        total = n * math.prod(facts.mesh[a] for a in outer)
        return [ctx.diag(loc, f"{d} = {size} does not divide over {cut}",
                         f"{nearest_divisible(size, total)} (--dim {d}=...), or map '{d}' "
                         "to one axis")]
    if size % n:
        facts.failed.add(kind)
        return [ctx.diag(loc, f"{d} = {size} does not divide over {axis} = {n}",
                         _divide_hint(ctx, facts, kind, d, axis))]
    facts.mapped.setdefault(d, (kind, axis))
    facts.map_loc.setdefault(d, loc)
    facts.soap[kind].append((d, axis))
    return []


def _divide_hint(ctx: Ctx, facts: Facts, kind: str, d: str, axis: str) -> str:
    """The valid choices for `kind d -> axis` when d does not divide: the axis sizes that
    divide d, the dims that could go to the axis instead, and (a weight dim) leaving d
    replicated; then the nearest dim sizes that would divide."""
    size, n = ctx.dims[d], facts.mesh[axis]
    sizes = divisors(size)[1:9]
    parts = [f"{axis} sizes that divide {d} = {size}: "
             + (", ".join(map(str, sizes)) if sizes else "none but 1 (it is 1)")]
    named = {o for st in ctx.p.body if isinstance(st, ast.Soap)
             for dims, _, _ in st.groups for o, _ in dims}  # mapped by this block already
    others = [o for o in ctx.dims if o not in named and ctx.dims[o] % n == 0
              and _SOAP_RULES[kind](ctx, facts, o, None, axis) is None]
    if others:
        parts.append(f"dims that divide over {axis} = {n} instead: "
                     + ", ".join(f"{o} = {ctx.dims[o]}" for o in others[:6]))
    if kind == "parameter":
        # a weight dim left unmapped is replicated on the axis (e.g. key/value heads fewer
        # than the tensor-parallel ranks: each rank keeps them all)
        parts.append(f"or leave {d} out of the statement: replicated on every {axis} rank")
    return "; ".join(parts) + f"; or {nearest_divisible(size, n)} (--dim {d}=...)"


def _soap(ctx: Ctx, facts: Facts, s: ast.Soap) -> Diags:
    """`sample|attribute|parameter dims -> axis, ...`."""
    diags: Diags = []
    for dims, axis, axis_loc in s.groups:
        bad_axis = _missing_axis(ctx, facts.mesh, axis, axis_loc)
        diags += [bad_axis] if bad_axis else []
        for d, loc in dims:
            diags += _map_dim(ctx, facts, s.kind, d, loc, axis, bad_axis is None)
    for dims, axis, loc in s.balanced:
        diags += [e for d, _ in dims if (e := _balanced_error(ctx, facts, s.kind, d, axis, loc))]
    return diags


def _balanced_inside(ctx: Ctx, d: str, axis: str, outer: str, loc: Loc) -> Diagnostic:
    """The refusal of a balanced split nested inside another axis's: zigzag chunks order the
    whole sequence, so only the outermost cut may be balanced (sequence parallel then cuts
    each rank's chunks, in their local order, over a later axis)."""
    return ctx.diag(loc, f"'{d}' is split over {outer} before {axis}: only its outermost "
                    f"split may be balanced (zigzag chunks of the whole {d})",
                    f"list '{axis}' before '{outer}' in mesh(...) and map '{d}' to it first, "
                    "or drop 'balanced'")


def _balanced_error(ctx: Ctx, facts: Facts, kind: str, d: str, axis: str,
                    loc: Loc) -> Diagnostic | None:
    """Why `attribute d -> axis balanced` (zigzag chunks: rank r holds r and 2n-1-r) cannot
    hold, or None (then d is recorded as balanced)."""
    if kind != "attribute":
        return ctx.diag(loc, f"'balanced' orders a sequence split; {kind} cannot use it",
                        f"drop 'balanced' here; the sequence takes it: attribute SEQ -> {axis} "
                        "balanced")
    axes = [a for m, a in facts.soap[kind] if m == d]
    if axis not in axes:
        return None  # the mapping itself was refused: its own error says why
    if axes[0] != axis:
        return _balanced_inside(ctx, d, axis, axes[0], loc)
    n = facts.mesh[axis]
    if ctx.dims[d] % (2 * n):
        return ctx.diag(loc, f"{d} = {ctx.dims[d]} does not cut into 2 x {axis} = {2 * n} "
                        "equal chunks (balanced holds chunks r and 2n-1-r on rank r)",
                        f"{nearest_divisible(ctx.dims[d], 2 * n)} (--dim {d}=...), or drop "
                        "'balanced'")
    if not ctx.model.causal_over(d):
        return ctx.diag(loc, f"'balanced' evens out a causal mask's work over {d}, but no "
                        f"attention of model '{ctx.model.name}' is causal over {d}",
                        f"drop 'balanced': attribute {d} -> {axis}")
    facts.balanced.append(d)
    return None


# ---- operator: branches


def _branch_error(ctx: Ctx, mesh: dict[str, int], d: ast.BranchDef, top: set[str],
                  outputs: set[str]) -> Diagnostic | None:
    """Why value `d.value` cannot be a branch on `d.axis d.coord`, or None."""
    if d.value not in top:
        return ctx.diag(d.loc, f"'{d.value}' is no top-level value of model '{ctx.model.name}'",
                        did_you_mean(d.value, top) or "branches name values assigned "
                        "outside repeat blocks")
    if f"{d.value}.1" in top:
        return ctx.diag(d.loc, f"'{d.value}' is assigned more than once; a branch names one "
                        "value", "give the branch's result its own name")
    if d.value in outputs:
        return ctx.diag(d.loc, f"'{d.value}' is a model output; a branch must feed later ops",
                        "place the ops before the output instead")
    missing = _missing_axis(ctx, mesh, d.axis, d.axis_loc)
    if missing is not None:
        return missing
    if not 0 <= d.coord < mesh[d.axis]:
        return ctx.diag(d.coord_loc, f"{d.axis} {d.coord} is out of range: axis '{d.axis}' has "
                        f"size {mesh[d.axis]} (0..{mesh[d.axis] - 1})")
    return None


def _branches(ctx: Ctx, facts: Facts, defs: list[ast.BranchDef]) -> Diags:
    """`operator a -> branch 0`: top-level values assigned once, on an existing axis."""
    top = {op.out for op in ctx.model.ops if op.block is None}
    outputs = {o.value for o in ctx.model.outputs}
    diags: Diags = []
    seen: set[str] = set()
    for d in defs:
        if d.value in seen:
            diags.append(ctx.diag(d.loc, f"value '{d.value}' is placed twice"))
            continue
        seen.add(d.value)
        err = _branch_error(ctx, facts.mesh, d, top, outputs)
        if err is not None:
            diags.append(err)
            continue
        facts.branches.append(Branch(d.value, d.axis, d.coord, d.loc))
    for d in defs:  # even a bad placement uses its axis: no second error
        facts.used.setdefault(d.axis, "branch")
    return diags


# ---- operator: pipeline stages


def _repeats(model: Model) -> dict[str, list[str]]:
    """Repeat name -> its block instances, in order."""
    repeats: dict[str, list[str]] = {}
    for b in model.blocks:
        repeats.setdefault(b.rsplit(".", 1)[0], []).append(b)
    return repeats


def _stage_def_error(ctx: Ctx, mesh: dict[str, int], repeats: dict[str, list[str]],
                     sd: ast.StageDef, axis: str) -> Diagnostic | None:
    """Why `repeat[lo..hi] -> axis stage` is no valid placement, or None."""
    if sd.axis != axis:
        return ctx.diag(sd.axis_loc, f"all stages must use one mesh axis ('{axis}')")
    n = len(repeats[sd.repeat])
    if sd.lo > sd.hi:
        return ctx.diag(sd.range_loc, f"empty range [{sd.lo}..{sd.hi}]", "write [low..high]")
    if sd.hi >= n:
        return ctx.diag(sd.range_loc, f"{sd.repeat} has {n} blocks (0..{n - 1}); "
                        f"[{sd.lo}..{sd.hi}] is out of range")
    if not 0 <= sd.stage < mesh[axis]:
        return ctx.diag(sd.stage_loc, f"stage {sd.stage} is out of range: axis '{axis}' has "
                        f"{mesh[axis]} stages (0..{mesh[axis] - 1})")
    return None


def _unknown_repeat(ctx: Ctx, repeats: dict[str, list[str]], sd: ast.StageDef) -> Diagnostic:
    return ctx.diag(sd.loc, f"model '{ctx.model.name}' has no repeat '{sd.repeat}'",
                    did_you_mean(sd.repeat, repeats) or
                    (f"repeats: {', '.join(repeats)}" if repeats else
                     "pipeline stages hold repeat blocks; the model has none"))


def _claim(ctx: Ctx, owner: dict[str, tuple[int, Loc]], blocks: list[str],
           sd: ast.StageDef) -> Diags:
    """Give `blocks` to stage `sd.stage`; a block given twice is an error."""
    diags: Diags = []
    for b in blocks:
        if b in owner:
            diags.append(ctx.diag(sd.range_loc, f"block {b} is assigned twice",
                                  f"it is already on {sd.axis} {owner[b][0]}"))
        owner[b] = (sd.stage, sd.range_loc)
    return diags


def _stages(ctx: Ctx, facts: Facts, defs: list[ast.StageDef], loc: Loc) -> Diags:
    """`operator layer[0..1] -> pipe 0, ...`: blocks on the stages of one axis."""
    repeats = _repeats(ctx.model)
    owner: dict[str, tuple[int, Loc]] = {}
    diags: Diags = []
    axis = None
    for sd in defs:
        if sd.repeat not in repeats:
            diags.append(_unknown_repeat(ctx, repeats, sd))
            continue
        if axis is None:  # the first placement names the axis; a missing one ends the check
            missing = _missing_axis(ctx, facts.mesh, sd.axis, sd.axis_loc)
            if missing is not None:
                return diags + [missing]
            axis = sd.axis
        err = _stage_def_error(ctx, facts.mesh, repeats, sd, axis)
        if err is not None:
            diags.append(err)
            continue
        blocks = repeats[sd.repeat][sd.lo: sd.hi + 1]
        diags += _claim(ctx, owner, blocks, sd)
        facts.stages.append(StageAssignment(tuple(blocks), axis, sd.stage, sd.loc))
    facts.pipe_axis = axis
    if axis is not None:
        facts.used[axis] = "operator"
    if diags or axis is None:
        return diags
    return _coverage(ctx, facts, owner, loc)


def _coverage(ctx: Ctx, facts: Facts, owner: dict[str, tuple[int, Loc]], loc: Loc) -> Diags:
    """Every block on a stage and every stage with a block."""
    blocks = ctx.model.blocks
    missing = [b for b in blocks if b not in owner]
    if missing:
        return [ctx.diag(loc, f"block {missing[0]} is assigned to no stage"
                         + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
                         "every repeat block goes to exactly one stage")]
    facts.stage_seq = [owner[b][0] for b in blocks]
    facts.stage_locs = [owner[b][1] for b in blocks]
    # the first stage without a block, from the stages named (never a walk over the axis)
    named = sorted(set(facts.stage_seq))
    empty = next((i for i, s in enumerate(named) if s != i), len(named))
    if empty < facts.mesh[facts.pipe_axis]:
        return [ctx.diag(loc, f"{facts.pipe_axis} stage {empty} gets no block",
                         "every stage needs at least one block")]
    return []


def _operator(ctx: Ctx, facts: Facts, s: ast.Operator) -> Diags:
    """`operator ...`: branches and pipeline stages."""
    stage_defs = [d for d in s.stages if not isinstance(d, ast.BranchDef)]
    diags = _branches(ctx, facts, [d for d in s.stages if isinstance(d, ast.BranchDef)])
    facts.has_stages = bool(stage_defs)
    if stage_defs:
        diags += _stages(ctx, facts, stage_defs, s.loc)
    return diags


# ---- schedule and zero (read here, checked by the rules below)


def _schedule(ctx: Ctx, facts: Facts, s: ast.ScheduleStmt) -> Diags:
    """`schedule kind, options`: checked once the pipeline and the sample mapping are known."""
    facts.schedule = s
    return []


def _zero(ctx: Ctx, facts: Facts, s: ast.Zero) -> Diags:
    """`zero N`: a ZeRO stage 0..3."""
    if not 0 <= s.level <= 3:
        return [ctx.diag(s.loc, f"zero {s.level}: the ZeRO stage is 0, 1, 2 or 3")]
    facts.zero = s.level
    return []


def _recompute(ctx: Ctx, facts: Facts, s: ast.Recompute) -> Diags:
    """`recompute R`: R names a repeat of the model, or is `selective` or `ops`."""
    repeats = _repeats(ctx.model)
    if s.repeat not in (SELECTIVE, OPS) and s.repeat not in repeats:
        hint = did_you_mean(s.repeat, [*repeats, SELECTIVE, OPS]) or (
            f"repeats: {', '.join(repeats)}; or `recompute {SELECTIVE}` or `recompute {OPS}`"
            if repeats else "wrap the layers to recompute in `repeat N as NAME { ... }`, or "
            f"write `recompute {SELECTIVE}` or `recompute {OPS}`")
        return [ctx.diag(s.loc, f"recompute {s.repeat}: model {ctx.model.name} has no repeat "
                         f"'{s.repeat}'", hint)]
    facts.recompute = s.repeat
    return []


def _offload(ctx: Ctx, facts: Facts, s: ast.Offload) -> Diags:
    """`offload optimizer`: the only state that moves to host memory is the optimizer's."""
    if s.what != "optimizer":
        return [ctx.diag(s.loc, f"offload {s.what}: only the optimizer's state can be "
                         "offloaded", "write `offload optimizer`")]
    facts.offload = s.what
    return []


def _overlap(ctx: Ctx, facts: Facts, s: ast.Overlap) -> Diags:
    """`overlap tensor`: the tensor axis's sequence-parallel collectives run as collective
    matmuls; nothing else overlaps by this statement."""
    if s.what != "tensor":
        return [ctx.diag(s.loc, f"overlap {s.what}: only the tensor-parallel collectives can "
                         "be overlapped with their matmuls", "write `overlap tensor`")]
    facts.overlap = s.what
    return []


_STATEMENTS: dict[type, Callable[..., Diags]] = {
    ast.Soap: _soap, ast.Operator: _operator, ast.ScheduleStmt: _schedule, ast.Zero: _zero,
    ast.Recompute: _recompute, ast.Offload: _offload, ast.Overlap: _overlap}
# statements a block has at most one of
_ONCE = (ast.Operator, ast.ScheduleStmt, ast.Zero, ast.Recompute, ast.Offload, ast.Overlap)


def _statement(ctx: Ctx, facts: Facts, s) -> Diags:
    """One statement of the block; a second once-only statement is an error."""
    if isinstance(s, _ONCE):
        if s.KEYWORD in facts.seen:
            return [ctx.diag(s.loc, f"a second '{s.KEYWORD}' statement",
                             "put everything in one statement")]
        facts.seen[s.KEYWORD] = s.loc
    return _STATEMENTS[type(s)](ctx, facts, s)


# ---- rules across statements


def _branch_axes(ctx: Ctx, facts: Facts) -> Diags:
    """An axis that places branches does nothing else."""
    return [ctx.diag(b.loc, f"axis '{b.axis}' places branches and cannot also "
                     f"{'hold pipeline stages' if b.axis == facts.pipe_axis else 'split dims'}",
                     "give the branches their own mesh axis")
            for b in facts.branches if facts.used.get(b.axis) != "branch"]


def _pipe_axis_splits(ctx: Ctx, facts: Facts) -> Diags:
    """The axis that holds pipeline stages splits no dim."""
    split = {ax for pairs in facts.soap.values() for _, ax in pairs}
    if facts.pipe_axis is None or facts.pipe_axis not in split:
        return []
    return [ctx.diag(facts.seen["operator"], f"axis '{facts.pipe_axis}' holds pipeline stages "
                     "and cannot also split dims", "give the pipeline its own mesh axis")]


def _unused_axes(ctx: Ctx, facts: Facts) -> Diags:
    """Every mesh axis of size > 1 is used by some statement."""
    repeats = list(_repeats(ctx.model))
    diags: Diags = []
    for axis, size, loc in ctx.p.mesh:
        if size > 1 and axis in facts.mesh and axis not in facts.used:
            stages = (f", place pipeline stages on it (operator {repeats[0]}[0..k] -> {axis} 0, "
                      "...)" if repeats else "")
            diags.append(ctx.diag(loc, f"mesh axis '{axis}' (size {size}) is used by no "
                                  f"statement", f"map a dim to it (sample {ctx.batch} -> "
                                  f"{axis}){stages}, or make its size 1"))
    return diags


def _one_dim_per_axis(ctx: Ctx, facts: Facts) -> Diags:
    """A tensor splits along at most one of its dims per mesh axis: an input (sample and
    attribute mappings) or a parameter (parameter mappings) with two dims mapped to one
    axis is an error (the lowering would keep the first and drop the second)."""
    order = {d: i for i, d in enumerate(facts.map_loc)}
    soap = facts.soap
    leaves = [(f"input '{i.name}'", i.type.dims, soap["sample"] + soap["attribute"])
              for i in ctx.model.inputs]
    leaves += [(f"parameter '{prm.name}'", prm.type.dims, soap["parameter"])
               for prm in ctx.model.params]
    diags: Diags = []
    seen: set[tuple[str, str]] = set()
    for what, dims, mapping in leaves:
        first: dict[str, str] = {}  # axis -> the first mapped dim of this tensor on it
        for d, axis in sorted(mapping, key=lambda m: order[m[0]]):
            if d not in dims or first.setdefault(axis, d) == d or (first[axis], d) in seen:
                continue
            seen.add((first[axis], d))
            diags.append(ctx.diag(facts.map_loc[d], f"{what} [{', '.join(dims)}] would split "
                                  f"both '{first[axis]}' and '{d}' over axis '{axis}'; a tensor "
                                  "splits along at most one dim per mesh axis",
                                  f"map '{d}' to another mesh axis"))
    return diags


def _zero_needs_sample(ctx: Ctx, facts: Facts) -> Diags:
    """`zero N` (N >= 1) shards over the sample axes and the context-parallel ones (attribute
    axes no parameter statement splits), so it needs one of them."""
    split = {a for _, a in facts.soap["parameter"]}
    context = [a for _, a in facts.soap["attribute"] if a not in split]
    if not ZeroStage.of(facts.zero).shards_optimizer or facts.soap["sample"] or context \
            or "sample" in facts.failed:
        return []
    return [ctx.diag(facts.seen["zero"], f"zero {facts.zero} shards optimizer state over the "
                     "sample (data-parallel) axes and the context-parallel ones, but no sample "
                     "statement maps the batch and every attribute axis splits parameters",
                     f"add: sample {ctx.batch} -> AXIS, or use zero 0")]


# The rules across statements, in the order they report.
_RULES = (_branch_axes, _pipe_axis_splits, _unused_axes, _one_dim_per_axis, _zero_needs_sample,
          schedule_rules)


def _parallel(p: ast.ParallelDef, facts: Facts) -> Parallel:
    """The checked block as IR."""
    s = facts.schedule
    sched = Schedule()
    if s is not None:
        opts = {k: v for k, v, _ in s.options}
        # a V schedule's two stages per rank are its own (no `chunks` option)
        per_rank = schedules.get(s.kind).stages_per_rank if s.kind in schedules.KINDS else 1
        sched = Schedule(s.kind, opts.get("microbatches", 1), opts.get("chunks", per_rank))
    soap = facts.soap
    return Parallel(p.name, p.model, tuple(facts.mesh.items()), tuple(soap["sample"]),
                    tuple(soap["attribute"]), tuple(soap["parameter"]), tuple(facts.stages),
                    sched, facts.zero, p.loc, tuple(facts.branches), s is not None,
                    recompute=facts.recompute, offload=facts.offload,
                    overlap=facts.overlap,
                    balanced=tuple(facts.balanced))


def check_parallel(p: ast.ParallelDef, model: Model,
                   sources: Sources) -> tuple[Parallel | None, list[Diagnostic]]:
    """Check one parallel block against its (checked) model: (ir.Parallel | None, diagnostics)."""
    ctx = Ctx.of(p, model, sources)
    facts, diags = _mesh(ctx)
    for s in p.body:
        diags += _statement(ctx, facts, s)
    for rule in _RULES:
        diags += rule(ctx, facts)
    if not diags and facts.schedule is None:  # order matters without a schedule statement too
        diags += block_order(ctx, facts, None, 1, 1, None)
    return (None if diags else _parallel(p, facts)), diags
