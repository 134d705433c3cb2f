"""Local implementations of the primitive ops, over this rank's shards.

Each takes the Compute step, its arg tensors (dims in the order of their program values) and a
`Shards` context that knows the mesh and the global offset of every local slice. An op split
along a dim it reduces over (`step.dist`) runs its distributed form: it combines partial
statistics across that axis with autograd-aware allreduces.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from soapstone.comm import autograd as ag
from soapstone.shard.plan.program import DIST_STATS, Compute, Program, Value
from soapstone.shard.runtime.fusion_plan import matmul_split  # noqa: F401 - ops' name for it

OpFn = Callable[[Compute, list[torch.Tensor], "Shards"], torch.Tensor]
REGISTRY: dict[str, OpFn] = {}


class Shards:
    """Where this rank's pieces sit in the global tensors: offsets and axis communicators."""

    def __init__(self, program: Program, mesh=None):
        self.program = program
        self.mesh = mesh
        self.sizes = dict(program.dims)
        self.training = True
        self.rng_seed = 0  # dropout masks depend on (seed, step, op) only, never on the layout
        self.rng_step = 0
        # Where this program's batch sits in the global batch when it runs one microbatch
        # (pipeline, gradient accumulation): dim -> (offset, global size). Random draws are
        # made at the global size and this window is sliced, as data-parallel ranks do.
        self.window: dict[str, tuple[int, int]] = {}
        # The share of the step's loss gradient this forward's loss carries (1 / microbatches,
        # over gradient accumulation too): a layer's own loss term (moe's balance loss) is
        # scaled by it in backward, as the training loss is.
        self.loss_scale = 1.0
        self.device = torch.device("cpu")  # where the ops' own index tensors are made
        # tensors fixed by the program and this rank's place in it (rope's cos/sin tables),
        # made once instead of every layer of every step
        self.constants: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def comm(self, axis: str):
        """The communicator along one mesh axis."""
        return self.mesh.comm(axis)

    def offset(self, value: Value, dim: str) -> int:
        """Global index of this rank's first element along `dim` of `value`."""
        axis = value.layout.split_axis(dim)
        if axis is None:
            return 0
        return self.mesh.coord(axis) * value.local_shape[value.dims.index(dim)]

    def local_slices(self, value: Value) -> tuple[slice, ...]:
        """This rank's window into the global tensor."""
        return tuple(slice(self.offset(value, d), self.offset(value, d) + n)
                     for d, n in zip(value.dims, value.local_shape, strict=True))

    def global_sizes(self, value: Value) -> tuple[int, ...]:
        """The shape of `value` in the whole batch (a microbatch's dims at their global size)."""
        return tuple(self.window[d][1] if d in self.window else self.sizes[d]
                     for d in value.dims)

    def global_slices(self, value: Value) -> tuple[slice, ...]:
        """This rank's window into `global_sizes(value)`: local_slices shifted by the window."""
        return tuple(slice(s.start + self.window[d][0], s.stop + self.window[d][0])
                     if d in self.window else s
                     for d, s in zip(value.dims, self.local_slices(value), strict=True))

    def arg(self, step: Compute, i: int) -> Value:
        """The program value of arg i."""
        return self.program.value(step.args[i])

    def out(self, step: Compute) -> Value:
        """The program value the step produces."""
        return self.program.value(step.out)


def op(kind: str):
    """Register a local implementation for a primitive kind."""
    def register(fn: OpFn) -> OpFn:
        """Record `fn` as the implementation of `kind` and return it unchanged."""
        REGISTRY[kind] = fn
        return fn
    return register


def align(t: torch.Tensor, dims: tuple[str, ...], target: tuple[str, ...]) -> torch.Tensor:
    """View `t` (with `dims`) laid out along `target`, size-1 where it lacks a dim."""
    if dims == target[len(target) - len(dims):]:
        return t  # already the trailing dims, in order: torch broadcasting does the rest
    order = [dims.index(d) for d in target if d in dims]
    t = t.permute(order) if order != list(range(len(order))) else t
    shape = []
    it = iter(t.shape)
    for d in target:
        shape.append(next(it) if d in dims else 1)
    return t.reshape(shape)


@functools.cache
def einsum_spec(a: tuple[str, ...], b: tuple[str, ...], out: tuple[str, ...]) -> str:
    """torch.einsum's equation for named dims ("abc,cd->abd"), computed once per shape."""
    letter = {d: chr(ord("a") + i) for i, d in enumerate(dict.fromkeys((*a, *b, *out)))}
    return f"{''.join(letter[d] for d in a)},{''.join(letter[d] for d in b)}->" \
        f"{''.join(letter[d] for d in out)}"


@op("einsum")
def einsum(step, args, ctx):
    """Named-dim contraction; a split contracted dim leaves each rank a partial sum."""
    a, b, out = ctx.arg(step, 0).dims, ctx.arg(step, 1).dims, ctx.out(step).dims
    k = matmul_split(a, b, out)
    if k:  # x[..., c] . w[c, ...]: a plain matmul (what nn.Linear runs), no permutes
        x, w = args
        y = torch.matmul(x.reshape(*x.shape[:-k], -1), w.reshape(math.prod(w.shape[:k]), -1))
        y = y.reshape(*x.shape[:-k], *w.shape[k:])
    else:
        y = torch.einsum(einsum_spec(a, b, out), args[0], args[1])
    scale = step.attr("scale")
    return y * scale if scale is not None else y


