"""The schedule statement's rules: its kind (read from the schedules registry), its options,
its microbatches against the per-replica batch, chunks, and the stage order its placement
needs; a split backward's limits. Pure Python; never imports torch."""

from __future__ import annotations

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import did_you_mean
from soapstone.dsl.model.ir import OPS, SELECTIVE, Loc
from soapstone.dsl.model.parallel_facts import Ctx, Diags, Facts
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan import schedules
from soapstone.shard.plan.schedules import KINDS as SCHEDULES
from soapstone.shard.plan.schedules import ScheduleKind
from soapstone.shard.plan.schedules.placement import cut
from soapstone.shard.plan.sizes import divisors

SCHEDULE_OPTIONS = ("microbatches", "chunks")


def _schedule_kind(ctx: Ctx, s: ast.ScheduleStmt) -> tuple[ScheduleKind, Diags]:
    """The schedule's kind (1f1b in place of an unknown one, to check the rest)."""
    if s.kind in SCHEDULES:
        return schedules.get(s.kind), []
    return schedules.get("1f1b"), [ctx.diag(s.kind_loc, f"unknown schedule '{s.kind}'",
                             did_you_mean(s.kind, SCHEDULES)
                             or f"schedules: {', '.join(SCHEDULES)}")]


def _schedule_options(ctx: Ctx, s: ast.ScheduleStmt) -> tuple[dict[str, int], Diags]:
    """The valid options, each given once and >= 1."""
    opts: dict[str, int] = {}
    diags: Diags = []
    for key, value, loc in s.options:
        if key not in SCHEDULE_OPTIONS:
            diags.append(ctx.diag(loc, f"unknown schedule option '{key}'",
                                  did_you_mean(key, SCHEDULE_OPTIONS)
                                  or "options: microbatches, chunks"))
        elif key in opts:
            diags.append(ctx.diag(loc, f"schedule option '{key}' is given twice"))
        elif value < 1:
            diags.append(ctx.diag(loc, f"{key} = {value}; it must be >= 1"))
        else:
            opts[key] = value
    return opts, diags


def _microbatches_divide(ctx: Ctx, facts: Facts, s: ast.ScheduleStmt, mb: int) -> Diags:
    """The microbatches divide the per-replica batch."""
    if ctx.batch is None or "sample" in facts.failed:
        return []  # a sample mapping that failed leaves the per-replica batch unknown
    sample = facts.soap["sample"]
    replicas = facts.mesh.get(sample[0][1], 1) if sample else 1
    per = ctx.dims[ctx.batch] // replicas
    if per % mb == 0:
        return []
    near = min(divisors(per), key=lambda n: (abs(n - mb), n))
    return [ctx.diag(_option_loc(s, "microbatches", s.loc), f"microbatches = {mb} does not "
                     f"divide the per-replica batch {ctx.batch} / {replicas} = {per}",
                     f"use microbatches = {near}")]


def _option_loc(s: ast.ScheduleStmt, key: str, default: Loc) -> Loc:
    """Where option `key` is given (the last time), else `default`."""
    return {k: loc for k, _, loc in s.options}.get(key, default)


def _chunks(ctx: Ctx, s: ast.ScheduleStmt, kind: ScheduleKind, mb: int, chunks: int,
            nstages: int) -> Diags:
    """`chunks` belongs to a chunked schedule (interleaved), which needs >= 2; interleaved's
    microbatches go in groups of the stage count."""
    diags: Diags = []
    if not kind.chunked:
        if chunks != 1:
            diags.append(ctx.diag(_option_loc(s, "chunks", s.loc), "chunks applies to the "
                                  f"{' or '.join(schedules.CHUNKED)} schedule, not {kind.name}"))
    elif chunks < 2:
        diags.append(ctx.diag(_option_loc(s, "chunks", s.kind_loc),
                              f"{kind.name} needs chunks >= 2 (got {chunks})",
                              "add: chunks = 2 (virtual stages per rank)"))
    if kind.whole_groups and mb % nstages:
        diags.append(ctx.diag(_option_loc(s, "microbatches", s.loc),
                              f"{kind.name} needs microbatches ({mb}) to be a multiple of the "
                              f"stage count ({nstages})"))
    return diags


