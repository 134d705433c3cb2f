"""What `overlap tensor`'s collective matmuls (comm/collective_matmul.py) hold while they run,
as explain's walks (activations.py) add it: a rule over the compiled rings
(shard/parallel/ring_plan.py), each term measured on a lone ring under LiveBytes
(shard/runtime/memory.py) at t = 2 and 4 ranks, and checked by hand in
tests/shard/plan/test_ring_memory.py.

The runtime runs a ring's matmuls at its collective step, so the walks take the steps in that
order (`order`). In the walks' terms (c: the shard a gather ring sends, t: the ring's ranks):

- gather ring, forward (at the gather): the walk counts the shard and the gathered value;
  the ring holds the shard and t-1 received chunks (one c fewer: its own chunk is the shard)
  and, at the end, each reader's per-chunk outputs beside their concatenation: 2 sum(O) - c
  on top. Its readers' own temporaries run per chunk, inside that.
- gather ring, backward (at its last reader, where the walk has every output's gradient in
  flight): no gradient of the gathered value ever exists; per chunk the partial sum in
  flight and the one arriving (2c), the chunk's input gradient summed over the readers
  (autograd adds them out of place: 3c with two readers or more, c with one), the weight
  gradients summed so far and the chunk's (2 sum(W)), and the reader's output-gradient chunk
  copied where the ring's dim is not leading (O_j / t): the most of 5c + 2 sum(W),
  4c + 2 sum(W) + max O_j/t (a reader after the first autograd runs), for one reader
  3c + 2 sum(W) + O/t, and 3c + 3 sum(W) while the weight gradients are added up; on more
  than two ranks 2c more (the step before's chunk gradient and partial sum still held).
- scatter ring: the ring keeps x's chunks for backward (`keeps`: the reduce-scatter step
  keeps them, whose backward unpacks them first; its matmul none), each copied contiguous
  where the ring's dim is not leading: new tensors (X bytes), kept beside x where another
  step keeps x too; else views of x. It reads x where it runs (`reads`: x lives until
  then). Forward (at the reduce-scatter; the walk counts x, the chunks, the partial
  product Y and the output chunk Y/t): the partial sum arriving (Y/t) on top, and on more
  than two ranks the step before's sum (Y/t). Backward (at the reduce-scatter too, where
  the walk has the output's gradient Y/t in flight and counts x's gradient X): the most of
  the chunk arriving, the input gradient's pieces and three weight gradients (Y/t + X + 3W,
  while they are added) and the pieces beside their concatenation with one weight gradient
  (2X + W), less the X counted: max(Y/t + 3W, X + W). No gradient of the partial product
  exists.
Where a ring runs its steps, the collective's own copies (collective_scratch.py), the
matmuls' temporaries and their weight gradient (the walk's `pgrad`) are the ring's.

A float8 ring (ring_plan.float8_rings, shard/runtime/float8.py) holds other things
(`float8_gather` and `float8_scatter`, in elements: e the shard, n the gathered value, o_i
and w_i a matmul's output and weight, each float8 copy one byte an element; CAST_BYTES an
element while a cast runs). A gather ring keeps the gathered e4m3 value whole for backward
(the walk counts it at one byte an element: precision.float8_kept) and its readers keep
nothing; a scatter ring keeps x itself (bf16), no chunks.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.ops.einsum import CAST_BYTES
from soapstone.shard.parallel.ring_plan import Ring, find_rings, float8_rings, ring_runs_at
from soapstone.shard.plan.analysis.collective_scratch import leading
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Program


@attrs.frozen
class RingWork:
    """The rings' part in the walks: the order steps run in, each ring step's bytes beside
    what the walk counts there (forward: every ring step's; backward), the steps whose own
    temporaries and weight gradient the ring's are, the values whose gradient no ring makes,
    what a ring step keeps for backward instead of its op's saves (values, bytes of new
    tensors) and what it reads besides its own arguments."""

    order: tuple[int, ...]
    forward: dict[int, int]
    backward: dict[int, int]
    members: frozenset[int]
    ungraded: frozenset[str]
    keeps: dict[int, tuple[tuple[str, ...], int]]
    reads: dict[int, tuple[str, ...]]


def ring_work(program: Program) -> RingWork:
    """The working sets of `program`'s rings, by step (module doc)."""
    rings = find_rings(program)
    f8 = float8_rings(program, marked=True)
    runs_at = ring_runs_at(program)
    order = tuple(sorted(range(len(program.steps)), key=lambda i: (runs_at.get(i, i), i)))
    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    ungraded: set[str] = set()
    keeps: dict[int, tuple[tuple[str, ...], int]] = {}
    reads: dict[int, tuple[str, ...]] = {}
    val, params = program.value, {p.name for p in program.params}
    for at, ring in rings.items():
        step = program.steps[at]
        mms = [program.steps[j] for j in ring.matmuls]
        ws = [next(val(a).nbytes for a in s.args if a in params) for s in mms]
        t = dict(program.mesh)[ring.axis]
        ungraded.add(step.out if ring.kind is RedistributeKind.ALLGATHER else step.src)
        if at in f8 and ring.kind is RedistributeKind.ALLGATHER:
            fwd[at], bwd[ring.matmuls[-1]] = float8_gather(program, ring, ws, t)
        elif at in f8:  # a scatter ring keeps x itself (bf16), read where it runs
            x = next(a for a in mms[0].args if a not in params)
            fwd[at], bwd[at] = float8_scatter(program, ring, ws, t)
            keeps[ring.matmuls[0]], keeps[at], reads[at] = ((), 0), ((x,), 0), (x,)
        elif ring.kind is RedistributeKind.ALLGATHER:
            c = val(step.src).nbytes
            outs = [val(s.out) for s in mms]
            fwd[at] = 2 * sum(o.nbytes for o in outs) - c
            copied = [0 if leading(o.local_shape, o.dims, ring.dim) else o.nbytes // t
                      for o in outs]
            w = sum(ws)
            bwd[ring.matmuls[-1]] = max(
                5 * c + 2 * w if len(outs) > 1 else 0,
                (4 * c + max(copied[:-1]) if len(outs) > 1 else 3 * c + copied[0]) + 2 * w,
                3 * c + 3 * w) + (2 * c if t > 2 else 0)
        else:
            x = val(next(a for a in mms[0].args if a not in params))
            chunk = val(step.out).nbytes
            copied = not leading(x.local_shape, x.dims, ring.dim)
            keeps[ring.matmuls[0]] = ((), 0)
            keeps[at] = ((), x.nbytes) if copied else ((x.name,), 0)
            reads[at] = (x.name,)
            fwd[at] = chunk * (2 if t > 2 else 1)
            bwd[at] = max(chunk + 3 * ws[0], x.nbytes + ws[0])
    members = frozenset(rings) | frozenset(runs_at)
    fwd = {i: fwd.get(i, 0) for i in members}
    return RingWork(order, fwd, bwd, members, frozenset(ungraded), keeps, reads)


