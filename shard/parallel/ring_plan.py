"""`overlap tensor` (AsyncTP): which sequence-parallel collectives run as collective matmuls,
rings of async p2p steps overlapped with the matmuls beside them (comm/collective_matmul.py).
Pure data, no torch: the runtime, `show`, the call verifier and the cost model read it.

Two shapes qualify, on any mesh axis, by what the steps are (never by name):

- a gather ring: an all-gather of a float value over a split dim d whose gradient is a partial
  sum (sequence parallelism's), every reader of the gathered value a weight matmul (an einsum
  of it and a parameter) that carries d through to its output. The readers run at the
  gather, each applied to every chunk as the chunks travel the ring;
- a scatter ring: a reduce-scatter onto a split dim d of the partial sum of one weight matmul,
  read by nothing else, whose input carries d through. The matmul runs at the reduce-scatter,
  chunk by chunk, its partial sums travelling the ring.

Inside a `recompute R` range a ring runs in forward without keeping its per-chunk graphs and
again in backward's rerun of the range, which builds them (comm's Checkpointed). Steps fused
into a kernel chain, on a branch, on a balanced dim's own (zigzag) axis, or touching a value
`recompute selective` / `ops` rebuilds stay as they are (sequence parallel inside `cp
balanced` rings: its axis moves the cp pieces as they lie). Under ZeRO-3 a ring's matmuls
count as run at its collective step (ShardedModel.run_index), so zero.py gathers their
weights' buckets before the ring and frees them after it. The rings' p2p traffic is the
collective's: t-1 messages of one chunk each way.

Under `--precision float8` a ring whose matmuls are float8 steps (einsum.float8_steps) runs
them in float8 at the blocking step's scales (`float8_rings`; shard/runtime/float8.py
`Float8GatherRing`, `Float8ScatterRing`): a gather ring sends e4m3 chunks (after a one-scalar
amax allreduce), a scatter ring's backward e5m2 ones; the partial sums stay bf16.
"""

from __future__ import annotations

import attrs

from soapstone.shard.plan.balanced import own_axes
from soapstone.shard.plan.layout import RedistributeKind, Split
from soapstone.shard.plan.program import Compute, GradPlacement, Program, Redistribute
from soapstone.shard.runtime.fusion_plan import find_fusions


@attrs.frozen
class Ring:
    """One collective matmul: the collective step `at`, the matmul steps it runs (`readers`
    of a gather, or the one producer of a reduce-scatter), the dim the ring cuts."""

    at: int
    kind: RedistributeKind  # ALLGATHER or REDUCE_SCATTER
    matmuls: tuple[int, ...]
    dim: str
    axis: str


def _weight_matmul(program: Program, step, params: set[str], dim: str):
    """The non-weight argument of `step` when it is a plain einsum of one value and a
    parameter that carries `dim` from that value to its output; else None."""
    if not isinstance(step, Compute) or step.kind != "einsum" or len(step.args) != 2 \
            or step.owner or step.dist or step.exchange or len(set(step.args) & params) != 1:
        return None
    w = next(a for a in step.args if a in params)
    x = next(a for a in step.args if a != w)
    if dim in program.value(w).dims or dim not in program.value(x).dims \
            or dim not in program.value(step.out).dims:
        return None
    return x


def find_rings(program: Program) -> dict[int, Ring]:
    """The collective matmuls of `program`, keyed by their collective step (module doc)."""
    if not program.overlap_tensor:
        return {}
    params = {p.name for p in program.params}
    outputs = {o.value for o in program.outputs}
    fusions = find_fusions(program)
    fused = set(fusions) | {c for f in fusions.values() for c in f.covered}
    readers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    for i, s in enumerate(program.steps):
        producer[s.out] = i
        for a in s.args if isinstance(s, Compute) else (s.src,):
            readers.setdefault(a, []).append(i)
    # `recompute selective` / `ops` rebuild dropped values from their inputs, which a ring
    # never holds whole: a ring touching one stays a collective
    rebuilt = set(program.dropped) | set(program.held)
    # a balanced dim's own axis permutes it into zigzag order as it cuts and gathers; a second
    # axis inside it (sequence parallel under `cp balanced`) moves its pieces as they lie
    zigzag = own_axes(program)

    def plain(dim: str, axis: str) -> bool:
        return zigzag.get(dim) != axis

    rings: dict[int, Ring] = {}
    for i, s in enumerate(program.steps):
        if not isinstance(s, Redistribute) or i in fused or s.out in outputs \
                or not program.value(s.src).is_float:
            continue
        if s.kind is RedistributeKind.ALLGATHER and isinstance(s.frm, Split) \
                and s.grad is GradPlacement.PARTIAL and plain(s.frm.dim, s.axis):
            rs = readers.get(s.out, [])
            if rs and all(j not in fused and _weight_matmul(
                    program, program.steps[j], params, s.frm.dim) == s.out for j in rs):
                rings[i] = Ring(i, s.kind, tuple(rs), s.frm.dim, s.axis)
        elif s.kind is RedistributeKind.REDUCE_SCATTER and isinstance(s.to, Split) \
                and plain(s.to.dim, s.axis) and s.src in producer:
            j = producer[s.src]
            if j not in fused and readers.get(s.src) == [i] and s.src not in outputs and \
                    _weight_matmul(program, program.steps[j], params, s.to.dim):
                rings[i] = Ring(i, s.kind, (j,), s.to.dim, s.axis)
    return {i: r for i, r in rings.items() if not rebuilt & _touches(program, r)}


