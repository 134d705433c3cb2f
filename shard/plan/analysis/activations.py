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
`backward_scratch`: cross_entropy's chunk; a collective's copies, collective_scratch.py, which
forward has too); a gradient its op writes over its saved arg takes
no new bytes (`grad_in_place`, shard/runtime/overwrite_plan.py). `activation_figures` walks the
Program forward then backward, freeing each value after its last use (the runtime does) and
each saved tensor after the backward of the step that saved it, and returns the saved bytes
and the peak above them (`transient`).
tests/dsl/search/test_plan.py and bench/bench_memory.py compare both with what a real step holds.

Under `recompute R` (Program.recompute) a range of steps keeps only its float inputs; in
backward its own saves come back for as long as backward runs through it: from where backward
first unpacks one (the backward of the range's last step that keeps a tensor: torch's
non-reentrant checkpoint runs the range again there, the gradients of the steps after it in
flight), its second run peaking like a forward of the range (values still to read, its
outputs, each step's temporaries, a collective's too: collective_scratch.py). `recompute_flops`
is the forward work run again. Under `recompute selective` (Program.dropped) a dropped value
is kept by no one after forward, and in backward lives from its last saver's backward (where
it is rebuilt) to its first saver's. So does a gathered linear input under sequence
parallelism (Program.regathered), whose shard the gather keeps instead, to gather it again.

