"""Sequence parallelism's gathered linear inputs (Program.regathered): which gathered values
forward frees after their last use and backward gathers again from the shard.

Under sequence parallelism a column-parallel linear (QKV, the MLP's first) reads its input
gathered over the sequence; the matmul keeps that whole input for its weight gradient. As
Megatron does (Korthikanti et al., arXiv:2205.05198, section 4.2.2), the runtime keeps the
1/t shard instead and all-gathers it once more just before the matmuls' backward: one more
all-gather per such input in backward for (t-1)/t of its bytes kept. The rule, per
Redistribute step (pure data, no torch):

- an all-gather whose gradient is a partial sum (`grad=partial`: the sequence-parallel one),
  of a float value, outside any `recompute R` range (which runs the gather again anyway);
- every reader of the gathered value is a matmul with a weight (a linear), run by a rank
  that owns it, and none views it, so freeing its storage frees exactly its bytes;
- some kernel keeps it for backward (else there is nothing to free).

The runtime (shard/parallel/selective.py) frees and refills it as it does a dropped value;
the gather it runs again is the step's own, on the same communicator.
"""

from __future__ import annotations

import attrs

from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.ring_plan import find_rings
from soapstone.shard.plan.analysis.activations import step_saves
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, GradPlacement, Program, Redistribute
from soapstone.shard.runtime.fusion_plan import find_fusions


def regathered(program: Program) -> tuple[str, ...]:
    """The gathered values backward gathers again instead of keeping (module doc)."""
    params = {p.name for p in program.params}
    outputs = {o.value for o in program.outputs}
    fused = find_fusions(program)
    covered = {c for f in fused.values() for c in f.covered}
    in_range = {i for a, b in program.recompute for i in range(a, b)}
    in_range |= set(find_rings(program))  # a ring keeps its chunks (collective_matmul.py)
    kept: set[str] = set()
    readers: dict[str, list] = {}
    for i, s in enumerate(program.steps):
        if i not in covered:
            kept.update(step_saves(program, i, fused, params)[0])
        for a in s.args if isinstance(s, Compute) else (s.src,):
            readers.setdefault(a, []).append(s)
    out = []
    for i, s in enumerate(program.steps):
        if not isinstance(s, Redistribute) or s.kind is not RedistributeKind.ALLGATHER \
                or s.grad is not GradPlacement.PARTIAL or i in in_range \
                or not program.value(s.src).is_float or s.out in outputs or s.out not in kept:
            continue
        if all(isinstance(r, Compute) and not r.owner and not r.dist
               and record_of(r.kind).bound is Bound.MATMUL and set(r.args) & params
               for r in readers.get(s.out, ())):
            out.append(s.out)
    return tuple(out)


def gather_step(program: Program, name: str) -> int:
    """The index of the step that gathers regathered value `name`."""
    return next(i for i, s in enumerate(program.steps) if s.out == name)


def first_backward_reader(program: Program, name: str, runs_at: dict[int, int]) -> int:
    """The run index of the last step in forward that reads `name`: the first whose backward
    runs, where the gather runs again."""
    return max(runs_at.get(i, i) for i, s in enumerate(program.steps)
               if isinstance(s, Compute) and name in s.args)


def without_recompute(program: Program, selective: bool = False) -> Program:
    """`program` as it runs without its `recompute` ranges (and, with `selective`, without its
    selective drops): the gathered inputs the ranges covered are then regathered too."""
    plain = attrs.evolve(program, recompute=()) if not selective else attrs.evolve(
        program, recompute=(), dropped=(), held=(), drop_rule=None)
    return attrs.evolve(plain, regathered=regathered(plain))
