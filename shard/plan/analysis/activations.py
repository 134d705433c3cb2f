"""What one microbatch's forward keeps for backward, and the working set on top of it.

explain's activation figure is the bytes autograd saves for backward, each tensor once: per
primitive, what its kernel keeps, as the op's record says (`saves`, shard/ops/: a matmul its
float operands, a norm its input and a product or two, softmax its output, a custom layer its
operands and output as an upper bound); per fused chain (shard/runtime/fusion.py), what the
fused call keeps: attention (scores -> mask -> softmax -> . v as one
scaled_dot_product_attention) q, k, v and the output, never the scores; linear + bias (one
addmm) x, and no matmul temporary.

On top of the saved bytes, a step also needs a working set: in forward the values not saved
but still to be read, in backward the gradients in flight (each value's from its first
consumer's backward until its producer's) and one parameter's gradient before it lands in its
bucket, and the temporaries an op's backward makes beside them (its record's
`backward_scratch`: cross_entropy's chunk); a gradient its op writes over its saved arg takes
no new bytes (`grad_in_place`, shard/runtime/overwrite_plan.py). `activation_figures` walks the
Program forward then backward, freeing each value after its last use (the runtime does) and
each saved tensor after the backward of the step that saved it, and returns the saved bytes
and the peak above them (`transient`).
tests/dsl/test_plan.py and bench/bench_memory.py compare both with what a real step holds.

Under `recompute R` (Program.recompute) a range of steps keeps only its float inputs; in
backward its own saves come back for as long as backward runs through it. `recompute_flops`
is the forward work run again. Under `recompute selective` (Program.dropped) a dropped value
is kept by no one after forward, and in backward lives from its last saver's backward (where
it is rebuilt) to its first saver's. So does a gathered linear input under sequence
parallelism (Program.regathered), whose shard the gather keeps instead, to gather it again.

`weight_grad_bytes` is what a split backward (zb1p) keeps from B to W beside the saved bytes.
"""

from __future__ import annotations

import math

from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.runtime import overwrite_plan
from soapstone.shard.runtime.fusion_plan import FusedAttention, FusedLinear, find_fusions


def _roots(program: Program, covered: set[int]) -> dict[str, str]:
    """Value -> the value whose storage it is (views and copies-to are their source)."""
    root: dict[str, str] = {}
    for i, s in enumerate(program.steps):
        if i in covered:
            continue
        if isinstance(s, CopyTo) or (
                isinstance(s, Redistribute) and s.kind is RedistributeKind.SLICE):
            root[s.out] = root.get(s.src, s.src)
        elif isinstance(s, Compute) and record_of(s.kind).aliases(s):
            root[s.out] = root.get(s.args[0], s.args[0])
    return root


def step_saves(program: Program, i: int, fused: dict,
               params: set[str]) -> tuple[list[str], int]:
    """(values step i keeps for backward, bytes of new tensors it keeps besides them): a fused
    chain's saves, else its op's record's."""
    s = program.steps[i]
    if i in fused:
        f = fused[i]
        if isinstance(f, FusedAttention):
            return [f.q, f.k, f.v, f.out], lse_bytes(program, f)
        if isinstance(f, FusedLinear):
            return [f.x], 0
    if not isinstance(s, Compute):
        return [], 0
    floats = [a for a in s.args if a not in params and program.value(a).is_float]
    return record_of(s.kind).saves(s, program, floats)


def lse_bytes(program: Program, f: FusedAttention) -> int:
    """The fused attention kernel's per-row log-sum-exp, kept for backward: fp32, one per
    query position and head (q's elements over its head dim)."""
    q, scores = program.value(f.q), program.value(f.scores)
    inner = [n for d, n in zip(q.dims, q.local_shape, strict=True) if d not in scores.dims]
    return 4 * math.prod(q.local_shape) // max(1, math.prod(inner))


def activation_figures(program: Program) -> tuple[int, int]:
    """(bytes saved for backward, peak working set above them) of one forward and backward
    of `program` (module doc)."""
    saved, forward, backward = phase_figures(program)
    return saved, max(forward, backward)