A split backward (zb1p, zbv, dualpipev: shard/runtime/split_backward.py) has two working
sets of its own (`phase_figures`'s Phases): B runs only the steps a received input reaches,
keeps every saved tensor and, from each step where a parameter's gradient branches off, the
gradient at its output (`kept`, held until W); W runs those steps' weight halves and the
steps no input reaches, beside the kept gradients.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.ops.einsum import float8_scratch
from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.plan.analysis.collective_scratch import collective_scratch
from soapstone.shard.plan.analysis.precision import float8_kept, float8_last_cast
from soapstone.shard.plan.analysis.ring_memory import RingWork, ring_work
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.runtime import overwrite_plan
from soapstone.shard.runtime.fusion_plan import (
    FusedAttention,
    FusedLinear,
    find_fusions,
    per_chunk,
)


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
        if isinstance(f, FusedAttention):  # per zigzag chunk: each call's output piece too
            pieces = program.value(f.out).nbytes if per_chunk(program, f) else 0
            return [f.q, f.k, f.v, f.out], lse_bytes(program, f) + pieces
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
    sv = _saves_of(program)
    return sv.total, max(0, _forward_peak(sv) - sv.total, max(_backward_peak(sv)) - sv.total)


@attrs.frozen
class Phases:
    """One microbatch's saved bytes and the peak working set above them in each phase:
    forward, a whole backward, and a split backward's B (input gradients, with the gradients
    it keeps for W as they come) and W (weight gradients, above the saved and kept bytes);
    `kept`: the gradients B keeps for W (module doc)."""

    saved: int
    forward: int
    backward: int
    input_grad: int
    weight_grad: int
    kept: int
    # a whole backward's peak in four parts, in the order it runs them: its head (the steps
    # after the last block's: the loss, the output layer), the last block, the others, the
    # tail; ZeRO holds different buffers beside the first two (zero_memory.py's Beside);
    # `backward` is the largest. A part with no step: -saved (nothing)
    head: int
    last: int  # the last block's (the first backward runs through)
    rest: int  # the other blocks' (below the saved, maybe)
    tail: int  # what comes before the first block (the embedding): last in backward

    @property
    def working(self) -> tuple[int, int, int, int]:
        """The working sets in in_flight.py's phase order."""
        return self.forward, self.backward, self.input_grad, self.weight_grad


@attrs.frozen
class _Saves:
    """What one forward of a program keeps, as the walks read it: per kept step (fused
    chains by their last step) the storage roots it saves and the bytes of new tensors
    besides, and what recompute frees and brings back."""

    program: Program
    root: dict[str, str]
    params: set[str]
    fused: dict
    saves: dict[int, tuple[set[str], int]]
    again: dict[int, tuple[int, int]]  # where a recompute range runs again -> (its first, bytes)
    rerun: dict[int, int]  # where a recompute range runs again -> that run's peak
    release: dict[int, int]  # step -> recomputed bytes its backward frees
    rebuilt: dict[int, int]  # step -> dropped bytes rebuilt before its backward
    scratch_at: dict[int, int]  # step -> the largest rebuild's intermediates there
    first_saver: dict[str, int]  # a saved tensor lives until its earliest saver's backward
    overwritable: frozenset[str]  # values whose gradient may be written over them
    rings: RingWork  # `overlap tensor`: the run order and the rings' working sets
    size: object  # value -> the bytes it is kept in (float8 gathers': e4m3)
    over: dict[int, int]  # step -> its forward working set, where a ring's or float8's

    def r(self, name: str) -> str:
        return self.root.get(name, name)

    @property
    def total(self) -> int:
        return sum(self.size(n) for n in self.first_saver) + \
            sum(e for _, e in self.saves.values())

    def reads(self, i: int) -> tuple[str, ...]:
        return _reads(self.program, self.fused, i, self.rings)

    def makes(self) -> dict[int, str]:
        """Kept step -> the float value it makes with storage of its own."""
        steps, val = self.program.steps, self.program.value
        return {i: self.r(steps[i].out) for i in self.saves
                if self.r(steps[i].out) == steps[i].out and val(steps[i].out).is_float}

    def parts(self) -> dict[int, int]:
        """Step -> the part of backward it is in (Phases), by run order, each step in the
        block of the last block parameter read at or before it: 0 the head, the steps after
        the last read of a block's parameter; 1 the last block; 3 the first block and the
        tail before it; 2 the blocks between. All are 2 where no parameter is a block's."""
        block = {p.name: p.block for p in self.program.params}
        order = list(self.saves)
        label, at, end = [], None, None
        for k, i in enumerate(order):
            read = [block[a] for a in self.reads(i) if block.get(a) is not None]
            if read:
                at, end = read[-1], k
            label.append(at)
        if end is None:
            return dict.fromkeys(order, 2)
        first = next(b for b in label if b is not None)
        return {i: 0 if k > end else 1 if label[k] == label[end] else
                3 if label[k] in (None, first) else 2 for k, i in enumerate(order)}

    def loss_grads(self) -> dict[str, int]:
        """The gradient backward starts from: the loss's (a stage's received ones are its
        message, not its working set)."""
        return {self.r(o.value): self.program.value(o.value).nbytes
                for o in self.program.outputs if o.is_loss}


def _reads(program: Program, fused: dict, i: int, rings: RingWork | None = None
           ) -> tuple[str, ...]:
    """What step i reads (a fused chain, by its last step: the fused call's operands; a ring
    step, its matmul's too)."""
    if i in fused:
        f = fused[i]
        return (f.q, f.k, f.v) if isinstance(f, FusedAttention) else (f.x, f.w, f.bias)
    s = program.steps[i]
    mine = s.args if isinstance(s, Compute) else (s.src,)
    return mine + rings.reads.get(i, ()) if rings is not None else mine


def _split_path(program: Program, fused: dict, order: list[int], r) -> tuple[set[str], dict]:
    """A split backward's path (`_split_peaks`): the value roots a float input of the program
    reaches, and per step in `order` (forward order) whether it is on the path and whether
    it is a joint."""
    val, params = program.value, {p.name for p in program.params}
    path = {r(n) for n in program.inputs if val(n).is_float and n not in params}
    off = {r(p) for p in params if val(p).is_float}  # tracked by autograd, off the path
    kind: dict[int, tuple[bool, bool]] = {}
    for i in order:
        reads = {r(a) for a in _reads(program, fused, i)}
        on = not reads.isdisjoint(path)
        kind[i] = (on, on and not reads.isdisjoint(off))
        out = program.steps[i].out
        if val(out).is_float and not (reads.isdisjoint(path) and reads.isdisjoint(off)):
            (path if on else off).add(r(out))
    return path, kind


def _saves_of(program: Program) -> _Saves:
    fused = find_fusions(program)
    covered = {i for f in fused.values() for i in f.covered}
    root = _roots(program, covered)
    params = {p.name for p in program.params}
    val = program.value

    def r(name: str) -> str:
        return root.get(name, name)

    steps = program.steps
    rings = ring_work(program)  # the walks take the steps as they run: a ring's at its collective
    stored, gathers8 = float8_kept(program)
    over = {**rings.forward, **gathers8}

    def size(name: str) -> int:
        return stored.get(name) or val(name).nbytes

    saves: dict[int, tuple[set[str], int]] = {}
    for i in rings.order:
        if i not in covered:
            names, extra = rings.keeps.get(i) or step_saves(program, i, fused, params)
            saves[i] = ({r(n) for n in names if n not in params and val(n).is_float}, extra)
    # recompute: a range keeps its float inputs (saved by its first step) instead of what its
    # steps keep; backward holds the range's own saves again while it runs through it
    again: dict[int, tuple[int, int]] = {}
    rerun: dict[int, int] = {}
    release: dict[int, int] = {}
    for a, b in program.recompute:
        mine = [i for i in saves if a <= i < b]
        made = {r(steps[i].out) for i in range(a, b)}
        inputs = {r(x) for i in range(a, b) for x in (steps[i].args if isinstance(
            steps[i], Compute) else (steps[i].src,)) if x not in params and val(x).is_float}
        kept = set().union(*(saves[i][0] for i in mine)) - (inputs - made)
        # the second run starts when backward first unpacks one of the range's saves: at
        # the last step that keeps any, the gradients of the steps after it already in flight
        keeps = [i for i in mine if saves[i][0] or saves[i][1]]
        at = keeps[-1] if keeps else mine[-1]
        # float8: the second run's last cast stays through the range's backward
        cast = float8_last_cast(program, mine)
        again[at] = (mine[0], sum(size(n) for n in kept) +
                     sum(saves[i][1] for i in mine) + cast)
        rerun[at] = _rerun_peak(program, fused, mine, saves, kept, r, rings, size, over)
        seen: set[str] = set()
        for i in mine:  # each recomputed save is freed at its first saver's backward
            new = (saves[i][0] & kept) - seen
            seen |= new
            release[i] = sum(size(n) for n in new) + saves[i][1] + (cast if i == mine[0] else 0)
        for i in mine:
            saves[i] = (set(), 0)
        saves[mine[0]] = (inputs - made, 0)
    # recompute selective: a dropped value is kept by no one after forward; backward rebuilds
    # it before its last saver's backward (or before a rebuild that reads it, which rebuilds
    # it first) and it lives until its first saver's is done
    rebuilt: dict[int, int] = {}
    scratch_at: dict[int, int] = {}
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
            release[min(savers)] = release.get(min(savers), 0) + size(name)
    for name in reversed(program.dropped):  # a rebuild's dropped inputs come back with it
        for a in chains[name][1]:
            if a in at and name in at:
                at[a] = max(at[a], at[name])
    for name, i in at.items():
        rebuilt[i] = rebuilt.get(i, 0) + size(name)
        if name in chains:
            scratch_at[i] = max(scratch_at.get(i, 0), chains[name][0])
    for name in program.held:  # recompute ops: held from forward until its last rebuild
        i = min((at[d] for d in program.dropped if d in at and name in chains[d][1]),
                default=None)
        if i is not None:
            saves[i] = (saves[i][0] | {r(name)}, saves[i][1])
    first_saver: dict[str, int] = {}
    for i, (names, _) in saves.items():
        for n in names:
            first_saver[n] = min(first_saver.get(n, i), i)
    return _Saves(program, root, params, fused, saves, again, rerun, release, rebuilt, scratch_at,
                  first_saver, overwrite_plan.overwritable(program, fused), rings, size, over)


def _rerun_peak(program: Program, fused: dict, mine: list[int], saves: dict,
                kept: set[str], r, rings: RingWork, size, over: dict[int, int]) -> int:
    """A recompute range's second run, in backward before its own backward: the peak of the
    saves it makes again (`kept`, as they are made), the values it makes that are still to
    be read (its outputs until the run ends: the runtime returns them) and each step's
    temporaries (a collective's too)."""
    val, steps = program.value, program.steps
    stop = max(mine) + 1
    last = {r(a): i for i in mine for a in _reads(program, fused, i, rings)}
    later = {r(a) for i in saves if i >= stop for a in _reads(program, fused, i, rings)}
    later |= {r(o.value) for o in program.outputs}
    held = peak = 0
    alive: dict[str, int] = {}
    for i in mine:
        out = r(steps[i].out)
        if out == steps[i].out and val(out).is_float and out not in kept:
            alive[out] = size(out)
        elif out in kept and out not in alive:
            held += size(out)
            alive[out] = 0
        held += saves[i][1]
        peak = max(peak, held + sum(alive.values()) + _scratch(program, fused, i, over))
        for a in _reads(program, fused, i, rings):
            a = r(a)
            if last.get(a) == i and a not in later and a not in kept:
                alive.pop(a, None)
    return peak


def phase_figures(program: Program) -> Phases:
    """One microbatch's saved bytes and working sets, per phase (module doc): a pipeline's
    peak adds each to what is held at its own actions (in_flight.py)."""
    sv = _saves_of(program)
    saved = sv.total
    b, w, kept = _split_peaks(sv)
    # a part with no step counts as nothing (-saved: below whatever else is held)
    head, last, rest, tail = (x - saved if x >= 0 else -saved for x in _backward_peak(sv))
    return Phases(saved, max(0, _forward_peak(sv) - saved), max(0, head, last, rest, tail),
                  max(0, b - saved), max(0, w - saved - kept), kept, head, last, rest, tail)


def _scratch(program: Program, fused: dict, i: int, over: dict[int, int]) -> int:
    """Step i's forward temporaries: a kernel's (an einsum's scaled copy, a float8 matmul's
    casts, a fused one's too), a collective's (collective_scratch.py), a ring's
    (ring_memory.py) or a float8 gather's (precision.float8_kept): `over`."""
    step = program.steps[i]
    if i in over:
        return over[i]
    if isinstance(step, Redistribute):
        return collective_scratch(step, program)[0]
    if i in fused:
        return _fused_float8(program, fused[i])[0]
    return record_of(step.kind).scratch(step, program) if isinstance(step, Compute) else 0


def _fused_float8(program: Program, f) -> tuple[int, int]:
    """A fused linear's float8 matmul's (forward, backward) casts (einsum.float8_scratch):
    under float8 its bias is added apart (shard/runtime/fusion.py). (0, 0) for the rest."""
    if not isinstance(f, FusedLinear) or program.steps[f.covered[0]].attr("float8") is not True:
        return 0, 0
    return float8_scratch(program.steps[f.covered[0]], program, biased=True)


def _forward_peak(sv: _Saves) -> int:
    """Forward: saved so far (from when each is made) + values still to be read (+ a
    kernel's scratch: an einsum's scaled copy)."""
    program, size, r = sv.program, sv.size, sv.r
    last_use: dict[str, int] = {}
    for i in sv.saves:
        for a in sv.reads(i):
            last_use[r(a)] = i
    keep = {r(o.value) for o in program.outputs}
    makes = sv.makes()
    made = set(makes.values())
    held = sum(size(n) for n in sv.first_saver if n not in made)  # saved inputs
    live = peak = 0
    alive: set[str] = set()
    for i, (_, extra) in sv.saves.items():
        out = makes.get(i)
        if out is not None and out in sv.first_saver:
            held += size(out)
        elif out is not None:
            alive.add(out)
            live += size(out)
        held += extra
        peak = max(peak, held + live + _scratch(program, sv.fused, i, sv.over))
        for a in sv.reads(i):
            a = r(a)
            if a in alive and last_use.get(a) == i and a not in keep:
                alive.discard(a)
                live -= size(a)
    return peak


def _backward_peak(sv: _Saves) -> tuple[int, int, int, int]:
    """A whole backward's peaks in its four parts (`_Saves.parts`; -1 for a part with no
    step): what is still saved + gradients in flight (+ a parameter's, briefly). Gradients
    are counted by storage: an add's backward hands its output's gradient to its same-sized
    args as one tensor (`grad_passes`), as does an allreduce's (identity backward)."""
    val, r = sv.program.value, sv.r
    held = sv.total
    grads = {k: (k, b) for k, b in sv.loss_grads().items()}  # value -> (storage, bytes)
    makes = sv.makes()
    part = sv.parts()
    peaks = [-1, -1, -1, -1]
    entry: dict[int, int] = {}  # part -> what is held as backward enters it
    for i in reversed(list(sv.saves)):
        at = part[i]
        entry.setdefault(at, held)
        names, extra = sv.saves[i]
        if i in sv.again:  # the range runs again, then its saves are held
            peaks[at] = max(peaks[at], held + _in_flight(grads) + sv.rerun[i])
            held += sv.again[i][1]
        held += sv.rebuilt.get(i, 0)
        peaks[at] = max(peaks[at], held + _in_flight(grads) + sv.scratch_at.get(i, 0))
        pgrad = 0
        step = sv.program.steps[i]
        rec = record_of(step.kind) if isinstance(step, Compute) and i not in sv.fused else None
        # a gradient written over its saved arg (cross_entropy's logits) takes no new bytes
        into = r(step.args[0]) if rec is not None and rec.grad_in_place and \
            step.args[0] in sv.overwritable else None
        passes = rec.grad_passes if rec is not None else \
            getattr(step, "kind", None) is RedistributeKind.ALLREDUCE
        passed = grads.get(r(step.out)) if passes else None
        ring = i in sv.rings.members  # its working set is its ring's (ring_memory.py)
        for a in sv.reads(i):
            if a in sv.params:
                pgrad = max(pgrad, val(a).nbytes if val(a).is_float and not ring else 0)
            elif val(a).is_float and r(a) not in grads and a not in sv.rings.ungraded:
                if passed is not None and val(a).nbytes == passed[1]:
                    grads[r(a)] = passed
                else:
                    grads[r(a)] = (r(a), 0 if r(a) == into else val(a).nbytes)
        work = sv.rings.backward.get(i, 0) if ring else \
            rec.backward_scratch(step, sv.program) if rec is not None else \
            collective_scratch(step, sv.program)[1] if isinstance(step, Redistribute) else \
            _fused_float8(sv.program, sv.fused[i])[1] if i in sv.fused else 0
        peaks[at] = max(peaks[at], held + _in_flight(grads) + pgrad + work)
        held -= sum(sv.size(n) for n in names if sv.first_saver[n] == i) + extra
        if into is not None:  # the saved logits live on as their gradient
            grads[into] = (into, val(into).nbytes)
        held -= sv.release.get(i, 0)
        out = makes.get(i)
        if out is not None:
            grads.pop(out, None)
    # the blocks between run as the last does, holding less by what the last let go: the
    # second-last's peak (a stage of n alike blocks and its 2-block probe agree on it)
    after = entry.get(2, entry.get(3))
    if peaks[1] >= 0 and after is not None:
        peaks[2] = max(peaks[2], peaks[1] - max(0, entry[1] - after))  # never above it
    return peaks[0], peaks[1], peaks[2], peaks[3]


def _in_flight(grads: dict[str, tuple[str, int]]) -> int:
    """The bytes of the gradients' storages, each once."""
    return sum(dict(grads.values()).values())


def _split_peaks(sv: _Saves) -> tuple[int, int, int]:
    """(B's peak, W's peak, the gradients B keeps for W) of a split backward
    (shard/runtime/split_backward.py). B runs the *path*, the steps a float input of the
    program (a received boundary) reaches, keeping every saved tensor (it retains the graph
    for W) and, at each *joint* (a path step that reads a parameter or a value computed from
    one off the path), the gradient arriving at its output. W runs the joints again for
    their weight outputs only, and the steps off the path whole, with the kept gradients
    held throughout; a saved tensor goes at its earliest saver's W when every saver runs in
    W (a path step's stay until the graph goes). No recompute: refused with a split
    backward (schedule_rules.py)."""
    program, val, r = sv.program, sv.program.value, sv.r
    steps = program.steps
    path, kind = _split_path(program, sv.fused, list(sv.saves), r)
    makes = sv.makes()
    # B: the path backwards, nothing saved let go; `free`: the gradients not kept
    held, grads, kept = sv.total, {k: v for k, v in sv.loss_grads().items() if k in path}, {}
    free = sum(grads.values())
    b_peak = held + free
    for i in reversed(list(sv.saves)):
        on, joint = kind[i]
        if not on:
            continue
        held += sv.rebuilt.get(i, 0)
        out = r(steps[i].out)
        if joint and out not in kept:
            kept[out] = val(steps[i].out).nbytes
            free -= grads.get(out, 0)
        for a in sv.reads(i):
            if r(a) in path and r(a) not in grads:
                grads[r(a)] = val(a).nbytes
                free += 0 if r(a) in kept else val(a).nbytes
        b_peak = max(b_peak, held + free + sum(kept.values()))
        held -= sv.release.get(i, 0)
        if makes.get(i) is not None and makes[i] not in kept:
            free -= grads.pop(makes[i], 0)
    # W: the joints' weight outputs and the steps off the path, beside the kept gradients
    runs = {i for i, (on, joint) in kind.items() if joint or not on}
    stays = {n for i in sv.saves if i not in runs for n in sv.saves[i][0]}
    held = sv.total + sum(kept.values())
    grads = {k: v for k, v in sv.loss_grads().items() if k not in path}
    w_peak = held + sum(grads.values())
    for i in sorted(runs, reverse=True):
        names, extra = sv.saves[i]
        pgrad = 0
        for a in sv.reads(i):
            if a in sv.params:
                pgrad = max(pgrad, val(a).nbytes if val(a).is_float else 0)
            elif val(a).is_float and r(a) not in path and r(a) not in grads:
                grads[r(a)] = val(a).nbytes
        w_peak = max(w_peak, held + sum(grads.values()) + pgrad)
        held -= sum(sv.size(n) for n in names
                    if sv.first_saver[n] == i and n not in stays) + extra
        if not kind[i][0] and makes.get(i) is not None:
            grads.pop(makes[i], None)
    return b_peak, w_peak, sum(kept.values())


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
    """The gradients a split backward's B keeps for its W, one microbatch (`Phases.kept`:
    the joints' outputs), without the walks."""
    fused = find_fusions(program)
    covered = {i for f in fused.values() for i in f.covered}
    root = _roots(program, covered)
    order = [i for i in range(len(program.steps)) if i not in covered]
    _, kind = _split_path(program, fused, order, lambda n: root.get(n, n))
    joints = {root.get(s.out, s.out): program.value(s.out).nbytes
              for i, s in enumerate(program.steps) if kind.get(i, (0, 0))[1]}
    return sum(joints.values())
