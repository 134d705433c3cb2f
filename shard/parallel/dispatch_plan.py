"""The collectives a routing op makes inside its kernel: moe's counts and token exchange.

A `moe` Compute whose tokens are split over axes (`step.dist`: its record gives the token dims
a STAT role) routes only this rank's tokens. So that every choice takes the slot it takes on
one rank, the kernel gathers each rank's per-expert choice counts over those axes: one
allgather of an int64 [1, top_k, runs, experts] tensor over their communicator (runs: the
rank's stretches of tokens contiguous in the batch; shard/parallel/moe_dispatch.py). Where the
experts are split over one of them (`step.exchange`: rules.exchange), each kept choice's token goes
to
the rank holding its expert and the expert's output comes back: two alltoallv forward
(dispatch, combine), and their reverses in backward (combine's first).

The alltoallv row counts depend on the routing, so they are not known before a step runs. The
figure here is the expected value at the capacity bound: every expert gets its full capacity
(or every choice is kept, if the slots exceed them), spread evenly over the routing ranks, of
which (n-1)/n of the rows leave each rank (n: the exchange axis's size). A plan's alltoallv
shape has -1 rows (varies). explain, the expected sequence (sequence.py) and `show` all read
this list. Pure data.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.plan.dtypes import DTYPE_BYTES
from soapstone.shard.plan.program import Compute, Program

VARIES = -1  # a dim whose size the routing decides at run time


@attrs.frozen
class Call:
    """One collective of an op's kernel on this rank: phase, comm op, the mesh axes of its
    communicator, the tensor it passes (shape, dtype), its payload in the comm convention
    (allgather: the output's bytes; alltoallv: the bytes that leave the rank) and what it
    moves."""

    phase: str  # forward | backward
    kind: str  # allgather | alltoallv
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    payload: int
    what: str


def slots(step: Compute, program: Program) -> int:
    """An expert's capacity over the whole batch: ceil(capacity * tokens * top_k / experts),
    or every token (capacity 0: no choice dropped)."""
    x = program.value(step.args[0])
    sizes = dict(program.dims)
    tokens = math.prod(sizes[d] for d in x.dims if d != step.attr("hidden"))
    n_exp = sizes[str(step.attr("experts"))]
    capacity = float(step.attr("capacity"))
    if not capacity:
        return tokens
    return math.ceil(capacity * tokens * int(step.attr("top_k")) / n_exp)


def expected_rows(step: Compute, program: Program, axis: str) -> int:
    """Rows one rank sends off-rank per exchange, expected at the capacity bound (module doc)."""
    sizes = dict(program.dims)
    x = program.value(step.args[0])
    tokens = math.prod(sizes[d] for d in x.dims if d != step.attr("hidden"))
    n_exp = sizes[str(step.attr("experts"))]
    kept = min(tokens * int(step.attr("top_k")), n_exp * slots(step, program))
    mesh = dict(program.mesh)
    n = mesh[axis]
    return kept * (n - 1) // (n * math.prod(mesh[a] for a in step.dist))


def runs(step: Compute, program: Program) -> int:
    """Stretches of a rank's tokens that are contiguous in the batch: the product of the
    local sizes of the token dims outside the innermost split one (1 if only the leading
    dim, or none, is split)."""
    x = program.value(step.args[0])
    sizes = dict(program.dims)
    lead = [(d, n) for d, n in zip(x.dims, x.local_shape, strict=True)
            if d != step.attr("hidden")]
    split = [j for j, (d, n) in enumerate(lead) if n < sizes[d]]
    return math.prod(n for _, n in lead[:split[-1]]) if split else 1


def kernel_calls(program: Program, step: Compute) -> list[Call]:
    """The collectives `step`'s kernel makes, forward in call order then backward in call
    order ([] for ops without any besides their records' dist_stats)."""
    if step.kind != "moe" or not step.dist:
        return []
    x = program.value(step.args[0])
    mesh = dict(program.mesh)
    n_exp = dict(program.dims)[str(step.attr("experts"))]
    k = int(step.attr("top_k"))
    axes = tuple(a for a in mesh if a in step.dist)
    shape = (1, k, runs(step, program), n_exp)
    out = [Call("forward", "allgather", axes, shape, "i64",
                math.prod(mesh[a] for a in axes) * math.prod(shape) * DTYPE_BYTES["i64"],
                "each rank's choice counts per expert")]
    back: list[Call] = []
    h = x.local_shape[x.dims.index(str(step.attr("hidden")))]
    for axis in step.exchange:
        payload = expected_rows(step, program, axis) * h * DTYPE_BYTES[x.dtype]
        shape = (VARIES, h)
        out.append(Call("forward", "alltoallv", (axis,), shape, x.dtype, payload,
                        "tokens to their experts' ranks"))
        out.append(Call("forward", "alltoallv", (axis,), shape, x.dtype, payload,
                        "expert outputs back"))
        back.append(Call("backward", "alltoallv", (axis,), shape, x.dtype, payload,
                         "expert outputs' gradients to the experts"))
        back.append(Call("backward", "alltoallv", (axis,), shape, x.dtype, payload,
                         "tokens' gradients back"))
    return out + back


def expert_figures(program: Program) -> list[dict]:
    """Per moe op: its experts, how many each rank holds, their parameter bytes on a rank,
    the axes it exchanges tokens over and the choices its capacity bound keeps (what the
    expected alltoallv bytes assume)."""
    out = []
    sizes = dict(program.dims)
    for s in program.steps:
        if not isinstance(s, Compute) or s.kind != "moe":
            continue
        dim = str(s.attr("experts"))
        w1 = program.value(s.args[2])
        x = program.value(s.args[0])
        tokens = math.prod(sizes[d] for d in x.dims if d != s.attr("hidden"))
        choices = tokens * int(s.attr("top_k"))
        out.append({"op": s.out, "experts": sizes[dim],
                    "per_rank": w1.local_shape[w1.dims.index(dim)],
                    "param_bytes": sum(program.value(a).nbytes for a in s.args[2:]
                                       if dim in program.value(a).dims),
                    "exchange": list(s.exchange), "choices": choices,
                    "bound": min(choices, sizes[dim] * slots(s, program))})
    return out


def saved_bytes(step: Compute, program: Program) -> int:
    """Bytes a moe kernel (shard/ops/moe.py, shard/parallel/moe_dispatch.py) keeps for backward
    besides its input, expected at the capacity bound (every expert full, the choices spread evenly
    over
    the tokens), as read off its autograd graph: the router's probabilities (fp32) and top-k
    indices (int64); per choice this rank's experts run, the expert's hidden before and
    after its activation (SwiGLU: also the gate branch and the product), rows of hidden (2
    exchanged: the rows and the output; 3 local: also the gated output), an int64 index and
    (local) a gate; per kept choice of this rank's tokens that the exchange brings back, 2
    rows, its gate and index."""
    x = program.value(step.args[0])
    sizes = dict(program.dims)
    item = DTYPE_BYTES[x.dtype]
    dim = str(step.attr("experts"))
    w1 = program.value(step.args[2])
    n_exp = sizes[dim]
    f = w1.local_shape[w1.dims.index(str(step.attr("ffn")))]
    h = x.local_shape[x.dims.index(str(step.attr("hidden")))]
    tokens = math.prod(sizes[d] for d in x.dims if d != step.attr("hidden"))
    local = math.prod(n for d, n in zip(x.dims, x.local_shape, strict=True)
                      if d != step.attr("hidden"))
    bound = min(tokens * int(step.attr("top_k")), n_exp * slots(step, program))
    mesh = dict(program.mesh)
    spread = math.prod(mesh[a] for a in step.exchange)  # ranks whose tokens meet here
    run = bound * w1.local_shape[w1.dims.index(dim)] // n_exp * local * spread // tokens
    hidden = (4 if step.attr("activation") == "swiglu" else 2) * f * item
    router = local * (n_exp * 4 + int(step.attr("top_k")) * 8)
    if step.exchange:
        own = bound * local // tokens
        return router + run * (2 * h * item + hidden + 8) + own * (2 * h * item + 12)
    return router + run * (3 * h * item + hidden + 12)
