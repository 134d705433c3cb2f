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
    """A scaled einsum multiplies a copy of its product (the kernel's `y * scale`); a float8
    one (float8 = true: what precision.program_as_run marks under --precision float8) holds
    its casts (`float8_scratch`)."""
    scaled = program.value(step.out).nbytes if step.attr("scale") is not None else 0
    if step.attr("float8") is not True:
        return scaled
    return scaled + float8_scratch(step, program)[0]


def float8_backward(step, program) -> int:
    """A float8 einsum's backward casts (`float8_scratch`); none for any other einsum."""
    return float8_scratch(step, program)[1] if step.attr("float8") is True else 0


# a cast to float8 (shard/runtime/float8.py `to_float8`) holds two fp32 copies of its tensor at
# once (the upcast and the scaled, then the scaled and the clamped): 8 bytes an element
CAST_BYTES = 8


def float8_scratch(step, program, biased: bool = False) -> tuple[int, int]:
    """(forward, backward) bytes a float8 matmul y = x . w (shard/runtime/float8.py) holds
    beside what the activation walk counts at its step (its output; in backward the output's
    gradient and both operands' at once), at the worst moment of each, in elements X, W, Y
    (float8 copies 1 byte each). Forward: casting x (8X), then w beside x's copy, then the
    matmul with x's, w's and w's column-major copy; `biased` (a fused linear, whose bias add
    follows): the product beside the sum and x's copy (kept for the next matmul: LastCast).
    Backward: casting the gradient g (8Y, before either operand's gradient exists), then w
    beside g's copy, then x beside both (x's gradient made), then the weight gradient's
    matmul with g's and x's copies and each one's transposed copy. An x a float8 gather
    brought (float8_gathered: precision.program_as_run marks it) is cast by neither: its
    float8 copy is the gather's, kept for backward (only its transposed copy is made)."""
    x, w = (program.value(n) for n in step.args)
    y = program.value(step.out)
    nx, nw, ny = (math.prod(v.local_shape) for v in (x, w, y))
    gx, gw = x.nbytes, w.nbytes
    gathered = step.attr("float8_gathered") is True
    cast_x = 0 if gathered else CAST_BYTES * nx
    fwd = max(cast_x - y.nbytes, nx + CAST_BYTES * nw - y.nbytes, nx + 2 * nw,
              nx + y.nbytes if biased else 0)
    # a gathered x's copy is the gather's (kept): only its transposed copy is made here
    bwd = max(CAST_BYTES * ny - gx - gw, ny + CAST_BYTES * nw - gx - gw,
              ny + nw + cast_x - gw, 2 * ny + nw + (1 if gathered else 2) * nx)
    return max(0, fwd), max(0, bwd)


@functools.cache
def einsum_spec(a: tuple[str, ...], b: tuple[str, ...], out: tuple[str, ...]) -> str:
    """torch.einsum's equation for named dims ("abc,cd->abd"), computed once per shape."""
    letter = {d: chr(ord("a") + i) for i, d in enumerate(dict.fromkeys((*a, *b, *out)))}
    return f"{''.join(letter[d] for d in a)},{''.join(letter[d] for d in b)}->" \
        f"{''.join(letter[d] for d in out)}"


def float8_steps(program) -> dict[int, int]:
    """The einsum steps `--precision float8` runs in float8 -> k, the dims they contract: each
    plain matmul (`matmul_split`) of an activation by a weight (Program.weights) that does not
    set float8 = false. Attention's activation-activation matmuls stay in bf16 (torchtitan's
    Float8Linear converts nn.Linear only); so do weight einsums of another shape."""
    out = {}
    for i, step in enumerate(program.steps):
        if getattr(step, "kind", None) != "einsum" or step.attr("float8", True) is False:
            continue
        a, b = (program.value(n) for n in step.args)
        k = matmul_split(a.dims, b.dims, program.value(step.out).dims)
        if k and b.name in program.weights and a.name not in program.weights:
            out[i] = k
    return out


def float8_gathers(program, marked: bool = False) -> dict[int, str]:
    """The allgathers `--precision float8` runs in float8 -> the axis they gather over: each
    float allgather (sequence parallelism's, before the linears) whose value only float8 steps
    read, each as its activation. As torchtitan's Float8 tensor parallel: every rank casts its
    shard at the global amax (a one-scalar allreduce max) and the e4m3 bytes travel, half of
    bf16's; the cast is the one gather-then-cast makes, bit for bit
    (shard/runtime/float8.py `Float8Gather`). A regathered value gathers its float8 bytes
    again for backward; a balanced split's gather over its balancing axis is left alone (it is
    reordered around it).
    `marked`: only readers marked float8 = true (a Program as `--precision float8` runs it:
    precision.program_as_run), for the estimates."""
    f8 = {i for i in float8_steps(program)
          if not marked or program.steps[i].attr("float8") is True}
    readers: dict[str, list[tuple[int, int]]] = {}
    for i, step in enumerate(program.steps):
        if hasattr(step, "args"):
            for j, a in enumerate(step.args):
                readers.setdefault(a, []).append((i, j))
        else:  # a collective reads its src (position -1: no float8 matmul's activation)
            readers.setdefault(step.src, []).append((i, -1))
    kept = {o.value for o in program.outputs}
    out = {}
    for i, step in enumerate(program.steps):
        gather = hasattr(step, "frm") and str(step.kind) == "allgather"  # a Redistribute
        if not gather or step.out in kept or not program.value(step.src).is_float:
            continue
        src = program.value(step.src)
        if step.frm.dim in program.balanced and src.layout.dim_axes(step.frm.dim)[0] == step.axis:
            continue  # the balancing axis's own gather: its pieces are reordered around it
        seen = readers.get(step.out, [])
        if seen and all(r in f8 and j == 0 for r, j in seen):
            out[i] = step.axis
    return out


