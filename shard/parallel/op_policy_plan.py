"""Recompute by op policy (`recompute ops`): torchtitan's selective activation checkpointing
(selective_ac_option = 'op'), decided over the compiled ops of each repeated block.

torchtitan saves, per transformer block, the outputs of every other matmul (the 1st, 3rd, ...
of the block's aten.mm calls: wq, wv, w1, w2 of a LLaMA block) and of the attention kernel,
and runs everything else again in backward: the norms, rope, the activations and the other
matmuls (wk, wo, w3). The rule here, per block of a repeat (the step's block, as lowered), pure
data and no torch:

- anchors, held for backward: the output of each odd-numbered weight matmul of the block (a
  matmul-bound step reading a parameter, counted in step order) and of each matmul without a
  weight (attention's p . v: the fused kernel's output);
- dropped: every other value made in the block that some kernel keeps for backward (else
  dropping frees nothing), read only inside the block (the block's output is the next one's
  input, which torchtitan's checkpoint keeps), and rebuildable: each step of its rebuild is a
  local op of the block with a known cost (no collective, no distributed form, no
  branch-owned op, no fused chain; the even-numbered weight matmuls included), reading
  parameters, anchors, kept values, other dropped values (rebuilt first) or unsaved
  intermediates it rebuilds too; and the value is its own storage (no view of another, none
  taken of it), so freeing it frees exactly its bytes;
- held (Program.held): the anchors that no kernel keeps but a rebuild reads (q and v of a
  LLaMA block): kept alive from forward until the rebuild that reads them.

Under ZeRO-3 a rebuilt weight matmul reads a parameter backward gathers anyway, for its own
gradient: the runtime gathers that bucket at the rebuild (shard/parallel/zero.py's
`gather_for`), where backward's unpack finds it already gathered, so no gather is added.
A LLaMA block keeps its input, q, v, the attention output and its log-sum-exp, and the gate
half of the MLP (27,712 elements per token at Llama 3.1 8B's widths, tests/shard/parallel/
test_op_policy.py); torchtitan's 31,808 also holds w2's output, which its backward never reads.
A linear with a bias runs as one fused kernel (fusion_plan.py), never run again here: on
gpt.par this rule drops what `recompute selective` does and reruns no matmul.
"""

from __future__ import annotations

from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.analysis.activations import step_saves
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.runtime.fusion_plan import find_fusions


def _anchors(program: Program, blocks: tuple[str | None, ...], params: set[str]) -> set[str]:
    """The outputs the policy holds: the odd weight matmuls' of each block, and every
    weightless matmul's (attention's core, fused or not)."""
    count: dict[str, int] = {}
    out: set[str] = set()
    for s, b in zip(program.steps, blocks, strict=True):
        if b is None or not isinstance(s, Compute) or record_of(s.kind).bound is not Bound.MATMUL:
            continue
        if not set(s.args) & params:
            out.add(s.out)
            continue
        count[b] = count.get(b, 0) + 1
        if count[b] % 2 == 1:
            out.add(s.out)
    return out


def op_policy_drops(program: Program, blocks: tuple[str | None, ...]
                    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(values `recompute ops` drops, in step order; anchors held for their rebuilds) of
    `program`, whose step i was lowered from repeat block `blocks[i]` (module doc)."""
    fused = find_fusions(program)
    covered = {c for f in fused.values() for c in f.covered}
    in_fusion = covered | set(fused)
    params = {p.name for p in program.params}
    outputs = {o.value for o in program.outputs}
    steps = program.steps
    kept: set[str] = set()
    for i in range(len(steps)):
        if i not in covered:
            kept.update(step_saves(program, i, fused, params)[0])
    viewed: set[str] = set()
    readers: dict[str, set[str | None]] = {}
    for s, b in zip(steps, blocks, strict=True):
        reads = s.args if isinstance(s, Compute) else (s.src,)
        for a in reads:
            readers.setdefault(a, set()).add(b)
        if isinstance(s, CopyTo) or (
                isinstance(s, Redistribute) and s.kind is RedistributeKind.SLICE):
            viewed.add(s.src)
        elif isinstance(s, Compute) and record_of(s.kind).aliases(s):
            viewed.add(s.args[0])
    anchors = _anchors(program, blocks, params)
    made_in = {s.out: b for s, b in zip(steps, blocks, strict=True)}
    # rebuildable[v]: the anchors its rebuild reads (v made by a local op of its block)
    rebuildable: dict[str, set[str]] = {}
    dropped: list[str] = []
    gone: set[str] = set()  # the same, for lookups
    for i, s in enumerate(steps):
        b = blocks[i]
        if b is None or not isinstance(s, Compute) or i in in_fusion or s.dist or s.owner \
                or s.out in anchors or s.out in outputs:
            continue
        rec = record_of(s.kind)  # a view is free; an op of unknown cost is never run again
        if rec.bound is not Bound.VIEW and rec.flops_per_element(s, program) is None:
            continue
        reads: set[str] = set()
        for a in s.args:
            if a in params:
                continue
            if a in anchors:
                reads.add(a)
            elif a in rebuildable and made_in[a] == b and (a in gone or a not in kept):
                reads |= rebuildable[a]  # dropped (rebuilt first) or rebuilt on the way
            elif a not in kept or not program.value(a).is_float:
                break  # not there in backward
        else:
            rebuildable[s.out] = reads
            if s.out in kept and readers.get(s.out, set()) == {b} \
                    and rec.bound is not Bound.VIEW and s.out not in viewed \
                    and program.value(s.out).is_float:
                dropped.append(s.out)
                gone.add(s.out)
    reached = set().union(*(rebuildable[d] for d in dropped)) if dropped else set()
    held = tuple(s.out for s in steps if s.out in reached and s.out not in kept)
    return tuple(dropped), held
