"""Float8 weight matmuls (`run --precision float8`): tensorwise dynamic scaling, as torchao's
Float8Linear does it by default (written here, not imported).

Forward: y = x . w with x and w each cast to float8_e4m3fn at scale = e4m3_max / amax(|t|)
(one scale per tensor, taken from the tensor itself every call), multiplied by
`torch._scaled_mm` with a bf16 result. Backward: the output gradient g cast to float8_e5m2
(more range, fewer mantissa bits: gradients span more decades) at its own amax scale, then
grad_x = g . w^T (e5m2 x e4m3) and grad_w = x^T . g (e4m3 x e5m2).

What backward keeps: the bf16 x and w, as torchao does (its `matmul_with_hp_or_float8_args`
saves the high-precision operands and casts again), so a float8 step holds what a bf16 step
holds; the float8 copies live only while their matmul runs (x's, shared, until a float8
matmul reads another input: `LastCast`). The casts are the same values again
(same tensor, same amax), so the forward and backward operands agree bit for bit.

`_scaled_mm` takes its first operand row-major and its second column-major, and on CUDA
needs the contracted and the output widths to be multiples of 16. Every matmul of the three
contracts or outputs each of tokens, in-width and out-width once, so all three must be
multiples of 16; `check_shapes` refuses others before a step runs, naming the layer and the
fix, on every device alike (the CPU kernel is laxer: the same spec must run on both).
Attention's activation-activation matmuls never come here (shard/ops/einsum.py
`float8_steps`), nor does a linear with `float8 = false`.

Scales are per local tensor: under tensor or sequence parallelism each rank scales its own
shard (torchao over DTensor takes the global amax), so a layout's steps agree with one rank's
within float8 rounding, not bit for bit. One exception, torchtitan's Float8 tensor parallel:
sequence parallelism's gather of a float8 linear's input (einsum.py `float8_gathers`) casts
each shard at the amax allreduced over the gather's axis and moves e4m3 bytes
(`Float8Gather`); that is the cast of the gathered tensor, so the step is bit for bit the
bf16-gather-then-cast one, with half the gathered bytes.

`overlap tensor`'s rings (comm/collective_matmul.py) run their float8 matmuls here, chunk by
chunk, at the non-ring step's scales, so a ring's results are the blocking step's bit for bit
at 2 ranks (on more, up to the order the ranks' partial sums are added, as in bf16)
(`Float8GatherRing`, `Float8ScatterRing`): the casts are made whole, once, before the ring
(elementwise at one scale, so a chunk of the cast is the cast of the chunk), the e4m3 / e5m2
bytes travel, each chunk's rows are one `_scaled_mm` (row-blocked: the same rows as the whole
product's), and each weight gradient is one `_scaled_mm` over the whole float8 operands the
ring brought (a sum of per-chunk products would round differently).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from soapstone.comm.collective_matmul import ring_all_gather, ring_reduce_scatter
from soapstone.comm.errors import UserError
from soapstone.shard.ops.einsum import FLOAT8_MULTIPLE, float8_misfit, float8_steps
from soapstone.shard.parallel.ring_plan import float8_ring_refusal

E4M3 = torch.float8_e4m3fn  # forward operands: x and w
E5M2 = torch.float8_e5m2  # gradients
EPS = 1e-12  # amax floor: an all-zero tensor casts to zeros at a finite scale (torchao's)


class Float8Shape(UserError, ValueError):
    """A float8 matmul whose widths `_scaled_mm` cannot take."""


def to_float8(t: torch.Tensor, dtype: torch.dtype,
              amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in `dtype` at scale fmax / amax, saturated; the inverse scale `_scaled_mm` takes);
    `amax`: the max |.| of the whole tensor t is a shard of (default: t's own)."""
    fmax = torch.finfo(dtype).max
    amax = (t.detach().abs().max() if amax is None else amax).to(torch.float64)
    scale = (fmax / amax.clamp(min=EPS)).to(torch.float32)
    data = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return data, scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t with the same shape and values, laid out column-major (_scaled_mm's second operand)."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _mm(a, a_inv, b, b_inv, out_dtype):
    return torch._scaled_mm(a.contiguous(), column_major(b), scale_a=a_inv, scale_b=b_inv,
                            out_dtype=out_dtype)


class Float8Matmul(torch.autograd.Function):
    """y[m, n] = x[m, k] . w[k, n] in float8 (module doc); gradients in the operands' dtypes.
    `xq`, `xi`: x's cast already made (`LastCast`), or None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, xq=None, xi=None,
                gathered: bool = False) -> torch.Tensor:
        # gathered: x is a float8 gather's stand-in (`Float8Gather`), xq its only values;
        # backward keeps xq (1 byte an element, as torchao keeps a float8-gathered input)
        ctx.gathered, ctx.dtype = gathered, x.dtype
        ctx.save_for_backward(*((xq, xi) if gathered else (x,)), w)
        if xq is None:
            xq, xi = to_float8(x, E4M3)
        wq, wi = to_float8(w, E4M3)
        return _mm(xq, xi, wq, wi, x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        *xs, w = ctx.saved_tensors
        gq, gi = to_float8(g, E5M2)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            wq, wi = to_float8(w, E4M3)
            gx = _mm(gq, gi, wq.t(), wi, ctx.dtype)  # g . w^T: w^T is column-major already
        if ctx.needs_input_grad[1]:
            # the same cast again: x's own amax is the global one a gather casts at
            xq, xi = xs if ctx.gathered else to_float8(xs[0], E4M3)
            gw = _mm(xq.t(), xi, gq, gi, w.dtype)  # x^T . g
        return gx, gw, None, None, None


class Float8Gather(torch.autograd.Function):
    """Sequence parallelism's allgather of a float8 linear's input, in float8 (torchtitan's
    Float8 tensor parallel): the shards' amax allreduced (max: one scalar), each shard cast to
    e4m3 at that global scale, the e4m3 bytes gathered. The cast equals gathering then casting
    bit for bit (same scale, elementwise). The result is a stand-in of the gathered shape that
    holds no bytes (an expanded scalar) and carries the gradient; its float8 values travel
    beside it (`gathered_cast`). Backward as the bf16 allgather's: reduce-scatter or slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, dim: int, grad: str, box: list) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.grad = comm, dim, grad
        amax = x.detach().abs().max().to(torch.float32).reshape(1)
        comm.allreduce(amax, op="max")
        xq, xi = to_float8(x, E4M3, amax[0])
        # the communicators carry no float8 dtype: its bytes travel as uint8
        box.append((comm.allgather(xq.view(torch.uint8), dim).view(E4M3), xi))
        return x.new_zeros(()).expand(box[0][0].shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        c = ctx.comm
        if ctx.grad == "partial":
            return c.reduce_scatter(g.contiguous(), ctx.dim), None, None, None, None
        return g.chunk(c.size, ctx.dim)[c.rank].contiguous(), None, None, None, None


def float8_gather(x: torch.Tensor, comm, dim: int, grad: str) -> torch.Tensor:
    """x's allgather along `dim` over `comm` in float8 (`Float8Gather`): the stand-in, with
    its float8 values and inverse scale as its `float8_cast`."""
    box: list = []
    y = Float8Gather.apply(x, comm, dim, grad, box)
    y.float8_cast = box[0]
    return y


def gathered_cast(source) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The float8 values `float8_gather` made for `source`, or None (any other tensor)."""
    return getattr(source, "float8_cast", None)


def float8_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding t's bytes: a float8 gather's values for its stand-in, else t."""
    cast = gathered_cast(t)
    return t if cast is None else cast[0]


class LastCast:
    """The forward cast of the last float8 matmul's input, kept for the next one: matmuls
    that read one activation one after another (q, k and v; a gated mlp's two inputs) cast
    it once, as torch.compile's common-subexpression pass makes torchao's casts. One slot:
    it holds one float8 copy at a time, dropped at the forward's end (and at the step's,
    for what a recompute in backward cast)."""

    def __init__(self):
        # weakly: the source tensor would hold its autograd graph (a recompute range's second
        # run's, to the step's end) where only its identity is wanted
        self.source: weakref.ref | None = None
        self.cast: tuple[torch.Tensor, torch.Tensor] | None = None

    def release(self) -> None:
        """Drop the kept cast (a forward's end: nothing holds it past its matmuls)."""
        self.source = self.cast = None

    def of(self, source: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's e4m3 cast (x: `source` as [M, K]), made once while `source` is the input
        (and x's shape the same: matmuls contracting other dims cast afresh)."""
        if self.source is None or self.source() is not source or self.cast is None \
                or self.cast[0].shape != x.shape:
            self.source, self.cast = weakref.ref(source), to_float8(x.detach(), E4M3)
        return self.cast


def matmul(x: torch.Tensor, w: torch.Tensor, where: str, last: LastCast | None = None,
           source: torch.Tensor | None = None) -> torch.Tensor:
    """x[M, K] . w[K, N] in float8 (module doc), in x's dtype; `where` names the layer;
    `last` shares x's cast with the matmul before when both read `source` (x before its
    reshape)."""
    check_widths(x.shape[0], x.shape[1], w.shape[1], where)
    cast = gathered_cast(source)
    if cast is not None:
        return Float8Matmul.apply(x, w, cast[0].reshape(x.shape), cast[1], True)
    if last is None or source is None:
        return Float8Matmul.apply(x, w)
    return Float8Matmul.apply(x, w, *last.of(source, x))


def check_widths(m: int, k: int, n: int, where: str) -> None:
    """Float8Shape unless tokens m, in-width k and out-width n are multiples of 16."""
    bad = float8_misfit((m, k, n))
    if bad:
        raise Float8Shape(f"{where}: torch._scaled_mm needs widths that are multiples of "
                          f"{FLOAT8_MULTIPLE}; it has {bad} on this rank")


def check_shapes(program) -> None:
    """Float8Shape for the first float8 step of `program` whose local widths are not multiples
    of 16 (a Program is compiled for one microbatch), or a ring it cannot run in float8,
    naming the layer and the fix (ring_plan.float8_ring_refusal)."""
    why = float8_ring_refusal(program)
    if why:
        raise Float8Shape(why)


def float8_matmuls(program, last: LastCast | None = None) -> dict:
    """The float8 matmul of each step of `program` that runs in float8, by its output (what
    Shards.float8 holds), after `check_shapes`; `last`: the cast they share (`LastCast`)."""
    steps = float8_steps(program)
    check_shapes(program)
    return {program.steps[i].out: functools.partial(
        matmul, where=program.steps[i].source or program.steps[i].out, last=last)
        for i in steps}


def check_graph(graph) -> None:
    """Float8Shape for the first stage of `graph` with a float8 matmul `_scaled_mm` cannot
    take: every rank checks every stage, so all refuse alike and none waits on another."""
    for stage in graph.stages:
        check_shapes(stage.program)



def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """t as [rows, its last k dims' product] (matmul_2d's view of an activation)."""
    return t.reshape(-1, math.prod(t.shape[t.dim() - k:]))


def _cast_weight(w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w as [K, N] (its first k dims contracted) in e4m3 at its own amax."""
    return to_float8(w.reshape(math.prod(w.shape[:k]), -1), E4M3)


def _global_cast(t: torch.Tensor, comm, dtype: torch.dtype):
    """t (a shard) cast at the amax allreduced over `comm` (one fp32 scalar): the cast the
    whole tensor would have, bit for bit (`Float8Gather`)."""
    amax = t.detach().abs().max().to(torch.float32).reshape(1)
    comm.allreduce(amax, op="max")
    return to_float8(t, dtype, amax[0])


def _ring_gather(comm, q: torch.Tensor, dim: int, use) -> torch.Tensor:
    """Pass float8 `q`'s chunks around the ring as uint8 (the communicators carry no float8),
    calling use(c, chunk c) on each as it arrives; the chunks put together along `dim`."""
    got = [None] * comm.size

    def each(c, chunk):
        got[c] = chunk
        use(c, chunk.view(q.dtype))

    ring_all_gather(comm, q.view(torch.uint8), each)
    return torch.cat(got, dim).view(q.dtype)


def _product(q, qi, w, wq, wi, k, scale, dtype):
    """q's rows (e4m3, its last k dims contracted) times w's cast, in q's leading dims then
    w's trailing ones, scaled as the einsum step says."""
    y = _mm(_rows(q, k), qi, wq, wi, dtype).reshape(*q.shape[:q.dim() - k], *w.shape[k:])
    return y if scale is None else y * scale


class Float8GatherRing(torch.autograd.Function):
    """A gather ring's matmuls y_i = all_gather(x) . w_i in float8 (torchtitan's AsyncTP with
    Float8 linears): x's shard cast at the allreduced amax (`Float8Gather`'s cast), its e4m3
    chunks sent around the ring, each chunk's rows multiplied as it arrives. Backward: each
    y_i's gradient cast whole at its own amax (e5m2, as `Float8Matmul`), x's gradient's
    partial sums travelling the reduce-scatter ring (bf16, summed over the matmuls last to
    first, the order autograd sums a shared input's gradients in), w_i's gradient one product
    of the gathered e4m3 x (kept: 1 byte an element, as a float8 gather keeps it)."""

    @staticmethod
    def forward(ctx, x, comm, dim, ks, scales, *ws):
        xq, xi = _global_cast(x, comm, E4M3)
        wqs = [_cast_weight(w, k) for w, k in zip(ws, ks, strict=True)]
        outs = [[None] * comm.size for _ in ws]

        def use(c, q):
            for i, (w, k, (wq, wi)) in enumerate(zip(ws, ks, wqs, strict=True)):
                outs[i][c] = _product(q, xi, w, wq, wi, k, scales[i], x.dtype)

        whole = _ring_gather(comm, xq, dim, use)
        ctx.comm, ctx.dim, ctx.ks, ctx.scales, ctx.dtype = comm, dim, ks, scales, x.dtype
        ctx.save_for_backward(whole, xi, *ws)
        return tuple(torch.cat(o, dim) for o in outs)

    @staticmethod
    def backward(ctx, *gs):
        whole, xi, *ws = ctx.saved_tensors
        n, dim = ctx.comm.size, ctx.dim
        casts = []  # per matmul: its output gradient's e5m2 cast (shaped as y), w's cast, x's
        # leading (uncontracted) dims
        for g, w, k, scale in zip(gs, ws, ctx.ks, ctx.scales, strict=True):
            if g is None:
                g = whole.new_zeros(*whole.shape[:whole.dim() - k], *w.shape[k:],
                                    dtype=ctx.dtype)
            g = g if scale is None else g * scale
            gq, gi = to_float8(g.reshape(-1, math.prod(w.shape[k:])), E5M2)
            casts.append((gq.view(g.shape), gi, _cast_weight(w, k), whole.dim() - k))

        def part(c):  # chunk c's rows of x's gradient: this rank's partial sum
            total = None
            for gq, gi, (wq, wi), lead in reversed(casts):
                rows = gq.chunk(n, dim)[c].contiguous()
                gx = _mm(rows.reshape(-1, wq.shape[1]), gi, wq.t(), wi, ctx.dtype)
                gx = gx.reshape(*rows.shape[:lead], *whole.shape[lead:])
                total = gx if total is None else total + gx
            return total

        gx = ring_reduce_scatter(ctx.comm, part)
        gws = []
        for (gq, gi, _, _), w, k in zip(casts, ws, ctx.ks, strict=True):
            xs = _rows(whole, k)
            gws.append(_mm(xs.t(), xi, gq.reshape(xs.shape[0], -1), gi,
                           w.dtype).reshape(w.shape))
        return (gx, None, None, None, None, *gws)


class Float8ScatterRing(torch.autograd.Function):
    """A scatter ring's reduce_scatter(x . w) in float8: x cast whole at its own amax (this
    rank's x, as `Float8Matmul` casts it), each chunk of rows multiplied while the partial
    sum before it travels (bf16, as the reduce-scatter's). Backward: the output gradient's
    shard cast at the amax allreduced over the ring (the cast of the gathered gradient, as
    the blocking step makes it), its e5m2 chunks sent around the ring, x's gradient rows per
    chunk, w's gradient one product of the whole e5m2 gradient the ring brought."""

    @staticmethod
    def forward(ctx, x, comm, dim, k, scale, w):
        xq, xi = to_float8(x, E4M3)
        wq, wi = _cast_weight(w, k)
        n = comm.size
        out = ring_reduce_scatter(comm, lambda c: _product(
            xq.chunk(n, dim)[c].contiguous(), xi, w, wq, wi, k, scale, x.dtype))
        ctx.comm, ctx.dim, ctx.k, ctx.scale = comm, dim, k, scale
        ctx.save_for_backward(x, w)  # bf16, as Float8Matmul keeps them
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        k, lead = ctx.k, x.dim() - ctx.k
        g = g if ctx.scale is None else g * ctx.scale
        gq, gi = _global_cast(g, ctx.comm, E5M2)
        wq, wi = _cast_weight(w, k)
        gxs = [None] * ctx.comm.size

        def use(c, q):
            gx = _mm(q.reshape(-1, wq.shape[1]), gi, wq.t(), wi, x.dtype)
            gxs[c] = gx.reshape(*q.shape[:lead], *x.shape[lead:])

        whole = _ring_gather(ctx.comm, gq, ctx.dim, use)
        xq, xi = to_float8(_rows(x, k), E4M3)
        gw = _mm(xq.t(), xi, whole.reshape(xq.shape[0], -1), gi, w.dtype).reshape(w.shape)
        return torch.cat(gxs, ctx.dim), None, None, None, None, gw


def float8_gather_ring(x, comm, dim: int, ws, ks, scales) -> tuple[torch.Tensor, ...]:
    """[all_gather(x, dim) . ws[i]] in float8, as a ring (`Float8GatherRing`); ks[i]: the
    dims each contracts (x's last, w's first), scales[i]: the einsum's scale or None."""
    return Float8GatherRing.apply(x, comm, dim, tuple(ks), tuple(scales), *ws)


def float8_scatter_ring(x, comm, dim: int, w, k: int, scale) -> torch.Tensor:
    """reduce_scatter(x . w) over `dim` in float8, as a ring (`Float8ScatterRing`)."""
    return Float8ScatterRing.apply(x, comm, dim, k, scale, w)