FLOAT8_MULTIPLE = 16  # torch._scaled_mm's width rule on CUDA


def float8_widths(step, program) -> tuple[int, int, int]:
    """(tokens, in-width, out-width) of a float8 step's [M, K] . [K, N] on this rank."""
    w, out = program.value(step.args[1]), program.value(step.out)
    n = math.prod(s for d, s in zip(out.dims, out.local_shape, strict=True) if d in w.dims)
    k = math.prod(s for d, s in zip(w.dims, w.local_shape, strict=True) if d not in out.dims)
    return math.prod(out.local_shape) // max(n, 1), k, n


def float8_misfit(widths: tuple[int, int, int]) -> str:
    """'' when `_scaled_mm` takes these (tokens, in-width, out-width), else which do not."""
    return ", ".join(f"{name} {size}" for name, size in zip(
        ("tokens", "in-width", "out-width"), widths, strict=True) if size % FLOAT8_MULTIPLE)


def float8_refusal(program) -> str:
    """'' when every float8 step of `program` has widths `_scaled_mm` takes, else why and where
    (the first that does not) and the fixes: what `run --precision float8` refuses (with
    what `overlap tensor`'s rings add: ring_plan.float8_ring_refusal)."""
    for i in sorted(float8_steps(program)):
        step = program.steps[i]
        bad = float8_misfit(float8_widths(step, program))
        if bad:
            return (f"{step.source or step.out}: --precision float8 runs this weight matmul "
                    f"with torch._scaled_mm, whose widths must be multiples of "
                    f"{FLOAT8_MULTIPLE}; it has {bad} on this rank; fix: make the dims "
                    f"multiples of {FLOAT8_MULTIPLE} (or the local batch x sequence, per "
                    f"microbatch), set `float8 = false` on this linear, or run --precision "
                    f"bf16")
    return ""


def matmul_2d(x, w, k: int, float8=None):
    """x[..., c] . w[c, ...] over the k dims c, as one [M, K] . [K, N] matmul (no permutes);
    `float8`: the kernel that runs it instead of torch.matmul (shard/runtime/float8.py)."""
    import torch

    x2, w2 = x.reshape(*x.shape[:-k], -1), w.reshape(math.prod(w.shape[:k]), -1)
    if float8 is not None:
        y = float8(x2.reshape(-1, x2.shape[-1]), w2, source=x)
    else:
        y = torch.matmul(x2, w2)
    return y.reshape(*x.shape[:-k], *w.shape[k:])


def einsum(step, args, ctx):
    """Named-dim contraction; a split contracted dim leaves each rank a partial sum."""
    import torch

    a, b, out = ctx.arg(step, 0).dims, ctx.arg(step, 1).dims, ctx.out(step).dims
    k = matmul_split(a, b, out)
    if k:  # x[..., c] . w[c, ...]: a plain matmul (what nn.Linear runs), no permutes
        y = matmul_2d(*args, k, ctx.float8_kernel(step))
    else:
        y = torch.einsum(einsum_spec(a, b, out), args[0], args[1])
    scale = step.attr("scale")
    return y * scale if scale is not None else y


RECORDS = (
    OpRecord(
        "einsum",
        "args (a, b); output dims = type.dims; dims of a or b not in the output are "
        "contracted (summed). attrs: scale (float, optional, multiplies the result); float8 "
        "(bool, default true: under --precision float8 a weight matmul runs in float8; false "
        "keeps it in bf16)",
        kernel=einsum, roles=einsum_roles, partial_pass=Partial.ONE, bound=Bound.MATMUL,
        flops=einsum_flops, saves=saves_inputs, scratch=scaled_copy, keeps=keeps_args,
        backward_scratch=float8_backward,
        # attention's scores carry the 1/sqrt(d) scale into the fused call; its context
        # product and a fused linear's matmul honour none
        fuses={Slot.SCORES: frozenset({"scale"}), Slot.CONTEXT: frozenset(),
               Slot.MATMUL: frozenset({"float8", "float8_gathered"})},
    ),
)
