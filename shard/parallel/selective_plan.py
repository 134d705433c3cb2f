"""Selective recompute (`recompute selective`): which values forward frees after their last
use and backward computes again, decided from each op's cost per byte kept.

Megatron's selective recompute keeps the matmul outputs and drops what is large for the work
it takes: the attention core's [heads, seq, seq] scores and probabilities, and the outputs of
cheap elementwise ops. The rule, per value `v` a Compute step makes (pure data, no torch):

- something keeps v for backward (activations.py's model of each kernel's saves, fused chains
  included): else dropping it frees nothing;
- rebuilding v is cheap per byte kept: the FLOPs per element of v of its step (its op's
  record's `flops`: a count of the kernel's arithmetic for the elementwise ops, norms,
  softmax, masks, dropout; 2 x the contracted size for an einsum),
  plus those of any unsaved intermediates it needs again (scores -> mask -> softmax), below
  the cheapest matmul with a weight of the program. A weight matmul is never dropped, and
  neither is an op whose cost the rule does not know (embedding, moe, custom layers, losses);
- what rebuilding reads is there in backward at no cost: values something else keeps (or
  dropped ones, rebuilt first), and parameters, except under ZeRO-3, which frees them between
  uses (a second gather would be a collective the plan lacks);
- rebuilding makes no collective: no distributed form (dist), no branch-owned op, no fused
  chain (which runs another kernel than the step's own), and v is its own storage (no view of
  another value, none taken of it), so freeing it frees exactly its bytes.

Under the fused attention kernel (fusions.py) the scores are never kept, so on such models
the rule finds the norms' and activations' outputs that the next matmul keeps.
"""

from __future__ import annotations

import math

from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.analysis.activations import step_saves
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.runtime.fusion_plan import find_fusions


def _flops_per_element(program: Program, step: Compute) -> float | None:
    """FLOPs per output element of `step`; None for an op the rule never drops."""
    return record_of(step.kind).flops_per_element(step, program)


def _threshold(program: Program, params: set[str]) -> float:
    """FLOPs per output element of the cheapest matmul with a weight (inf without one)."""
    costs = [_flops_per_element(program, s) for s in program.steps if isinstance(s, Compute)
             and record_of(s.kind).bound is Bound.MATMUL and set(s.args) & params]
    return min((c for c in costs if c is not None), default=math.inf)


def selective_drops(program: Program) -> tuple[str, ...]:
    """The values `recompute selective` drops from `program` (module doc), in step order."""
    fused = find_fusions(program)
    in_fusion = {i for f in fused.values() for i in (*f.covered, f.at)}
    params = {p.name for p in program.params}
    outputs = {o.value for o in program.outputs}
    steps = program.steps
    kept: set[str] = set()  # what some kernel keeps for backward
    for i in range(len(steps)):
        if i not in {c for f in fused.values() for c in f.covered}:
            kept.update(step_saves(program, i, fused, params)[0])
    viewed = set()  # values another is a view or copy-to of
    for s in steps:
        if isinstance(s, CopyTo) or (
                isinstance(s, Redistribute) and s.kind is RedistributeKind.SLICE):
            viewed.add(s.src)
        elif isinstance(s, Compute) and record_of(s.kind).aliases(s):
            viewed.add(s.args[0])  # a view, or an identity (dropout at p = 0)
    limit = _threshold(program, params)
    cost: dict[str, float] = {}  # value -> FLOPs per element to rebuild it, where rebuildable
    dropped: list[str] = []
    for i, s in enumerate(steps):
        if not isinstance(s, Compute) or i in in_fusion or s.dist or s.owner \
                or record_of(s.kind).bound is Bound.VIEW or s.out in outputs or s.out in viewed:
            continue
        own = _flops_per_element(program, s)
        if own is None or not program.value(s.out).is_float:
            continue
        total = own
        n_out = math.prod(program.value(s.out).local_shape) or 1
        for a in s.args:
            if a in params:
                if ZeroStage.of(program.zero).shards_params:
                    break
            elif not program.value(a).is_float:
                break
            elif a in cost and a not in kept:  # an unsaved intermediate: rebuilt too
                total += cost[a] * math.prod(program.value(a).local_shape) / n_out
            elif a not in kept:
                break
        else:
            if total < limit:
                cost[s.out] = total
                if s.out in kept:
                    dropped.append(s.out)
    return tuple(dropped)


def rebuild_steps(program: Program, name: str) -> tuple[int, ...]:
    """The steps backward runs to rebuild dropped value `name`, in order: its own and those of
    the unsaved intermediates it reads (each read value that is neither a parameter nor kept
    is one of those)."""
    where = {s.out: i for i, s in enumerate(program.steps)}
    fused = find_fusions(program)
    params = {p.name for p in program.params}
    kept = set()
    covered = {c for f in fused.values() for c in f.covered}
    for i in range(len(program.steps)):
        if i not in covered:
            kept.update(step_saves(program, i, fused, params)[0])
    kept = (kept - set(program.dropped)) | set(program.held)  # held: recompute ops's anchors
    order: list[int] = []

    def visit(v: str) -> None:
        i = where[v]
        for a in program.steps[i].args:
            if a not in params and a not in kept and a not in program.dropped:
                visit(a)
        if i not in order:
            order.append(i)

    visit(name)
    return tuple(order)


def selective_flops(program: Program) -> float:
    """The FLOPs backward runs again under `recompute selective` (one microbatch, this rank):
    each dropped value's rebuild, its unsaved intermediates included."""
    total = 0.0
    for name in program.dropped:
        for i in rebuild_steps(program, name):
            s = program.steps[i]
            per = _flops_per_element(program, s) or 0.0  # a view (recompute ops's chains) is free
            total += per * math.prod(program.value(s.out).local_shape)
    return total