@op("embedding")
def embedding(step, args, ctx):
    """Lookup; with the vocab split, rows outside this rank's range contribute zeros."""
    ids, table = args
    tv = ctx.arg(step, 1)
    vocab_dim = tv.dims[0]
    if tv.layout.split_axis(vocab_dim) is None:
        return F.embedding(ids, table)
    lo, n = ctx.offset(tv, vocab_dim), tv.local_shape[0]
    inside = (ids >= lo) & (ids < lo + n)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    return F.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)


def _binary(step, args, ctx, fn):
    out = ctx.out(step).dims
    a, b = ctx.arg(step, 0).dims, ctx.arg(step, 1).dims
    return fn(align(args[0], a, out), align(args[1], b, out))


@op("add")
def add(step, args, ctx):
    """Broadcasting sum by dim name."""
    return _binary(step, args, ctx, torch.add)


@op("mul")
def mul(step, args, ctx):
    """Broadcasting product by dim name."""
    return _binary(step, args, ctx, torch.mul)


REGISTRY["gelu"] = lambda step, args, ctx: F.gelu(args[0], approximate=str(
    step.attr("approximate", "none")))
REGISTRY["relu"] = lambda step, args, ctx: F.relu(args[0])
REGISTRY["silu"] = lambda step, args, ctx: F.silu(args[0])
REGISTRY["rename"] = lambda step, args, ctx: args[0]


@op("positions")
def positions(step, args, ctx):
    """0, 1, ... along `over`, shifted to this rank's slice where it is split."""
    v = ctx.out(step)
    return torch.arange(v.local_shape[0], dtype=torch.int64, device=ctx.device) \
        + ctx.offset(v, step.attr("over"))


@op("rope")
def rope(step, args, ctx):
    """x * cos + rotate_half(x) * sin at the global positions of this rank's slice, the angles
    pos * theta^(-2i/d) in fp32 (fp64 for fp64 x) as Hugging Face's LLaMA computes them."""
    x = args[0]
    v = ctx.arg(step, 0)
    pos, over, theta = step.attr("pos"), step.attr("over"), float(step.attr("theta"))
    first, count = ctx.offset(v, pos), v.local_shape[v.dims.index(pos)]
    key = ("rope", pos, over, theta, first, count, v.dims, x.dtype, x.device)
    if key not in ctx.constants:
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        n = ctx.sizes[over]
        inv = 1.0 / theta ** (torch.arange(0, n, 2, dtype=torch.int64).to(wide) / n)
        p = torch.arange(count) + first
        angles = torch.outer(p.to(wide), inv)
        angles = torch.cat((angles, angles), dim=-1).to(x.device)
        ctx.constants[key] = (align(angles.cos().to(x.dtype), (pos, over), v.dims),
                              align(angles.sin().to(x.dtype), (pos, over), v.dims))
    cos, sin = ctx.constants[key]
    d = v.dims.index(over)
    x1, x2 = x.chunk(2, dim=d)
    return x * cos + torch.cat((-x2, x1), dim=d) * sin


@op("repeat_dim")
def repeat_dim(step, args, ctx):
    """Index i of dst (this rank's slice of it) reads index i // group of src (its own slice
    of src, or the whole of it)."""
    x = args[0]
    v, o = ctx.arg(step, 0), ctx.out(step)
    src, dst = step.attr("src"), step.attr("dst")
    group = ctx.sizes[dst] // ctx.sizes[src]
    d = o.dims.index(dst)
    idx = (torch.arange(o.local_shape[d], device=x.device) + ctx.offset(o, dst)) // group \
        - ctx.offset(v, src)
    return x.index_select(d, idx)


@op("dropout")
def dropout(step, args, ctx):
    """The mask is drawn for the global tensor (the whole batch, even when this program runs
    one microbatch of it) and sliced, so every layout and schedule drops the same. Autograd
    saves the mask for backward (a product with a constant), so it is never redrawn."""
    p = float(step.attr("p", 0.0))
    if p == 0.0 or not ctx.training:
        return args[0]
    v = ctx.arg(step, 0)
    key = f"{ctx.rng_seed}/{ctx.rng_step}/{step.out}".encode()
    g = torch.Generator().manual_seed(zlib.crc32(key))
    # drawn on the CPU on every device, so a GPU run drops what the CPU run drops
    keep = (torch.rand(ctx.global_sizes(v), generator=g) >= p)[ctx.global_slices(v)]
    keep = keep.to(args[0].device)
    return args[0] * keep.to(args[0].dtype) / (1.0 - p)


