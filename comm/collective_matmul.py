"""Collective matmul (AsyncTP): an all-gather fused with the ops that read its result, and ops
fused with the reduce-scatter of their partial sums, both as rings of async p2p steps.

`all_gather_apply(x, comm, dim, fns, ws, out_dims)` is `[f(all_gather(x), w) for f, w]` for
ops f that act row by row along `dim` (the gathered dim passes through f to `out_dims[i]`):
each rank applies the ops to the chunk it holds while that chunk travels on around the ring
(t-1 steps: send the chunk in hand to the next rank, receive from the previous, apply the ops
to the chunk in hand), writing each chunk's output rows into place.

`apply_reduce_scatter(x, comm, dim, fn, w)` is `reduce_scatter(fn(x, w))` over the dim fn maps
`dim` to:
the rows of each output chunk are computed as a partial sum on every rank and the partials
travel the ring, each rank adding its own, until chunk r arrives complete at rank r. Its sum
runs in ring order, not in the reduce-scatter's: the results agree up to summation order.

Each is the other's transpose, so one ring serves a forward and the other's backward: the
gradient of an all-gather-apply is an apply-reduce-scatter of the ops' input gradients and
vice versa. The ops' own gradients are taken per chunk from the graphs kept in forward.
`ring_all_gather` and `ring_reduce_scatter` are the rings themselves; float8 matmuls run their
own pair over them (shard/runtime/float8.py), casting whole tensors before the ring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import attrs
import torch

from soapstone.comm.communicator import Communicator
from soapstone.comm.errors import CommError

TAG = 29  # the ring's p2p tag (MPI; NCCL pairs messages in issue order)


def _shift(comm: Communicator, t: torch.Tensor):
    """Post: send `t` to the next rank, receive its like from the previous; (buffer, works)."""
    buf = torch.empty_like(t)
    n, r = comm.size, comm.rank
    works = comm.batch_p2p([("isend", t, (r + 1) % n, TAG), ("irecv", buf, (r - 1) % n, TAG)])
    return buf, works


def ring_all_gather(comm: Communicator, x: torch.Tensor, use: Callable[[int, torch.Tensor], None]):
    """Call use(c, chunk c) for every rank's chunk c, this rank's first, each while the next
    is in flight."""
    n, r = comm.size, comm.rank
    cur = x.contiguous()
    for s in range(n):
        pending = _shift(comm, cur) if s < n - 1 else None
        use((r - s) % n, cur)
        if pending:
            for w in pending[1]:
                w.wait()
            cur = pending[0]


def ring_reduce_scatter(comm: Communicator, part: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The sum over ranks of part(r) (this rank's chunk): each rank computes part(c) for every
    chunk c, while the partial sum of the previous chunk travels to the next rank."""
    n, r = comm.size, comm.rank
    acc = part((r - 1) % n).contiguous()
    for s in range(1, n):
        buf, works = _shift(comm, acc)
        mine = part((r - s - 1) % n)  # overlaps the transfer
        for w in works:
            w.wait()
        acc = buf + mine
    return acc


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


def _grads(ys, leaves, gs) -> list[torch.Tensor | None]:
    """The gradients of `leaves` from the graphs of `ys` given output gradients `gs`."""
    pairs = [(y, g) for y, g in zip(ys, gs, strict=True) if y.requires_grad]
    want = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad([y for y, _ in pairs], want, [g for _, g in pairs],
                                   allow_unused=True) if pairs and want else ())
    return [next(got) if t.requires_grad else None for t in leaves]


def _release(kept: list[torch.Tensor], keep: torch.Tensor) -> None:
    """Free the data of the per-chunk outputs kept as gradient roots (a matmul's backward
    reads only its inputs; the caller has what it returns), all but what `keep` holds."""
    mine = keep.untyped_storage().data_ptr()
    for y in kept:
        if y.untyped_storage().data_ptr() != mine:
            y.untyped_storage().resize_(0)


