"""What each redistribution kind means: one table, read by lowering's cost model, the runtime,
`soapstone show` and `soapstone explain`.

A `Redistribute` step (or a `CopyTo`) runs one collective forward on one mesh axis and, for a
float value, possibly another in backward: the transpose of the forward (a gather's gradient is
a scatter, a slice's gradient a gather, ...). For each kind the table names both, and which
side's bytes are the collective's payload in the comm layer's convention
(`soapstone.comm.accounting.bus_bytes`: the input for allreduce, reduce_scatter, alltoall and
broadcast, the output for allgather). Everything that counts or prints traffic goes through
`forward_op` / `backward_op`, so the compiler's model, `show`'s step list and `explain`'s rows
cannot disagree about what a step moves; the runtime dispatches on the same kinds
(shard/runtime/sharded_model.py REDISTRIBUTE, tested to cover this table exactly).
"""

from __future__ import annotations

import attrs

from soapstone.comm.accounting import bus_bytes
from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import CopyTo, GradPlacement, Program, Redistribute, Step


@attrs.frozen
class Kind:
    """One redistribution kind: its forward collective and its gradient's (None: local)."""

    name: str
    forward: str | None  # the comm op forward runs (None: a local slice or fill)
    forward_payload: str  # "src" | "out": whose bytes the forward op's payload is
    backward: str | None  # the comm op the gradient runs (None: nothing to move)
    backward_payload: str = "src"  # "src" | "out", as forward_payload


KINDS: dict[RedistributeKind, Kind] = {RedistributeKind(k.name): k for k in (
    Kind("allreduce", "allreduce", "src", None),  # P -> R: the gradient is already whole
    Kind("reduce_scatter", "reduce_scatter", "src", "allgather", "src"),  # P -> S
    Kind("allgather", "allgather", "out", None),  # S -> R (grad="partial": see backward_op)
    Kind("slice", None, "src", "allgather", "src"),  # R -> S: free forward, gathered back
    Kind("alltoall", "alltoall", "src", "alltoall", "out"),  # S(a) -> S(b)
    Kind("broadcast", "broadcast", "src", None),  # owned -> R: a branch's value to all
    Kind("zero_fill", None, "src", None),  # owned -> P: zeros off the owner, free
)}

# Megatron's f: identity forward, its gradient summed over the axis.
COPY_TO = Kind("copy_to", None, "src", "allreduce", "out")


def kind_of(step: Redistribute | CopyTo) -> Kind:
    """The table row of a redistribution step."""
    return COPY_TO if isinstance(step, CopyTo) else KINDS[step.kind]


def forward_op(step: Step) -> str | None:
    """The collective this step runs forward (None: local work or a Compute)."""
    if not isinstance(step, Redistribute | CopyTo):
        return None
    return kind_of(step).forward


def backward_op(step: Step) -> str | None:
    """The collective that runs in backward for this step (None: none). An allgather whose
    consumers all vary per rank takes its gradient as a partial sum (`grad="partial"`): its
    backward is a reduce_scatter (sequence parallelism)."""
    if isinstance(step, Redistribute) and step.kind is RedistributeKind.ALLGATHER \
            and step.grad is GradPlacement.PARTIAL:
        return "reduce_scatter"
    if not isinstance(step, Redistribute | CopyTo):
        return None
    return kind_of(step).backward


def _payload(program: Program, step: Redistribute | CopyTo, side: str) -> int:
    return program.value(step.src if side == "src" else step.out).nbytes


def forward_bytes(program: Program, step: Redistribute | CopyTo) -> int:
    """The payload of the step's forward collective (0 when it has none)."""
    k = kind_of(step)
    return _payload(program, step, k.forward_payload) if k.forward else 0


def backward_bytes(program: Program, step: Redistribute | CopyTo) -> int:
    """The payload of the step's backward collective (0 when it has none)."""
    if backward_op(step) is None:
        return 0
    k = kind_of(step)
    side = "out" if isinstance(step, Redistribute) and step.kind is RedistributeKind.ALLGATHER \
        else k.backward_payload
    return _payload(program, step, side)


LATENCY_BYTES = 16 * 1024  # a collective's fixed cost, in bytes of bandwidth (alpha-beta model)


def transition_cost(kind: RedistributeKind | None, local_bytes: int, n: int) -> float:
    """Lowering's modelled cost of turning one placement into another on an axis of n ranks,
    for a tensor holding `local_bytes` on this rank before: the latency plus the bytes this
    rank sends in the forward collective (comm.accounting's ring formulas)."""
    if kind is None or n == 1:
        return 0.0
    if kind is RedistributeKind.INVALID:
        return float("inf")
    k = KINDS[kind]
    if k.forward is None:
        return 0.0
    # an allgather's payload is its output: n pieces of what this rank holds
    payload = local_bytes * n if k.forward_payload == "out" else local_bytes
    return LATENCY_BYTES + bus_bytes(k.forward, payload, n)