class _Stats:
    """The statistics a distributed form combines across ranks, taken in order from
    program.DIST_STATS (the table `show` and `explain` count): the op's code and the table
    cannot drift, since a reduction the table does not list, or of another kind, is an error."""

    def __init__(self, step: Compute, ctx: Shards):
        self.step, self.ctx = step, ctx
        self.rows = iter(DIST_STATS[step.kind])

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """Allreduce the local statistic `t` with `op` over every axis the op is split on; its
        gradient is summed back where the table says so, else passes through (a max is a
        constant for stability: no gradient)."""
        want, backward = next(self.rows, (None, False))
        if want != op:
            raise RuntimeError(f"{self.step.kind}: reduction {op} where DIST_STATS lists {want}")
        for axis in self.step.dist:
            comm = self.ctx.comm(axis)
            if op == "max":
                t = comm.allreduce(t.detach().clone(), op="max")
            else:
                t = ag.all_reduce(t, comm, backward="allreduce" if backward else "identity")
        return t


@op("layernorm")
def layernorm(step, args, ctx):
    """Normalise over `over`; split, mean and variance combine partial sums across ranks."""
    x, gamma, beta = args
    xv = ctx.arg(step, 0)
    over, eps = step.attr("over"), float(step.attr("eps", 1e-5))
    d = xv.dims.index(over)
    g, b = align(gamma, (over,), xv.dims), align(beta, (over,), xv.dims)
    if not step.dist and d == x.dim() - 1:
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    n, stats = ctx.sizes[over], _Stats(step, ctx)
    centred = x - stats.reduce(x.sum(d, keepdim=True), "sum") / n
    var = stats.reduce((centred * centred).sum(d, keepdim=True), "sum") / n
    return centred * torch.rsqrt(var + eps) * g + b


@op("rmsnorm")
def rmsnorm(step, args, ctx):
    """x / rms(x) * gamma over `over`, the mean square combined across ranks when split."""
    x, gamma = args
    xv = ctx.arg(step, 0)
    over, eps = step.attr("over"), float(step.attr("eps", 1e-6))
    d = xv.dims.index(over)
    ms = _Stats(step, ctx).reduce((x * x).sum(d, keepdim=True), "sum") / ctx.sizes[over]
    return x * torch.rsqrt(ms + eps) * align(gamma, (over,), xv.dims)


@op("softmax")
def softmax(step, args, ctx):
    """Softmax over `over`; split, the max and the normaliser are combined across ranks."""
    x = args[0]
    d = ctx.arg(step, 0).dims.index(step.attr("over"))
    if not step.dist:
        return torch.softmax(x, d)
    stats = _Stats(step, ctx)
    e = torch.exp(x - stats.reduce(x.detach().amax(d, keepdim=True), "max"))
    return e / stats.reduce(e.sum(d, keepdim=True), "sum")


@op("causal_mask")
def causal_mask(step, args, ctx):
    """-inf where the key position is after the query position (global positions)."""
    x = args[0]
    v = ctx.arg(step, 0)
    q, k = step.attr("query"), step.attr("key")
    qi = torch.arange(v.local_shape[v.dims.index(q)], device=x.device) + ctx.offset(v, q)
    ki = torch.arange(v.local_shape[v.dims.index(k)], device=x.device) + ctx.offset(v, k)
    future = align(ki.view(1, -1) > qi.view(-1, 1), (q, k), v.dims)
    return x.masked_fill(future, float("-inf"))


@op("cross_entropy")
def cross_entropy(step, args, ctx):
    """Mean token loss. Split positions give partial sums (divided by the global count);
    a split class dim combines max, log-sum-exp and the target logit across ranks."""
    logits, targets = args
    lv, tv = ctx.arg(step, 0), ctx.arg(step, 1)
    over = step.attr("over")
    lead = tuple(d for d in lv.dims if d != over)
    x = align(logits, lv.dims, (*lead, over))
    t = align(targets, tv.dims, lead)
    count = math.prod(ctx.sizes[d] for d in lead)
    if not step.dist:
        c = x.shape[-1]
        return F.cross_entropy(x.reshape(-1, c), t.reshape(-1), reduction="sum") / count
    stats = _Stats(step, ctx)
    m = stats.reduce(x.detach().amax(-1, keepdim=True), "max")
    se = stats.reduce(torch.exp(x - m).sum(-1), "sum")
    lse = torch.log(se) + m.squeeze(-1)
    lo, n = ctx.offset(lv, over), x.shape[-1]
    inside = (t >= lo) & (t < lo + n)
    local = torch.where(inside, t - lo, torch.zeros_like(t))
    picked = stats.reduce(x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside.to(x.dtype),
                          "sum")
    return (lse - picked).sum() / count


def run_op(step: Compute, args: list[torch.Tensor], ctx: Shards, custom: dict) -> torch.Tensor:
    """Dispatch one Compute step to its implementation."""
    if step.kind.startswith("custom:"):
        if step.kind not in custom:
            name = step.kind.split(":", 1)[1]
            raise KeyError(f"custom layer {name!r} has no implementation here: pass "
                           f"custom={{{name!r}: fn}} to ShardedModel (--plugin does it)")
        return custom[step.kind](*args)
    fn = REGISTRY.get(step.kind)
    if fn is None:
        raise KeyError(f"no local implementation for primitive {step.kind!r}")
    return fn(step, args, ctx)