def phase_figures(program: Program) -> tuple[int, int, int]:
    """(bytes saved for backward, the forward's peak working set above them, the
    backward's) of one forward and backward of `program` (module doc): a pipeline's peak
    adds each to what is held at its own actions (in_flight.py)."""
    fused = find_fusions(program)
    covered = {i for f in fused.values() for i in f.covered}
    root = _roots(program, covered)
    params = {p.name for p in program.params}
    val = program.value
    overwritable = overwrite_plan.overwritable(program, fused)

    def r(name: str) -> str:
        return root.get(name, name)

    steps = program.steps
    saves: dict[int, tuple[set[str], int]] = {}
    for i in range(len(steps)):
        if i not in covered:
            names, extra = step_saves(program, i, fused, params)
            saves[i] = ({r(n) for n in names if n not in params and val(n).is_float}, extra)
    # recompute: a range keeps its float inputs (saved by its first step) instead of what its
    # steps keep; backward holds the range's own saves again while it runs through it
    again: dict[int, tuple[int, int]] = {}  # the range's last step -> (its first, bytes)
    release: dict[int, int] = {}  # step -> recomputed bytes its backward frees
    for a, b in program.recompute:
        mine = [i for i in range(a, b) if i in saves]
        made = {r(steps[i].out) for i in range(a, b)}
        inputs = {r(x) for i in range(a, b) for x in (steps[i].args if isinstance(
            steps[i], Compute) else (steps[i].src,)) if x not in params and val(x).is_float}
        kept = set().union(*(saves[i][0] for i in mine)) - (inputs - made)
        again[mine[-1]] = (mine[0], sum(val(n).nbytes for n in kept) +
                           sum(saves[i][1] for i in mine))
        seen: set[str] = set()
        for i in mine:  # each recomputed save is freed at its first saver's backward
            new = (saves[i][0] & kept) - seen
            seen |= new
            release[i] = sum(val(n).nbytes for n in new) + saves[i][1]
        for i in mine:
            saves[i] = (set(), 0)
        saves[mine[0]] = (inputs - made, 0)
    # recompute selective: a dropped value is kept by no one after forward; backward rebuilds
    # it before its last saver's backward (or before a rebuild that reads it, which rebuilds
    # it first) and it lives until its first saver's is done
    rebuilt: dict[int, int] = {}  # step -> dropped bytes rebuilt before its backward
    scratch_at: dict[int, int] = {}  # step -> the largest rebuild's intermediates there
    for name in program.regathered:  # sequence parallel: the gather's shard is kept instead
        i = next(k for k in saves if steps[k].out == name)
        saves[i] = (saves[i][0] | {r(steps[i].src)}, saves[i][1])
    chains = _rebuild_chains(program, {n for names, _ in saves.values() for n in names},
                             params)
    at: dict[str, int] = {}
    for name in (*program.dropped, *program.regathered):
        savers = [i for i, (names, _) in saves.items() if name in names]
        for i in savers:
            saves[i] = (saves[i][0] - {name}, saves[i][1])
        if savers:
            at[name] = max(savers)
            release[min(savers)] = release.get(min(savers), 0) + val(name).nbytes
    for name in reversed(program.dropped):  # a rebuild's dropped inputs come back with it
        for a in chains[name][1]:
            if a in at and name in at:
                at[a] = max(at[a], at[name])
    for name, i in at.items():
        rebuilt[i] = rebuilt.get(i, 0) + val(name).nbytes
        if name in chains:
            scratch_at[i] = max(scratch_at.get(i, 0), chains[name][0])
    for name in program.held:  # recompute ops: held from forward until its last rebuild
        i = min((at[d] for d in program.dropped if d in at and name in chains[d][1]),
                default=None)
        if i is not None:
            saves[i] = (saves[i][0] | {r(name)}, saves[i][1])
    first_saver: dict[str, int] = {}  # a saved tensor lives until its earliest saver's backward
    for i, (names, _) in saves.items():
        for n in names:
            first_saver[n] = min(first_saver.get(n, i), i)
    saved_total = sum(val(n).nbytes for n in first_saver) + sum(e for _, e in saves.values())

    def reads(i: int) -> tuple[str, ...]:
        if i in fused:
            f = fused[i]
            return (f.q, f.k, f.v) if isinstance(f, FusedAttention) else (f.x, f.w, f.bias)
        s = steps[i]
        return s.args if isinstance(s, Compute) else (s.src,)

    last_use: dict[str, int] = {}
    for i in saves:
        for a in reads(i):
            last_use[r(a)] = i
    keep = {r(o.value) for o in program.outputs}
    makes = {i: r(steps[i].out) for i in saves if r(steps[i].out) == steps[i].out
             and val(steps[i].out).is_float}
    # forward: saved so far (from when each is made) + values still to be read (+ a
    # kernel's scratch: an einsum's scaled copy)
    made = set(makes.values())
    held = sum(val(n).nbytes for n in first_saver if n not in made)  # saved inputs
    live = peak = 0
    alive: set[str] = set()
    for i, (_, extra) in saves.items():
        out = makes.get(i)
        if out is not None and out in first_saver:
            held += val(out).nbytes
        elif out is not None:
            alive.add(out)
            live += val(out).nbytes
        held += extra
        step = steps[i]
        scratch = record_of(step.kind).scratch(step, program) \
            if isinstance(step, Compute) and i not in fused else 0
        peak = max(peak, held + live + scratch)
        for a in reads(i):
            a = r(a)
            if a in alive and last_use.get(a) == i and a not in keep:
                alive.discard(a)
                live -= val(a).nbytes
    forward, peak = peak, 0
    # backward: what is still saved + gradients in flight (+ a parameter's, briefly)
    grads: dict[str, int] = {}
    for o in program.outputs:
        if o.is_loss:
            grads[r(o.value)] = val(o.value).nbytes
    for i in reversed(list(saves)):
        names, extra = saves[i]
        if i in again:
            held += again[i][1]
        held += rebuilt.get(i, 0)
        peak = max(peak, held + sum(grads.values()) + scratch_at.get(i, 0))
        pgrad = 0
        step = steps[i]
        rec = record_of(step.kind) if isinstance(step, Compute) and i not in fused else None
        # a gradient written over its saved arg (cross_entropy's logits) takes no new bytes
        into = r(step.args[0]) if rec is not None and rec.grad_in_place and \
            step.args[0] in overwritable else None
        for a in reads(i):
            if a in params:
                pgrad = max(pgrad, val(a).nbytes if val(a).is_float else 0)
            elif val(a).is_float and r(a) not in grads:
                grads[r(a)] = 0 if r(a) == into else val(a).nbytes
        work = rec.backward_scratch(step, program) if rec is not None else 0
        peak = max(peak, held + sum(grads.values()) + pgrad + work)
        held -= sum(val(n).nbytes for n in names if first_saver[n] == i) + extra
        if into is not None:  # the saved logits live on as their gradient
            grads[into] = val(into).nbytes
        held -= release.get(i, 0)
        out = makes.get(i)
        if out is not None:
            grads.pop(out, None)
    return saved_total, max(0, forward - saved_total), max(0, peak - saved_total)