def _elems(program: Program, name: str) -> int:
    return math.prod(program.value(name).local_shape)


def _weight_elems(program: Program, step) -> int:
    params = {p.name: p for p in program.params}
    return next(math.prod(params[a].local_shape) for a in step.args if a in params)


def float8_gather(program: Program, ring: Ring, ws: list[int], t: int) -> tuple[int, int]:
    """A float8 gather ring's (forward, backward) bytes beside the walk's (module doc).
    Forward, beside the shard and the gathered e4m3 value: x's cast, then each weight's
    beside x's copy and the weights' before it, then the received chunks put together
    beside the chunks' outputs, then the outputs put together beside the chunks' and x's
    copy. Backward, beside the outputs' gradients: each gradient's e5m2 cast and weight's
    cast, then the ring (the partial sum in flight and arriving, the chunk's two partial
    products, the gradient rows copied), then each weight gradient beside x's gradient, the
    gathered value's transposed copy and the gradient's column-major one."""
    step, mms = program.steps[ring.at], [program.steps[j] for j in ring.matmuls]
    e, n, c = _elems(program, step.src), _elems(program, step.out), program.value(step.src).nbytes
    o = [_elems(program, s.out) for s in mms]
    big = [program.value(s.out).nbytes for s in mms]
    w = [_weight_elems(program, s) for s in mms]
    casts = max(sum(w[:i]) + CAST_BYTES * w[i] for i in range(len(w)))
    fwd = max(CAST_BYTES * e - n, e + casts - n, n + sum(big) + sum(w),
              e + 2 * sum(big) + sum(w))
    both = sum(o) + sum(w)
    grads = max(max(sum(o[:i]) + sum(w[:i]) + CAST_BYTES * o[i] for i in range(len(o))),
                sum(o) + casts)
    ring_part = both + 4 * c + max(o) // t + (2 * c if t > 2 else 0)
    gw = both + c + n + max(o) + sum(ws)
    return fwd, max(grads, ring_part, gw)


def float8_scatter(program: Program, ring: Ring, ws: list[int], t: int) -> tuple[int, int]:
    """A float8 scatter ring's (forward, backward) bytes beside the walk's (module doc).
    Forward, beside x, the partial product and the output chunk: x's cast, the weight's beside
    it, then per chunk x's rows copied, the partial sum arriving. Backward, beside the output
    chunk's gradient and x's gradient: the gradient's cast, the weight's, the gradient's e5m2
    chunks put together beside x's gradient's pieces, x's cast, the weight gradient with the
    transposed and column-major copies, and the pieces put together."""
    mm = program.steps[ring.matmuls[0]]
    x = next(a for a in mm.args if a not in {p.name for p in program.params})
    ex, big_x = _elems(program, x), program.value(x).nbytes
    y = _elems(program, mm.out)  # the partial product's elements, e5m2 once gathered
    big_y = program.value(mm.out).nbytes
    w = _weight_elems(program, mm)
    fwd = max(CAST_BYTES * ex, ex + CAST_BYTES * w, ex + w + ex // t + big_y // t) - big_y
    bwd = max(CAST_BYTES * y // t, y // t + CAST_BYTES * w, 2 * y + big_x + w,
              y + y // t + big_x + w + CAST_BYTES * ex,
              2 * y + y // t + big_x + w + 2 * ex + ws[0],
              y + y // t + 2 * big_x + w + ex + ws[0]) - big_x
    return max(0, fwd), max(0, bwd)
