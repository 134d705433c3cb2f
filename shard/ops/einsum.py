"""einsum: the named-dim contraction every projection, attention score and mix is made of."""

from __future__ import annotations

import functools
import math

from soapstone.shard.ops.record import (
    Bound,
    OpRecord,
    Partial,
    Role,
    Slot,
    keeps_args,
    saves_inputs,
)


@functools.cache
def matmul_split(a: tuple[str, ...], b: tuple[str, ...], out: tuple[str, ...]) -> int:
    """k when a's last k dims are b's first k (contracted) and the output is the rest of a
    then the rest of b: the contraction is one matmul. 0 otherwise."""
    for k in range(min(len(a), len(b)), 0, -1):
        if a[len(a) - k:] == b[:k] and out == a[:len(a) - k] + b[k:] \
                and not set(a[:len(a) - k]) & set(b[k:]):
            return k
    return 0


def einsum_flops(step, program) -> int:
    """2 x the product of the iteration dims' local sizes: a multiply and an add for every
    point of the contraction (the one FLOP count of an einsum: cost, recompute, selective)."""
    sizes: dict[str, int] = {}
    for name in step.args:
        v = program.value(name)
        sizes.update(zip(v.dims, v.local_shape, strict=True))
    return 2 * math.prod(sizes.values())


def einsum_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Dims of the output FREE, the contracted ones SUM."""
    every = dict.fromkeys(d for dims in arg_dim_lists for d in dims)
    return {d: (Role.FREE if d in op.type.dims else Role.SUM) for d in every}


def scaled_copy(step, program) -> int:
    """A scaled einsum multiplies a copy of its product (the kernel's `y * scale`)."""
    return program.value(step.out).nbytes if step.attr("scale") is not None else 0


@functools.cache
def einsum_spec(a: tuple[str, ...], b: tuple[str, ...], out: tuple[str, ...]) -> str:
    """torch.einsum's equation for named dims ("abc,cd->abd"), computed once per shape."""
    letter = {d: chr(ord("a") + i) for i, d in enumerate(dict.fromkeys((*a, *b, *out)))}
    return f"{''.join(letter[d] for d in a)},{''.join(letter[d] for d in b)}->" \
        f"{''.join(letter[d] for d in out)}"


def einsum(step, args, ctx):
    """Named-dim contraction; a split contracted dim leaves each rank a partial sum."""
    import torch

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


RECORDS = (
    OpRecord(
        "einsum",
        "args (a, b); output dims = type.dims; dims of a or b not in the output are "
        "contracted (summed). attrs: scale (float, optional, multiplies the result)",
        kernel=einsum, roles=einsum_roles, partial_pass=Partial.ONE, bound=Bound.MATMUL,
        flops=einsum_flops, saves=saves_inputs, scratch=scaled_copy, keeps=keeps_args,
        # attention's scores carry the 1/sqrt(d) scale into the fused call; its context
        # product and a fused linear's matmul honour none
        fuses={Slot.SCORES: frozenset({"scale"}), Slot.CONTEXT: frozenset(),
               Slot.MATMUL: frozenset()},
    ),
)
