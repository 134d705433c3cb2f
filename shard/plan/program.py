"""The Program: what every rank runs, as printable, diffable data.

A list of steps over named values. `Compute` runs one primitive on local shards;
`Redistribute` moves a value between layouts on one mesh axis; `CopyTo` marks where a
replicated value enters rank-varying work (identity forward, allreduce of its gradient
backward). Every collective, forward and backward, is a step or a field of one, with its
mesh axis and byte count, so `soapstone show` can print all traffic before launch.
"""

from __future__ import annotations

import enum
import functools
import math
import typing
from typing import Literal

import attrs

from soapstone.shard.plan.dtypes import is_float
from soapstone.shard.plan.layout import Layout, Placement, RedistributeKind, nbytes


@attrs.frozen
class Value:
    """A tensor of the program: its dims, layout and this rank's shape."""

    name: str
    dtype: str
    dims: tuple[str, ...]
    layout: Layout
    local_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds."""
        return nbytes(self.dtype, self.local_shape)

    @property
    def is_float(self) -> bool:
        """Whether gradients flow through it."""
        return is_float(self.dtype)


@attrs.frozen
class ParamSpec:
    """A trainable tensor: its global shape, init, layout, and the axes its grad is summed over."""

    name: str
    dtype: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    init: str
    layout: Layout
    local_shape: tuple[int, ...]
    grad_sync: tuple[str, ...] = ()  # mesh axes over which the gradient is a partial sum
    block: str | None = None


@attrs.frozen
class Compute:
    """Run primitive `kind` on local shards. `dist` names the axes whose partial statistics the
    op combines itself (its distributed form); `arg_layouts` lets it find its global offsets;
    `owner` places it on one coordinate of a branch axis (the others skip it)."""

    out: str
    kind: str
    args: tuple[str, ...]
    attrs: tuple[tuple[str, object], ...]
    arg_layouts: tuple[Layout, ...]
    dist: tuple[str, ...] = ()
    source: str = ""  # the IR value this computes, for messages
    owner: tuple[str, int] | None = None  # (axis, coord): only that coordinate computes it
    # axes over which the op moves rows to their owners and back by all-to-all (rules.exchange)
    exchange: tuple[str, ...] = ()

    def attr(self, key: str, default: object = None) -> object:
        """One option of the primitive."""
        return dict(self.attrs).get(key, default)


class GradPlacement(enum.StrEnum):
    """How a gathered value's gradient arrives (Redistribute.grad, allgather only): equal on
    every rank (backward: a local slice) or as a partial sum (backward: a reduce_scatter)."""

    REPLICATE = "replicate"
    PARTIAL = "partial"


@attrs.frozen
class Redistribute:
    """Change `src`'s placement on one axis. kind: allreduce | reduce_scatter | allgather |
    slice | alltoall | broadcast (from a branch's owner) | zero_fill (a branch's value as a
    partial sum: zeros off the owner). `grad` (allgather only): partial when the gathered
    value's gradient arrives as a partial sum (backward reduce_scatter) or replicate
    (backward local slice)."""

    out: str
    src: str
    axis: str
    kind: RedistributeKind = attrs.field(converter=RedistributeKind)
    frm: Placement  # placement before
    to: Placement  # placement after
    nbytes: int  # payload this rank sends into the collective (0 for slice)
    grad: GradPlacement = attrs.field(default=GradPlacement.REPLICATE, converter=GradPlacement)


@attrs.frozen
class CopyTo:
    """Identity forward; backward allreduces the gradient over `axis` (Megatron's `f`)."""

    out: str
    src: str
    axis: str
    nbytes: int


Step = Compute | Redistribute | CopyTo

@attrs.frozen
class InputRole:
    """What a model input holds, so data can be made or checked for it: "ids" (token ids
    below `limit`, an embedding's vocab), "labels" (classes below `limit`) or "float"."""

    name: str
    role: str
    limit: int = 0


@attrs.frozen
class Output:
    """A model output: which value holds it; `is_loss` marks the one training minimises."""

    name: str
    value: str
    is_loss: bool


# the rules that choose a Program's `dropped` values: `recompute selective` and `recompute ops`
DropRule = Literal["selective", "ops"]
DROP_RULES: tuple[DropRule, ...] = typing.get_args(DropRule)


@attrs.frozen(slots=False)  # not slotted, so cached_property can memoise lookups
class Program:
    """Everything a rank needs to run one layout of one model."""

    model: str
    parallel: str | None
    mesh: tuple[tuple[str, int], ...]
    dims: tuple[tuple[str, int], ...]
    inputs: tuple[str, ...]
    params: tuple[ParamSpec, ...]
    values: tuple[Value, ...]
    steps: tuple[Step, ...]
    outputs: tuple[Output, ...]
    # What the runtime would otherwise re-derive, decided once by the compiler:
    batch_dim: str | None = None  # the dim microbatching cuts (the sample-mapped one)
    data_axes: tuple[str, ...] = ()  # the sample axes that split something
    # the axes ZeRO shards over and gradient buckets reduce-scatter over: the sample axes, then
    # the context-parallel ones (an `attribute` axis that splits no parameter: its ranks hold
    # the parameters whole and sum their gradients, as FSDP's data x cp mesh)
    zero_axes: tuple[str, ...] = ()
    zero: int = 0  # the ZeRO stage the spec asks for
    roles: tuple[InputRole, ...] = ()  # one per input
    # `recompute R`: [start, stop) step ranges, one per block of repeat R, each run so that
    # backward keeps only the values it reads from before it and runs its forward again
    recompute: tuple[tuple[int, int], ...] = ()
    # `recompute selective`: values forward frees after their last use and backward computes
    # again from their producer's inputs (shard/parallel/selective_plan.py decides which)
    dropped: tuple[str, ...] = ()
    # `recompute ops`: values no kernel keeps that backward's rebuilds read, held until then
    # (shard/parallel/op_policy_plan.py); and which rule chose `dropped` (selective, ops)
    held: tuple[str, ...] = ()
    drop_rule: DropRule | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(DROP_RULES)))
    # sequence parallelism: gathered linear inputs forward frees after their last use, keeping
    # the shard, and backward gathers again (shard/parallel/regather_plan.py decides which)
    regathered: tuple[str, ...] = ()
    # `offload optimizer`: the optimizer keeps its state in host memory on a GPU run
    offload: bool = False
    # `overlap tensor`: the gathers and reduce-scatters that shard/parallel/ring_plan.py finds
    # run as collective matmuls (rings of async p2p steps overlapped with their matmuls)
    overlap_tensor: bool = False
    # `attribute seq -> cp balanced`: the dims (a sequence and its renames) whose split holds
    # zigzag chunks (shard/plan/balanced.py), never one contiguous slice
    balanced: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """Ranks this program needs."""
        return math.prod(size for _, size in self.mesh)

    def value(self, name: str) -> Value:
        """Look up a value by name."""
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    @functools.cached_property
    def weights(self) -> frozenset[str]:
        """The parameters and the values that gather or copy one (a weight's local form where a
        step reads it): what makes a matmul a weight matmul."""
        out = {p.name for p in self.params}
        for step in self.steps:
            if not isinstance(step, Compute) and step.src in out:
                out.add(step.out)
        return frozenset(out)

    def param(self, name: str) -> ParamSpec:
        """Look up a parameter by name."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)  # a lookup (callers catch it), never user input

    @property
    def loss(self) -> Output | None:
        """The output training minimises, if any."""
        return next((o for o in self.outputs if o.is_loss), None)