@attrs.define
class Checkpointed:
    """The rings of one checkpointed range (shard/parallel/recompute.py). Its first run keeps
    no per-chunk graphs; backward's run of it (`replay`) builds them, each ring's for the
    first run's ring in the same place (call order), so that their gradients are taken inside
    the ring's backward without unpacking the checkpoint again (each nested gradient call
    would run the range once more)."""

    slots: list = attrs.Factory(list)
    replay: bool = False
    at: int = 0

    def enter(self, replay: bool) -> None:
        """Start a run of the range: the first, or backward's replay."""
        self.replay, self.at = replay, 0

    def reserve(self) -> int:
        """The first run: a slot for this ring's graphs."""
        self.slots.append(None)
        return len(self.slots) - 1

    def fill(self, graphs) -> None:
        """The replay: this ring's graphs, for the first run's ring in its place."""
        self.slots[self.at] = graphs
        self.at += 1


def _graphs(ctx, stash: Checkpointed | None, x: torch.Tensor, grad: bool, ws):
    """(whether to build per-chunk graphs, the hooks they are built under) for a ring in or out
    of a checkpointed range. The ring saves its weights, through the saved-tensor hooks (ZeRO-3
    stores a gathered parameter as where it lies, not its storage: `_hold`); under a range it
    saves x too, so that its backward unpacks it (the checkpoint runs the range again there,
    filling the slot)."""
    ctx.slot, ctx.held = None, []
    ctx.save_for_backward(*ws, *(() if stash is None else (x,)))
    if stash is None:
        return grad, contextlib.nullcontext()
    if not stash.replay:
        ctx.slot, ctx.stash = stash.reserve(), stash
        return False, contextlib.nullcontext()
    # the replay's graphs hold their tensors themselves, not as checkpoint holders
    return True, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _hold(ctx, leaves: list[torch.Tensor]) -> None:
    """After forward: the weights' leaves (which the per-chunk graphs' gradient nodes hold)
    let go of their storage, so a ZeRO-3 bucket freed after the ring is freed; `_restore`
    gives it back from the saved weights, `_forget` takes it again."""
    ctx.held = leaves
    _let_go(leaves)


def _let_go(leaves: list[torch.Tensor]) -> None:
    for t in leaves:  # never read before _restore: no fill
        t.data = torch.empty(1, dtype=t.dtype, device=t.device).expand(t.shape)


def _restore(ctx):
    """The per-chunk graphs of this ring: its own (its weights' leaves given their data
    back), or (checkpointed) the replay's."""
    saved = ctx.saved_tensors  # under a range, unpacking x runs it again: the slot fills
    if ctx.slot is not None:
        return ctx.stash.slots[ctx.slot]
    for t, w in zip(ctx.held, saved[:len(ctx.held)], strict=True):  # the weights first
        t.data = w
    return ctx.graphs


def _forget(ctx) -> None:
    """Drop this ring's per-chunk graphs once its backward is done, the checkpoint's slot too
    (the stash lives to the step's end)."""
    ctx.graphs = None
    _let_go(ctx.held)  # a ctx lives as long as the step's graph: the bucket must not
    ctx.held = []
    if ctx.slot is not None:
        ctx.stash.slots[ctx.slot] = None


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _check(x: torch.Tensor, comm: Communicator, dim: int, what: str) -> None:
    if x.shape[dim] % comm.size:
        raise CommError(f"{what}: size {x.shape[dim]} of dim {dim} is not divisible by the "
                        f"communicator size {comm.size}; pad or pick another dim")


