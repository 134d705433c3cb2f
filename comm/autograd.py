"""Autograd-aware collectives: torch.autograd.Function wrappers taking (x, comm, ...).

Forward and backward are each other's transposes (Megatron's f/g pairs): an identity whose
gradient must be summed over ranks is `copy_to`, a sum whose gradient is replicated is
`reduce_from`, and so on. No forward modifies its input: in-place collectives work on a clone.
Gradients arriving in backward may be non-contiguous or shared, so they are copied before
any in-place collective too.
"""

from __future__ import annotations

import torch

from soapstone.comm.communicator import Communicator
from soapstone.comm.errors import CommError


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy we may reduce into in place."""
    return t.clone(memory_format=torch.contiguous_format)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.allreduce(_fresh(g)), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, backward):
        ctx.comm, ctx.mode = comm, backward
        return comm.allreduce(_fresh(x))

    @staticmethod
    def backward(ctx, g):
        if ctx.mode == "allreduce":
            return ctx.comm.allreduce(_fresh(g)), None, None
        return g, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, grad):
        ctx.comm, ctx.dim, ctx.grad = comm, dim, grad
        return comm.allgather(_dense(x), dim)

    @staticmethod
    def backward(ctx, g):
        c = ctx.comm
        if ctx.grad == "partial":
            return c.reduce_scatter(_dense(g), ctx.dim), None, None, None
        return _dense(g.chunk(c.size, ctx.dim)[c.rank]), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(_dense(x), dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.allgather(_dense(g), ctx.dim), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        if x.shape[dim] % comm.size:
            raise CommError(
                f"split: size {x.shape[dim]} of dim {dim} is not divisible by the "
                f"communicator size {comm.size}; pad or pick another dim"
            )
        return _dense(x.chunk(comm.size, dim)[comm.rank])

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.allgather(_dense(g), ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, split_dim, concat_dim):
        ctx.comm, ctx.dims = comm, (split_dim, concat_dim)
        return comm.alltoall(_dense(x), split_dim, concat_dim)

    @staticmethod
    def backward(ctx, g):
        split_dim, concat_dim = ctx.dims
        # the inverse all-to-all: split what was concatenated, concatenate what was split
        return ctx.comm.alltoall(_dense(g), concat_dim, split_dim), None, None, None


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, send_sizes, recv_sizes):
        ctx.comm, ctx.sizes = comm, (send_sizes, recv_sizes)
        return comm.alltoallv(_dense(x), send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, g):
        send_sizes, recv_sizes = ctx.sizes
        # the reverse exchange: each row's gradient goes back to the rank it came from
        return ctx.comm.alltoallv(_dense(g), recv_sizes, send_sizes), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, src):
        ctx.keep = comm.rank == src
        return comm.broadcast(_fresh(x), src=src)

    @staticmethod
    def backward(ctx, g):
        # The broadcast value is replicated, so every rank's gradient is the whole one:
        # the source keeps it; the others' inputs were placeholders.
        return (g if ctx.keep else torch.zeros_like(g)), None, None


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dst, tag):
        ctx.comm, ctx.dst, ctx.tag = comm, dst, tag
        ctx.meta = (x.shape, x.dtype, x.device)
        comm.send(_dense(x.detach()), dst, tag)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        shape, dtype, device = ctx.meta
        g = torch.empty(shape, dtype=dtype, device=device)
        ctx.comm.recv(g, ctx.dst, ctx.tag)
        return g, None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, comm, src, tag):
        ctx.comm, ctx.src, ctx.tag = comm, src, tag
        out = torch.empty(shape, dtype=dtype, device=comm.device)
        return comm.recv(out, src, tag)

    @staticmethod
    def backward(ctx, g):
        ctx.comm.send(_dense(g), ctx.src, ctx.tag)
        return None, None, None, None, None, None


def copy_to(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Forward identity; backward allreduce(sum) of the gradient."""
    return _CopyTo.apply(x, comm)


def reduce_from(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Forward allreduce(sum); backward identity."""
    return _AllReduce.apply(x, comm, "identity")


def all_reduce(x: torch.Tensor, comm: Communicator, backward: str = "identity") -> torch.Tensor:
    """Forward allreduce(sum); backward "identity" (= reduce_from) or "allreduce"."""
    if backward not in ("identity", "allreduce"):
        raise CommError(
            f"all_reduce: `backward`={backward!r} is unknown; pass 'identity' or 'allreduce'"
        )
    return _AllReduce.apply(x, comm, backward)


def all_gather(x: torch.Tensor, comm: Communicator, dim: int, grad: str = "partial"):
    """Forward allgather along `dim`; backward reduce_scatter ("partial": each rank holds a
    term of the gradient) or this rank's slice of it ("replicate": the gradient is equal on
    every rank)."""
    if grad not in ("partial", "replicate"):
        raise CommError(f"all_gather: `grad`={grad!r} is unknown; pass 'partial' or 'replicate'")
    return _AllGather.apply(x, comm, dim, grad)


def reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Forward reduce_scatter(sum) along `dim`; backward allgather."""
    return _ReduceScatter.apply(x, comm, dim)


def split(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Forward this rank's equal chunk along `dim` (no communication); backward allgather."""
    return _Split.apply(x, comm, dim)


def all_to_all(x: torch.Tensor, comm: Communicator, split_dim: int, concat_dim: int):
    """Forward alltoall(split_dim -> concat_dim); backward the inverse all-to-all."""
    return _AllToAll.apply(x, comm, split_dim, concat_dim)


def all_to_all_v(x: torch.Tensor, comm: Communicator, send_sizes, recv_sizes) -> torch.Tensor:
    """Forward alltoallv along dim 0 (send_sizes[j] rows to rank j, recv_sizes[j] from it);
    backward the reverse alltoallv, sizes swapped."""
    return _AllToAllV.apply(x, comm, [int(s) for s in send_sizes], [int(s) for s in recv_sizes])


def broadcast(x: torch.Tensor, comm: Communicator, src: int) -> torch.Tensor:
    """Forward: rank `src`'s tensor on every rank. Backward: the (replicated) gradient goes to
    `src`'s input; the other ranks' inputs get zeros."""
    return _Broadcast.apply(x, comm, src)


def send(x: torch.Tensor, comm: Communicator, dst: int, tag: int = 0) -> torch.Tensor:
    """Send `x` to `dst` now; return a scalar token. Backward of the token (e.g.
    `token.backward()` in the pipeline's backward step) receives x's gradient from `dst`."""
    return _Send.apply(x, comm, dst, tag)


def recv(shape, dtype: torch.dtype, comm: Communicator, src: int, tag: int = 0,
         requires_grad: bool = True) -> torch.Tensor:
    """Receive a tensor of `shape`/`dtype` from `src`. With requires_grad, its gradient is
    sent back to `src` during backward (pair with `send` there; the output must be used in
    the loss, or the sender waits for a gradient that never comes)."""
    anchor = torch.empty(0, requires_grad=requires_grad)
    out = _Recv.apply(anchor, tuple(shape), dtype, comm, src, tag)
    return out if requires_grad else out.detach()