def block_order(ctx: Ctx, facts: Facts, kind: ScheduleKind | None, chunks: int,
                 nstages: int, loc: Loc | None) -> Diags:
    """Stages follow block order; a schedule with several stages per rank has its stages
    visit the pipe ranks in its placement's order (interleaved: cycle 0..n-1 `chunks` times;
    a V: 0..n-1 then n-1..0, the last rank's two stages as two operator ranges)."""
    seq = facts.stage_seq
    if not seq:
        return []
    per_rank = kind.per_rank(chunks) if kind is not None else 1
    if per_rank > 1:
        if nstages * per_rank > len(seq):  # never build that order: chunks may be 1e20
            return [ctx.diag(loc, f"{kind.name} runs {nstages} x {per_rank} stages of at least "
                             f"one block each, but the model has {len(seq)} blocks",
                             "use fewer chunks or pipe ranks")]
        order = kind.ranks(nstages, per_rank)
        at = cut(list(zip(seq, facts.stage_locs, strict=True)), order)
        runs = [seq[i] for i in range(len(seq)) if i == 0 or at[i] != at[i - 1]]
        if runs == order:
            return []
        if kind.chunked:
            return [ctx.diag(loc, f"{kind.name} stages must cycle 0..{nstages - 1} {chunks} "
                             f"times over the blocks, got {' '.join(map(str, runs))}",
                             "assign contiguous chunks: layer[0] -> pipe 0, layer[1] -> pipe 1, "
                             "...")]
        return [ctx.diag(loc, f"{kind.name} stages must go {' '.join(map(str, order))} over the "
                         f"blocks (a V: down the pipe ranks and back), got "
                         f"{' '.join(map(str, runs))}", _v_hint(nstages))]
    blocks = ctx.model.blocks
    for i in range(len(seq) - 1):
        if seq[i] > seq[i + 1]:
            return [ctx.diag(facts.stage_locs[i + 1], f"block {blocks[i + 1]} is on stage "
                             f"{seq[i + 1]}, before the stage {seq[i]} of {blocks[i]}",
                             "stages must follow block order (block i's stage <= block i+1's)")]
    return []


def _v_hint(pipe: int) -> str:
    """An operator statement for a V over `pipe` ranks, one block per stage."""
    ranks = list(range(pipe)) + list(range(pipe - 1, -1, -1))
    return ("place the blocks down and back, the last rank's two stages as two ranges: "
            "operator " + ", ".join(f"layer[{i}] -> pipe {r}" for i, r in enumerate(ranks)))


def schedule_rules(ctx: Ctx, facts: Facts) -> Diags:
    """The schedule statement: its kind and options against the pipeline and the batch."""
    s = facts.schedule
    if s is None:
        return []
    kind, diags = _schedule_kind(ctx, s)
    opts, more = _schedule_options(ctx, s)
    diags += more
    mb, chunks = opts.get("microbatches", 1), opts.get("chunks", 1)
    nstages = facts.mesh.get(facts.pipe_axis, 1) if facts.pipe_axis else 1
    diags += _microbatches_divide(ctx, facts, s, mb)
    diags += _chunks(ctx, s, kind, mb, chunks, nstages)
    if facts.has_stages and kind.least is not None and mb < kind.least(nstages):
        least = kind.least(nstages)
        diags.append(ctx.diag(_option_loc(s, "microbatches", s.kind_loc),
                              f"{kind.name} needs microbatches >= {least} at pipe {nstages} "
                              f"({kind.why_least}), got {mb}", f"use microbatches = {least}"))
    if facts.stages:
        diags += block_order(ctx, facts, kind, chunks, nstages, s.kind_loc)
    if not facts.has_stages and kind.needs_stages:
        # without stages the microbatches are gradient accumulation, in 1f1b or gpipe order
        why = f" ({kind.why_stages})" if kind.why_stages else ""
        diags.append(ctx.diag(s.kind_loc, f"the {kind.name} schedule needs pipeline stages{why}",
                              "add: operator <repeat>[0..k] -> pipe 0, ...; or use 1f1b "
                              "(gradient accumulation over the microbatches)"))
    return diags + _split_backward(ctx, facts, kind)


def _split_backward(ctx: Ctx, facts: Facts, kind: ScheduleKind) -> Diags:
    """A split backward (zb1p) runs each stage's weight half later (shard/plan/schedules/):
    what that half reads must still be there."""
    if not kind.split:
        return []
    diags: Diags = []
    name = kind.name
    if ZeroStage.of(facts.zero).shards_params:
        diags.append(ctx.diag(facts.seen["zero"], f"zero 3 with {name}: ZeRO-3 gathers a "
                              "stage's parameters for one backward and frees them at its end, "
                              f"but {name} runs the weight gradients later, apart from it",
                              f"use zero 1 or 2 with {name}, or schedule 1f1b with zero 3"))
    if facts.recompute is not None:
        why = (f"the values it drops are rebuilt for one backward, and {name}'s weight "
               "gradients run apart from it, later" if facts.recompute in (SELECTIVE, OPS) else
               "the deferred weight gradients would run each recomputed range's forward a "
               "second time, collectives included")
        diags.append(ctx.diag(facts.seen["recompute"], f"recompute {facts.recompute} with "
                              f"{name}: " + why, "drop the recompute statement, or use "
                              "schedule 1f1b"))
    if facts.overlap:
        diags.append(ctx.diag(facts.seen["overlap"], f"overlap tensor with {name}: a ring's "
                              "backward is one pass over its chunks (the input gradients "
                              "travel the ring as the weight gradients are taken), which "
                              f"{name} would run twice, as its B and its W",
                              "drop `overlap tensor`, or schedule 1f1b with it"))
    return diags
