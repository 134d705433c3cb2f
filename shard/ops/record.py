"""One record per primitive op: everything the compiler, the plan and the runtime know of it.

A layer expands into primitives (dsl/layers/); each primitive is one `OpRecord`, in the module
of its family (einsum.py, norms.py, positions/masks.py, ...), listed by registry.py. The
record holds:

- `doc`: its args and attrs (what `ir` lists as the primitives);
- its sharding rule: the role of every dim of its iteration space (`roles`), how an arg's dims
  name that space (`arg_dims`), partial sums it passes through (`partial_pass`), an arg it may
  read whole (`whole_arg`), rows it may move to their owners (`exchange`);
- `dist_stats`: the allreduces of statistics its distributed form runs per split axis;
- its cost: `bound` (what bounds its time) and `flops` (its forward arithmetic on this rank);
- `saves`: what its kernel keeps for backward (`scratch`: a temporary it makes in forward
  beside its output; `backward_scratch`: one its backward makes beside the gradients;
  `grad_in_place`: its backward writes its first arg's gradient into that arg's saved storage
  where the runtime lets it, shard/runtime/overwrite_plan.py; `grad_passes`: its backward
  hands the output's gradient as it is to each arg of the output's size, one tensor for all:
  add), `keeps`: the args among them
  a ZeRO-3 unpack meets, `calls`: the collectives its kernel runs itself (expert routing);
- `fuses`: the slots of the fused chains (shard/runtime/fusion_plan.py) it may fill and, per
  slot, the attrs the fused kernel honours: a step with any other attr is not fused, so a
  fused kernel never silently drops an option; `mask`: a mask's rule, shared by its kernel
  and the fused attention kernel;
- `kernel`: its local implementation over a rank's shards (shard/ops/kernels.py has the
  context it runs in). Records import no torch: each kernel imports it when it first runs,
  so `check`, `show` and `explain` read the records where torch cannot load.

A dim's role decides what splitting it over a mesh axis means for the op:
- FREE: the op works slice by slice along it; args that have the dim are split the same way
  and so is the output (batch, seq, heads, ffn in an elementwise op or einsum's free dims);
- SUM: the op sums over it linearly (einsum's contracted dims, the vocab lookup of an
  embedding, the positions a mean loss averages): args split along it give a partial output;
- STAT: the op reduces over it through a statistic with a distributed form (layernorm's mean
  and variance, softmax's max and sum, cross-entropy's log-sum-exp): args split along it,
  the op combines partial statistics across the axis, the output keeps the split (or is
  replicated when the dim is gone).
Besides splits, linear ops pass partial sums through (`partial_pass`): einsum and mul with one
partial arg, add with all args partial. Everything else in the Megatron and sequence-parallel
patterns follows from these rules and the cost of moving data; nothing is special-cased.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping

import attrs


class Role(enum.Enum):
    """What splitting a dim of an op's iteration space means (module doc)."""

    FREE = "free"
    SUM = "sum"
    STAT = "stat"


class Partial(enum.Enum):
    """Partial sums an op passes through: ONE arg partial (the rest replicated), or ALL."""

    ONE = "one"
    ALL = "all"


class Reduce(enum.Enum):
    """The reduction of one distributed statistic (the comm layer's op name as value)."""

    SUM = "sum"
    MAX = "max"


class StatShape(enum.Enum):
    """The shape of one statistic: the arg's with the reduced dim 1 (KEEP), the other dims
    then a 1 (LAST: reduced after moving the dim last), or the other dims alone (DROP)."""

    KEEP = "keep"
    LAST = "last"
    DROP = "drop"


class Bound(enum.Enum):
    """What bounds an op's time: matmul FLOPs, memory traffic, or nothing (a view)."""

    MATMUL = "matmul"
    MEMORY = "memory"
    VIEW = "view"


class Slot(enum.Enum):
    """A place in a fused chain (shard/runtime/fusion_plan.py). Attention: SCORES (q . k),
    an optional MASK, PROBS (softmax over keys), CONTEXT (probs . v); linear: MATMUL (x . W)
    then BIAS (+ b)."""

    SCORES = "scores"
    MASK = "mask"
    PROBS = "probs"
    CONTEXT = "context"
    MATMUL = "matmul"
    BIAS = "bias"


@attrs.frozen
class DistStat:
    """One allreduce a distributed form runs per split axis: its reduction, whether backward
    allreduces its gradient too (a max is a constant for stability: no gradient), its shape."""

    reduce: Reduce
    backward: bool
    shape: StatShape = StatShape.KEEP


@attrs.frozen
class MaskRule:
    """A mask over (query, key) positions: `visible(attrs, qi, ki)`, the bool matrix [q, k] of
    the keys each query sees from global positions qi, ki (torch tensors); `causal(attrs)`,
    whether that is exactly key <= query (what scaled_dot_product_attention's is_causal does)."""

    visible: Callable = attrs.field(eq=False)
    causal: Callable[[dict], bool] = attrs.field(eq=False)


