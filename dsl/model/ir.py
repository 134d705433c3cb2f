"""The named-dim IR: a checked model and its parallel blocks as plain, printable data.

The front end (parser + layer registry) produces it; the compiler (layouts, lowering) consumes
it. Every tensor dim is a *name* declared in `Model.dims`. Layers are expanded into the small set
of primitive ops listed in `PRIMITIVES` (their records: shard/ops/, which say how each shards).

No torch here: `soapstone check` must answer without importing it.
"""

from __future__ import annotations

import math

import attrs
from attrs import field as _field  # Op has a field named `attrs`, shadowing the module

from soapstone.shard.ops import registry

# A model output is the program's output: one class from spec to runtime (dsl may use shard).
from soapstone.shard.plan.program import Output


@attrs.frozen
class Loc:
    """A span in a spec file (1-based line and column)."""

    file: str
    line: int
    col: int
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@attrs.frozen
class TensorType:
    """A dtype ("f32", "i64", ...) and the names of the dims, outermost first."""

    dtype: str
    dims: tuple[str, ...]


@attrs.frozen
class Input:
    """A model input fed by the data pipeline (tokens, targets, features)."""

    name: str
    type: TensorType
    loc: Loc | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Param:
    """A trainable tensor. `name` is qualified ("layer.2.attn.wq"); `block` is the repeat
    instance owning it ("layer.2") or None for params outside any repeat.

    `init` is one of "normal(STD)", "zeros", "ones", "uniform(BOUND)". The full tensor is always
    drawn from a generator seeded by (run seed, name), so any layout slices the same numbers."""

    name: str
    type: TensorType
    init: str
    block: str | None = None
    tied_to: str | None = None  # another param's name: the same storage (tied embeddings)
    loc: Loc | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Op:
    """One primitive op. `args` name values: inputs, params, or earlier op outputs (in order).
    `attrs` holds the primitive's options as sorted (key, value) pairs (hashable). A custom
    layer's op also says how its bound dims may split: `shard`, sorted (dim, "split" |
    "partial") pairs, so the compiler needs no layer registry."""

    kind: str
    args: tuple[str, ...]
    out: str
    type: TensorType
    attrs: tuple[tuple[str, object], ...] = ()
    block: str | None = None
    layer: str = ""  # the spec-level layer this op came from ("attention", "mlp", ...)
    loc: Loc | None = _field(default=None, eq=False)
    shard: tuple[tuple[str, str], ...] = ()

    def attr(self, key: str, default: object = None) -> object:
        """The value of one option, or `default`."""
        return dict(self.attrs).get(key, default)


@attrs.frozen
class Model:
    """A model after name resolution, layer expansion and shape inference."""

    name: str
    dims: tuple[tuple[str, int], ...]  # every dim, including derived ones (head_dim, seq_k)
    inputs: tuple[Input, ...]
    params: tuple[Param, ...]
    ops: tuple[Op, ...]  # topologically ordered
    outputs: tuple[Output, ...]
    blocks: tuple[str, ...]  # repeat instances in program order: ("layer.0", "layer.1", ...)
    dim_alias: tuple[tuple[str, str], ...] = ()  # derived dim -> the dim it renames (seq_k->seq)
    loc: Loc | None = attrs.field(default=None, eq=False)

    def size(self, dim: str) -> int:
        """The size of a named dim."""
        return dict(self.dims)[dim]

    def renames_of(self, dim: str) -> tuple[str, ...]:
        """`dim` and the derived dims that rename it (seq, seq_k): one sequence."""
        return (dim, *(d for d, base in self.dim_alias if base == dim))

    def causal_over(self, dim: str) -> bool:
        """Whether a causal mask's query dim is `dim` or a rename of it."""
        names = self.renames_of(dim)
        return any(op.kind == "causal_mask" and op.attr("query") in names for op in self.ops)


@attrs.frozen
class StageAssignment:
    """`operator layer[0..1] -> pipe 0`: blocks (by instance name) placed on one stage."""

    blocks: tuple[str, ...]
    axis: str
    stage: int
    loc: Loc | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Branch:
    """`operator a -> branch 0`: the ops that compute value `a` and nothing else run only on
    coordinate `coord` of mesh axis `axis`."""

    value: str
    axis: str
    coord: int
    loc: Loc | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Schedule:
    """Pipeline schedule: kind names one of shard/plan/schedules/registry.py."""

    kind: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1


# `recompute selective`: the argument that names no repeat but the rule of
# shard/parallel/selective_plan.py (the cheap ops' outputs are dropped and recomputed)
SELECTIVE = "selective"
# `recompute ops`: torchtitan's op policy (shard/parallel/op_policy_plan.py): in each repeat
# block every other weight matmul's output and attention's are held, the rest rebuilt
OPS = "ops"


@attrs.frozen
class Parallel:
    """A checked parallel block: mesh axes and which dims each SOAP statement maps to them."""

    name: str
    model: str
    mesh: tuple[tuple[str, int], ...]  # (axis, size), row-major order
    sample: tuple[tuple[str, str], ...] = ()  # (dim, axis)
    attribute: tuple[tuple[str, str], ...] = ()
    parameter: tuple[tuple[str, str], ...] = ()
    operator: tuple[StageAssignment, ...] = ()
    schedule: Schedule = Schedule()
    zero: int = 0
    loc: Loc | None = attrs.field(default=None, eq=False)
    branches: tuple[Branch, ...] = ()
    # a `schedule` statement was written: show prints it even where it is the default (which
    # runs exactly as no statement, so two blocks that differ only here are equal)
    schedule_written: bool = attrs.field(default=False, eq=False)
    # `recompute R`: the blocks of repeat R keep only their inputs for backward;
    # `recompute selective` (SELECTIVE): only the cheap ops' outputs are dropped;
    # `recompute ops` (OPS): torchtitan's op policy
    recompute: str | None = None
    # `offload optimizer`: master weights and optimizer state in host memory
    offload: str | None = None
    # `overlap tensor`: sequence parallelism's gathers and reduce-scatters as collective matmuls
    overlap: str | None = None
    # `attribute seq -> cp balanced`: the dims split in zigzag order (load-balanced causal CP)
    balanced: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """How many ranks this layout needs (`mpiexec -n`)."""
        return math.prod(size for _, size in self.mesh)


# The primitive ops layers expand into, with their arguments and options: each is one record
# of shard/ops/ (its sharding rule, statistics, costs and kernel beside its doc), keyed by
# these names; a custom layer registered from Python becomes kind "custom:<name>".
PRIMITIVES: dict[str, str] = registry.docs()