class _AllGatherApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, grad, stash, dim, fns, out_dims, *ws):
        n = comm.size
        grad, hooks = _graphs(ctx, stash, x, grad, ws)
        wl = [_leaf(w, w.requires_grad) for w in ws]
        kept = [None] * n  # per chunk: (x leaf, outputs)
        outs = [[None] * n for _ in fns]

        def use(c, chunk):
            xl = _leaf(chunk, x.requires_grad)  # a received chunk needs its own flag
            with torch.set_grad_enabled(grad), hooks:
                ys = [f(xl, w) for f, w in zip(fns, wl, strict=True)]
            for i, y in enumerate(ys):
                outs[i][c] = y.detach()
            kept[c] = (xl, ys)

        ring_all_gather(comm, x, use)
        ctx.comm, ctx.dim, ctx.out_dims, ctx.graphs = comm, dim, out_dims, (kept, wl)
        if stash is not None:  # the first run keeps nothing; the replay fills the slot
            ctx.graphs = stash.fill(ctx.graphs) if stash.replay else None
        elif grad:
            _hold(ctx, wl)
        ys = tuple(torch.cat(o, d) for o, d in zip(outs, out_dims, strict=True))  # copies
        _release([t for _, chunk in kept for t in chunk], ys[0])
        return ys

    @staticmethod
    def backward(ctx, *gs):
        kept, wl = _restore(ctx)
        n = ctx.comm.size
        gw = [None] * len(wl)

        def part(c):  # chunk c's input gradient, a partial sum over the ring's ranks
            nonlocal gw
            xl, ys = kept[c]
            g_c = [g.chunk(n, d)[c] for g, d in zip(gs, ctx.out_dims, strict=True)]
            got = _grads(ys, [xl, *wl], g_c)
            gw = [_add(a, b) for a, b in zip(gw, got[1:], strict=True)]
            return got[0] if got[0] is not None else torch.zeros_like(xl)

        gx = ring_reduce_scatter(ctx.comm, part)
        _forget(ctx)
        return (gx, None, None, None, None, None, None, *gw)


class _ApplyReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, grad, stash, dim, fn, w):
        n = comm.size
        grad, hooks = _graphs(ctx, stash, x, grad, (w,))
        # each chunk of rows its own leaf (contiguous, as the kernel takes it): its gradient
        # is that chunk's rows only, and x itself is not held
        xl = [_leaf(t.contiguous(), x.requires_grad) for t in x.chunk(n, dim)]
        wl = _leaf(w, w.requires_grad)
        kept = [None] * n

        def part(c):
            with torch.set_grad_enabled(grad), hooks:
                y = fn(xl[c], wl)
            kept[c] = y
            return y.detach()

        out = ring_reduce_scatter(comm, part)
        ctx.comm, ctx.graphs, ctx.dim = comm, (kept, (xl, wl)), dim
        if stash is not None:  # the first run keeps nothing; the replay fills the slot
            ctx.graphs = stash.fill(ctx.graphs) if stash.replay else None
        elif grad:
            _hold(ctx, [wl])
        _release(kept, out)
        return out

    @staticmethod
    def backward(ctx, g):
        kept, (xl, wl) = _restore(ctx)
        gx, gw = [None] * len(xl), None

        def use(c, g_c):
            nonlocal gw
            gx[c], b = _grads([kept[c]], [xl[c], wl], [g_c])
            gw = _add(gw, b)

        ring_all_gather(ctx.comm, g.contiguous(), use)
        _forget(ctx)
        grad_x = torch.cat([a if a is not None else torch.zeros_like(t)
                            for a, t in zip(gx, xl, strict=True)], ctx.dim)
        return grad_x, None, None, None, None, None, gw


def all_gather_apply(x: torch.Tensor, comm: Communicator, dim: int,
                     fns: Sequence[Callable], ws: Sequence[torch.Tensor],
                     out_dims: Sequence[int], stash: Checkpointed | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """[fns[i](all_gather(x, dim), ws[i])], computed chunk by chunk as the chunks travel the
    ring; fns[i] must act row by row along `dim`, which it maps to out_dims[i]. Its gradient
    is summed over ranks (sequence parallelism's partial gradient). `stash`: inside a
    checkpointed range, its rings' Checkpointed."""
    return _AllGatherApply.apply(x, comm, torch.is_grad_enabled(), stash, dim, tuple(fns),
                                 tuple(out_dims), *ws)


def apply_reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int, fn: Callable,
                         w: torch.Tensor, stash: Checkpointed | None = None) -> torch.Tensor:
    """reduce_scatter(fn(x, w)) over the dim that fn maps x's `dim` to, the partial sums of
    each chunk of rows travelling the ring."""
    _check(x, comm, dim, "apply_reduce_scatter")
    return _ApplyReduceScatter.apply(x, comm, torch.is_grad_enabled(), stash, dim, fn, w)