def _rebuild_chains(program: Program, kept: set[str], params: set[str]
                    ) -> dict[str, tuple[int, set[str]]]:
    """Each dropped value -> (the bytes its rebuild makes, itself included; the dropped and
    held values it reads): the walk of selective_plan.rebuild_steps, through the unsaved
    intermediates, from what is kept."""
    where = {s.out: i for i, s in enumerate(program.steps)}
    dropped, held = set(program.dropped), set(program.held)
    stops = params | (kept - dropped) | held
    out: dict[str, tuple[int, set[str]]] = {}
    for name in program.dropped:
        made: set[str] = set()
        reads: set[str] = set()
        todo = [name]
        while todo:
            v = todo.pop()
            if v in made:
                continue
            made.add(v)
            s = program.steps[where[v]]
            for a in s.args if isinstance(s, Compute) else (s.src,):
                if a in dropped or a in held:
                    reads.add(a)
                elif a not in stops:
                    todo.append(a)
        views = {v for v in made if isinstance(program.steps[where[v]], Compute)
                 and record_of(program.steps[where[v]].kind).aliases(program.steps[where[v]])}
        out[name] = (sum(program.value(v).nbytes for v in made - views), reads)
    return out


def recompute_flops(program: Program) -> float:
    """The matmul FLOPs backward runs again under `recompute` (one microbatch, this rank)."""
    total = 0.0
    for a, b in program.recompute:
        for step in program.steps[a:b]:
            if isinstance(step, Compute):
                rec = record_of(step.kind)
                if rec.bound is Bound.MATMUL:
                    total += rec.flops(step, program)
    return total


def weight_grad_bytes(program: Program) -> int:
    """The gradients a split backward's B keeps for its W (shard/split_backward.py: the
    joints' incoming gradients), one microbatch: for each step whose backward gives a
    parameter its gradient from the one arriving at its output (x . W, a fused linear, a
    norm's or a bias's weights), that output's size. An embedding's table is not counted: its
    lookup is off B's path (integer ids), so its W starts above it."""
    fused = find_fusions(program)
    covered = {i for f in fused.values() for i in f.covered}
    params = {p.name for p in program.params}
    total = 0
    for i, s in enumerate(program.steps):
        if i in covered or not isinstance(s, Compute) or s.kind == "embedding":
            continue
        f = fused.get(i)
        reads = (f.w, f.bias) if isinstance(f, FusedLinear) else s.args
        if any(a in params for a in reads) and program.value(s.out).is_float:
            total += program.value(s.out).nbytes
    return total