def _touches(program: Program, ring: Ring) -> set[str]:
    step = program.steps[ring.at]
    mms = [program.steps[j] for j in ring.matmuls]
    return {step.src, step.out, *(s.out for s in mms), *(a for s in mms for a in s.args)}


def ring_runs_at(program: Program) -> dict[int, int]:
    """Where each ring's matmul steps run: at their collective step."""
    return {j: r.at for r in find_rings(program).values() for j in r.matmuls}


def ring_chunk(program: Program, ring: Ring) -> str:
    """The value whose local shape each ring message has: the gathered shard, or the
    scattered chunk (both directions, forward and backward)."""
    step = program.steps[ring.at]
    return step.src if ring.kind is RedistributeKind.ALLGATHER else step.out


def ring_sends(program: Program, ring: Ring) -> int:
    """How many messages a rank sends in one direction of the ring: one per step, t-1."""
    return dict(program.mesh)[ring.axis] - 1


def float8_rings(program: Program, marked: bool = False) -> dict[int, Ring]:
    """The rings `--precision float8` runs in float8: every matmul a float8 step
    (einsum.float8_steps; `marked`: marked float8 = true, as precision.program_as_run runs
    it). A ring whose matmuls mix float8 and bf16 is refused (`float8_ring_refusal`)."""
    from soapstone.shard.ops.einsum import float8_steps

    f8 = {i for i in float8_steps(program)
          if not marked or program.steps[i].attr("float8") is True}
    return {i: r for i, r in find_rings(program).items() if set(r.matmuls) <= f8}


def float8_ring_gathers(program: Program, marked: bool = False) -> dict[int, str]:
    """The gather rings of `float8_rings` -> their axis: like a float8 gather, each brings
    its readers their input already cast (e4m3), and backward keeps it so."""
    return {i: r.axis for i, r in float8_rings(program, marked).items()
            if r.kind is RedistributeKind.ALLGATHER}


def float8_ring_refusal(program: Program) -> str:
    """'' when `run --precision float8` runs every ring of `program` (and the float8 steps'
    widths: einsum.float8_refusal), else why and where, and the fixes."""
    from soapstone.shard.ops.einsum import (
        FLOAT8_MULTIPLE,
        float8_refusal,
        float8_steps,
        float8_widths,
    )

    why = float8_refusal(program)  # the widths of each float8 matmul as a whole, first
    f8 = float8_steps(program)
    mesh = dict(program.mesh)
    for _, ring in sorted(find_rings(program).items()):
        if why:
            break
        mms = [program.steps[j] for j in ring.matmuls]
        names = ", ".join(s.source or s.out for s in mms)
        ours = [j in f8 for j in ring.matmuls]
        t = mesh[ring.axis]
        tokens = float8_widths(mms[0], program)[0] // t  # a chunk's rows
        if any(ours) and not all(ours):
            why = (f"{names}: `overlap tensor` runs these as one ring over their shared "
                   f"input's chunks, but some are float8 linears and some `float8 = false` (a "
                   f"ring casts its chunks once, for all of them); fix: set `float8` the same "
                   f"on all of them, or drop `overlap tensor`")
        elif all(ours) and tokens % FLOAT8_MULTIPLE:
            why = (f"{names}: `overlap tensor` runs float8 matmuls a 1/{t} chunk of rows at a "
                   f"time, whose tokens torch._scaled_mm needs as a multiple of "
                   f"{FLOAT8_MULTIPLE}; a chunk has {tokens}; fix: make the local batch x "
                   f"sequence a multiple of {FLOAT8_MULTIPLE * t}, drop `overlap tensor`, or "
                   f"run --precision bf16")
    return why


def float8_gathers_beside_rings(program: Program, marked: bool = False) -> dict[int, str]:
    """einsum.float8_gathers less the rings' own gathers: a ring runs its matmuls itself,
    chunk by chunk, and its sends carry the compute dtype."""
    from soapstone.shard.ops.einsum import float8_gathers

    rings = find_rings(program)
    return {i: a for i, a in float8_gathers(program, marked).items() if i not in rings}
