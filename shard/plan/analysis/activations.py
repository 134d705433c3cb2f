"""What one microbatch's forward keeps for backward, and the working set on top of it.

explain's activation figure is the bytes autograd saves for backward: per primitive, what the
runtime's kernels (shard/ops/kernels.py, the fused chains of shard/runtime/fusion.py) keep, each
tensor once:

- einsum: its float operands that are not parameters (a matmul keeps both sides; a weight is
  parameter memory); fused attention (scores -> mask -> softmax -> . v as one
  scaled_dot_product_attention): q, k, v and the output, never the scores; fused linear
  (x . W + bias as one addmm): x, and no matmul temporary;
- mul: both float operands; add, rename, redistributions: nothing;
- gelu, silu: the input; relu: the output; dropout: a mask of the input's size;
- layernorm over the last dim: the input (and per-row statistics); rmsnorm, and a layernorm
  in its composite form (a distributed one, or over another dim): the input and one or two
  products of its size;
- softmax: the output (its distributed form: the exponentials); cross_entropy: the
  log-probabilities, a tensor of the logits' size; causal_mask: a boolean mask;
- a custom layer: its float operands and its output (an upper bound).

On top of the saved bytes, a step also needs a working set: in forward the values not saved
but still to be read, in backward the gradients in flight (each value's from its first
consumer's backward until its producer's) and one parameter's gradient before it lands in its
bucket. `activation_figures` walks the Program forward then backward, freeing each value
after its last use (the runtime does) and each saved tensor after the backward of the step
that saved it, and returns the saved bytes and the peak above them (`transient`).
tests/test_plan.py and bench/bench_memory.py compare both with what a real step holds.

Under `recompute R` (Program.recompute) a range of steps keeps only its float inputs; in
backward its own saves come back for as long as backward runs through it. `recompute_flops`
is the forward work run again. Under `recompute selective` (Program.dropped) a dropped value
is kept by no one after forward, and in backward lives from its last saver's backward (where
it is rebuilt) to its first saver's.
"""

from __future__ import annotations

import math

from soapstone.shard.parallel.dispatch_plan import saved_bytes as moe_saved_bytes
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.runtime.fusion_plan import FusedAttention, FusedLinear, find_fusions

ALIASES = ("rename",)  # outputs that are views of their first operand


def _roots(program: Program, covered: set[int]) -> dict[str, str]:
    """Value -> the value whose storage it is (views and copies-to are their source)."""
    root: dict[str, str] = {}
    for i, s in enumerate(program.steps):
        if i in covered:
            continue
        if isinstance(s, CopyTo) or (
                isinstance(s, Redistribute) and s.kind is RedistributeKind.SLICE):
            root[s.out] = root.get(s.src, s.src)
        elif isinstance(s, Compute) and (s.kind in ALIASES or (
                s.kind == "dropout" and not float(s.attr("p", 0.0) or 0.0))):
            root[s.out] = root.get(s.args[0], s.args[0])
    return root


def _saved(program: Program, i: int, fused: dict, params: set[str]) -> tuple[list[str], int]:
    """(values step i keeps for backward, bytes of new tensors it keeps besides them)."""
    s = program.steps[i]
    if i in fused:
        f = fused[i]
        if isinstance(f, FusedAttention):
            return [f.q, f.k, f.v, f.out], 0
        if isinstance(f, FusedLinear):
            return [f.x], 0
    if not isinstance(s, Compute):
        return [], 0
    val = program.value
    floats = [a for a in s.args if a not in params and val(a).is_float]
    x = val(s.args[0]).nbytes if s.args else 0
    kind = s.kind
    if kind in ("einsum", "mul") or kind.startswith("custom:"):
        return floats + ([s.out] if kind.startswith("custom:") else []), 0
    if kind in ("gelu", "silu"):
        return floats[:1], 0
    if kind == "relu":
        return [s.out], 0
    if kind == "dropout":
        return [], x if float(s.attr("p", 0.0) or 0.0) else 0
    if kind == "layernorm":
        last = val(s.args[0]).dims[-1] == s.attr("over")
        return floats[:1], 0 if last and not s.dist else 2 * x
    if kind == "rmsnorm":
        return floats[:1], x
    if kind == "softmax":
        return ([s.out], 0) if not s.dist else ([], x)
    if kind == "cross_entropy":
        return [], x
    if kind == "moe":  # its input (the router's matmul) and what its experts keep
        return floats[:1], moe_saved_bytes(s, program)
    if kind == "causal_mask":
        v = val(s.args[0])
        q, k = s.attr("query"), s.attr("key")
        return [], math.prod(n for d, n in zip(v.dims, v.local_shape, strict=True)
                             if d in (q, k))
    return [], 0  # add, rename, embedding (integer ids), ...


def activation_figures(program: Program) -> tuple[int, int]:
    """(bytes saved for backward, peak working set above them) of one forward and backward
    of `program` (module doc)."""
    fused = find_fusions(program)
    covered = {i for f in fused.values() for i in f.covered}
    root = _roots(program, covered)
    params = {p.name for p in program.params}
    val = program.value

    def r(name: str) -> str:
        return root.get(name, name)

    steps = program.steps
    saves: dict[int, tuple[set[str], int]] = {}
    for i in range(len(steps)):
        if i not in covered:
            names, extra = _saved(program, i, fused, params)
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
    # it before its last saver's backward and it lives until its first saver's is done
    rebuilt: dict[int, int] = {}  # step -> dropped bytes rebuilt before its backward
    for name in program.dropped:
        savers = [i for i, (names, _) in saves.items() if name in names]
        for i in savers:
            saves[i] = (saves[i][0] - {name}, saves[i][1])
        if savers:
            rebuilt[max(savers)] = rebuilt.get(max(savers), 0) + val(name).nbytes
            release[min(savers)] = release.get(min(savers), 0) + val(name).nbytes
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
    # forward: saved so far (from when each is made) + values still to be read (+ an
    # einsum's scaled copy)
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
        scaled = val(step.out).nbytes if isinstance(step, Compute) and i not in fused and \
            step.kind == "einsum" and step.attr("scale") is not None else 0
        peak = max(peak, held + live + scaled)
        for a in reads(i):
            a = r(a)
            if a in alive and last_use.get(a) == i and a not in keep:
                alive.discard(a)
                live -= val(a).nbytes
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
        new = 0
        pgrad = 0
        for a in reads(i):
            if a in params:
                pgrad = max(pgrad, val(a).nbytes if val(a).is_float else 0)
            elif val(a).is_float and r(a) not in grads:
                grads[r(a)] = val(a).nbytes
                new += val(a).nbytes
        peak = max(peak, held + sum(grads.values()) + pgrad)
        held -= sum(val(n).nbytes for n in names if first_saver[n] == i) + extra
        held -= release.get(i, 0)
        out = makes.get(i)
        if out is not None:
            grads.pop(out, None)
    return saved_total, max(0, peak - saved_total)


def recompute_flops(program: Program) -> float:
    """The matmul FLOPs backward runs again under `recompute` (one microbatch, this rank)."""
    total = 0.0
    for a, b in program.recompute:
        for step in program.steps[a:b]:
            if isinstance(step, Compute) and step.kind == "einsum":
                sizes: dict[str, int] = {}
                for name in step.args:
                    v = program.value(name)
                    sizes.update(zip(v.dims, v.local_shape, strict=True))
                total += 2 * math.prod(sizes.values())
    return total
