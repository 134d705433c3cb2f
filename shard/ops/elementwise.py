"""Elementwise ops: add and mul (broadcast by dim name), the activations, sigmoid, dropout."""

from __future__ import annotations

import functools
import math
import zlib

from soapstone.shard.ops.record import (
    OpRecord,
    Partial,
    Slot,
    keeps_args,
    per_element,
    saves_input,
    saves_inputs,
    saves_output,
)


def binary(step, args, ctx, fn):
    """fn(a, b) with both operands laid out along the output's dims."""
    from soapstone.shard.ops.kernels import align

    out = ctx.out(step).dims
    a, b = ctx.arg(step, 0).dims, ctx.arg(step, 1).dims
    return fn(align(args[0], a, out), align(args[1], b, out))


def add(step, args, ctx):
    """Broadcasting sum by dim name."""
    import torch

    return binary(step, args, ctx, torch.add)


def mul(step, args, ctx):
    """Broadcasting product by dim name."""
    import torch

    return binary(step, args, ctx, torch.mul)


def gelu(step, args, ctx):
    """GELU, exact or (approximate = tanh) GPT-2's form."""
    import torch.nn.functional as F

    return F.gelu(args[0], approximate=str(step.attr("approximate", "none")))


def relu(step, args, ctx):
    """max(x, 0)."""
    import torch.nn.functional as F

    return F.relu(args[0])


def silu(step, args, ctx):
    """x * sigmoid(x)."""
    import torch.nn.functional as F

    return F.silu(args[0])


def sigmoid(step, args, ctx):
    """1 / (1 + exp(-x)) (Qwen2-MoE's shared-expert gate)."""
    import torch

    return torch.sigmoid(args[0])


def dropout_p(step) -> float:
    """The drop probability (0 when unset)."""
    return float(step.attr("p", 0.0) or 0.0)


def dropout(step, args, ctx):
    """The mask is drawn for the global tensor (the whole batch, even when this program runs
    one microbatch of it) and sliced, so every layout and schedule drops the same. Backward
    keeps the mask as bools, one byte an element (as torch's own dropout does), never a float
    copy of it, so it is never redrawn."""
    import torch

    p = float(step.attr("p", 0.0))
    if p == 0.0 or not ctx.training:
        return args[0]
    v = ctx.arg(step, 0)
    key = f"{ctx.rng_seed}/{ctx.rng_step}/{step.out}".encode()
    g = torch.Generator().manual_seed(zlib.crc32(key))
    # drawn on the CPU on every device, so a GPU run drops what the CPU run drops
    keep = (torch.rand(ctx.global_sizes(v), generator=g) >= p)[ctx.global_slices(v)]
    # a copy of this rank's slice: a view would keep the global mask alive for backward
    return _masked().apply(args[0], keep.to(args[0].device, copy=True), 1.0 - p)


@functools.cache
def _masked():
    """x * keep / q with `keep` (bool) the one tensor saved for backward (made on first use:
    the records import no torch)."""
    import torch

    class Masked(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x, keep, q):
            fctx.save_for_backward(keep)
            fctx.q = q
            return x * keep.to(x.dtype) / q

        @staticmethod
        def backward(fctx, grad):
            (keep,) = fctx.saved_tensors
            # autograd's order for x * k / q: the division's gradient, then the product's
            return grad / fctx.q * keep.to(grad.dtype), None, None

    return Masked


def dropout_saves(step, program, floats: list[str]) -> tuple[list[str], int]:
    """A bool mask of the input's elements, one byte each (none at p = 0)."""
    x = program.value(step.args[0])
    return [], math.prod(x.local_shape) if dropout_p(step) else 0


RECORDS = (
    OpRecord("add", "args (a, b), broadcast by dim name; output dims = type.dims",
             kernel=add, partial_pass=Partial.ALL, flops=per_element(1), grad_passes=True,
             fuses={Slot.BIAS: frozenset()}),
    OpRecord("mul", "args (a, b), broadcast by dim name", kernel=mul,
             partial_pass=Partial.ONE, flops=per_element(1), saves=saves_inputs,
             keeps=keeps_args),
    OpRecord("gelu", "args (x,). attrs: approximate=tanh (optional: GPT-2's tanh form)",
             kernel=gelu, flops=per_element(8), saves=saves_input),
    OpRecord("relu", "args (x,)", kernel=relu, flops=per_element(1), saves=saves_output),
    OpRecord("silu", "args (x,)", kernel=silu, flops=per_element(4), saves=saves_input),
    OpRecord("sigmoid", "args (x,)", kernel=sigmoid, flops=per_element(4),
             saves=saves_output),
    OpRecord("dropout", "args (x,). attrs: p (float)", kernel=dropout,
             partial_pass=Partial.ONE, flops=per_element(2),
             identity=lambda step: not dropout_p(step), saves=dropout_saves),
)
