"""Which values an op may overwrite with its gradient (pure data, no torch).

An op whose record says `grad_in_place` (cross_entropy: its backward writes the logits'
gradient chunk by chunk) may write into its first arg's storage only where nothing else can
see that storage again: the arg is made in this Program by a step that neither aliases another
value nor keeps its own output for backward (a fused linear keeps only its input), it has no
reader but this op, is no output of the Program, is not dropped or gathered again for backward
(selective recompute, sequence parallelism), and is not the saved input of a recompute range
that holds the op but not its maker. The runtime gives the kernels this set
(Shards.overwritable); explain counts the gradient as the arg's own bytes there
(shard/plan/analysis/activations.py).
"""

from __future__ import annotations

from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.program import Compute, Program
from soapstone.shard.runtime.fusion_plan import FusedLinear


def overwritable(program: Program, fused: dict) -> frozenset[str]:
    """The first args of `grad_in_place` steps that their backward may overwrite (module doc);
    `fused`: the chains the runtime fuses (fusion_plan.find_fusions, or {} unfused)."""
    covered = {i for f in fused.values() for i in f.covered}
    made = {f.out: ("fused", f) for f in fused.values()}
    for i, s in enumerate(program.steps):
        if i not in covered and s.out not in made:
            made[s.out] = (i, s)
    readers: dict[str, int] = {}
    for i, s in enumerate(program.steps):
        if i in covered:
            continue
        for a in s.args if isinstance(s, Compute) else (s.src,):
            readers[a] = readers.get(a, 0) + 1
    for f in fused.values():  # a chain reads its inputs where it runs
        for a in ((f.q, f.k, f.v) if not isinstance(f, FusedLinear) else (f.x, f.w, f.bias)):
            readers[a] = readers.get(a, 0) + 1
    closed = {o.value for o in program.outputs} | set(program.dropped) | set(
        program.regathered)
    found = set()
    for i, s in enumerate(program.steps):
        if i in covered or not isinstance(s, Compute) or not record_of(s.kind).grad_in_place:
            continue
        name = s.args[0]
        if name in closed or readers.get(name) != 1 or name not in made:
            continue
        where, maker = made[name]
        if where == "fused":
            if not isinstance(maker, FusedLinear):
                continue
            where = maker.at
        elif not _keeps_nothing_of_its_output(program, maker):
            continue
        if any(a <= i < b and not a <= where < b for a, b in program.recompute):
            continue
        found.add(name)
    return frozenset(found)


def _keeps_nothing_of_its_output(program: Program, step) -> bool:
    """A Compute step that makes new storage and keeps no part of it for backward."""
    if not isinstance(step, Compute):
        return False  # a collective's result: its storage is the communicator's business
    rec = record_of(step.kind)
    if rec.aliases(step):
        return False
    params = {p.name for p in program.params}
    floats = [a for a in step.args if a not in params and program.value(a).is_float]
    return step.out not in rec.saves(step, program, floats)[0]