def free_roles(op, arg_dim_lists) -> dict[str, Role]:
    """Every output dim FREE: an elementwise op."""
    return dict.fromkeys(op.type.dims, Role.FREE)


def same_dims(op, arg: int, dims: tuple[str, ...]) -> tuple[str, ...]:
    """An arg's dims name the op's iteration space as they are."""
    return dims


def no_exchange(op, arg_dim_lists) -> tuple[tuple[str, str], ...]:
    """No rows to move to their owners."""
    return ()


def unknown_flops(step, program) -> int | None:
    """A cost the plan does not model."""
    return None


def per_element(n: int) -> Callable:
    """FLOPs of an op doing `n` operations per output element."""

    def flops(step, program) -> int:
        """`n` x this rank's output elements."""
        return n * math.prod(program.value(step.out).local_shape)

    return flops


def saves_nothing(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Keeps nothing for backward."""
    return [], 0


def saves_inputs(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Keeps its float operands (a product keeps both sides)."""
    return floats, 0


def saves_input(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Keeps its input."""
    return floats[:1], 0


def saves_output(step, program, floats: list[str]) -> tuple[list[str], int]:
    """Keeps its output."""
    return [step.out], 0


def no_scratch(step, program) -> int:
    """Makes no temporary beside its output."""
    return 0


def keeps_none(step) -> tuple[str, ...]:
    """Keeps no arg a ZeRO-3 unpack would gather."""
    return ()


def keeps_args(step) -> tuple[str, ...]:
    """Keeps its args (weights included), unpacked in order."""
    return step.args


def no_calls(program, step) -> list:
    """Runs no collective of its own."""
    return []


@attrs.frozen
class OpRecord:
    """One primitive op (module doc). The callables take the IR op (`roles`, `arg_dims`,
    `exchange`: the compiler) or the Program's Compute step and the Program (the rest)."""

    name: str
    doc: str
    kernel: Callable | None = attrs.field(default=None, eq=False)
    roles: Callable = attrs.field(default=free_roles, eq=False)
    arg_dims: Callable = attrs.field(default=same_dims, eq=False)
    partial_pass: Partial | None = None
    whole_arg: bool = False  # reads an arg by global index: may take it whole (repeat_dim)
    exchange: Callable = attrs.field(default=no_exchange, eq=False)
    dist_stats: tuple[DistStat, ...] = ()
    bound: Bound = Bound.MEMORY
    flops: Callable = attrs.field(default=unknown_flops, eq=False)
    # the attrs for which the output is the input itself (dropout at p = 0)
    identity: Callable | None = attrs.field(default=None, eq=False)
    saves: Callable = attrs.field(default=saves_nothing, eq=False)
    scratch: Callable = attrs.field(default=no_scratch, eq=False)  # forward temporary bytes
    backward_scratch: Callable = attrs.field(default=no_scratch, eq=False)
    grad_in_place: bool = False
    grad_passes: bool = False
    keeps: Callable = attrs.field(default=keeps_none, eq=False)
    calls: Callable = attrs.field(default=no_calls, eq=False)
    fuses: Mapping[Slot, frozenset[str]] = attrs.field(factory=dict, eq=False)
    mask: MaskRule | None = None

    def __attrs_post_init__(self) -> None:
        if (Slot.MASK in self.fuses) != (self.mask is not None):
            raise ValueError(f"{self.name}: a MASK slot needs a mask rule and a rule a slot")

    def aliases(self, step) -> bool:
        """Whether `step`'s output is its first operand's storage (a view, or an identity)."""
        return self.bound is Bound.VIEW or (self.identity is not None and self.identity(step))

    def flops_per_element(self, step, program) -> float | None:
        """`flops` per element of the output (None where the cost is not modelled)."""
        total = self.flops(step, program)
        if total is None:
            return None
        n = math.prod(program.value(step.out).local_shape)
        return total / n if n else 0.0

    def fits(self, step, slot: Slot) -> bool:
        """Whether `step` may fill `slot` of a fused chain: the record allows the slot and the
        fused kernel honours every attr the step sets."""
        honoured = self.fuses.get(slot)
        return honoured is not None and all(k in honoured for k, _ in step.attrs)

    def stat_shape(self, k: int, dims: tuple[str, ...], shape: tuple[int, ...],
                   over: str) -> tuple[int, ...]:
        """The shape of statistic k of the distributed form over an arg of `dims`/`shape`."""
        how = self.dist_stats[k].shape
        if how is StatShape.KEEP:
            return tuple(1 if d == over else n for d, n in zip(dims, shape, strict=True))
        lead = tuple(n for d, n in zip(dims, shape, strict=True) if d != over)
        return lead + (1,) if how is StatShape.LAST else lead
