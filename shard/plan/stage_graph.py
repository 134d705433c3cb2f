"""The stage graph: a layout as printable data (no torch, no grammar).

Every layout is a stage graph: one without an `operator` statement is one stage on the whole
mesh (`axis` None), whose microbatches, if any, are gradient accumulation. A pipeline layout
cuts a model into *virtual stages* at repeat-block boundaries. Virtual stage `v` runs on pipe
rank `stage.rank`, the schedule's placement (v itself without interleaving; v mod P with it,
`chunks` virtual stages per rank; in a V, zbv and dualpipev, rank r holds v = r and
v = 2P-1-r, and the edge between stages P-1 and P joins two stages of one rank: handed over in
memory, src_rank == dst_rank). Each virtual stage is an ordinary `Program`, compiled for one
microbatch under the layout's other axes (data, model, ...), so tensor, sequence and data
parallelism inside a stage are the single-program compiler's business.

Edges join consecutive virtual stages only: a value made in stage s and used in stage t > s+1
is relayed (it is an output of every stage in between, passed through untouched), so every
rank talks only to its two pipe neighbours. Each edge lists the tensors crossing it with
their dtype, local shape and layout, all known at compile time: the receiver allocates from
them and the sender checks its actual output against them before sending.

Parameters used by more than one virtual stage (tied embeddings) are `shared`: every stage
using one holds a copy, and their gradients are summed over the pipe axis each step.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.plan.program import Program, Value


@attrs.frozen
class Edge:
    """Virtual stage `src` sends `tensors` to `dst = src + 1` (pipe ranks src_rank -> dst_rank)."""

    src: int
    dst: int
    src_rank: int
    dst_rank: int
    tensors: tuple[Value, ...]  # the program values crossing (the same on both sides)

    @property
    def nbytes(self) -> int:
        """Activation bytes per microbatch per sending rank."""
        return sum(t.nbytes for t in self.tensors)


@attrs.frozen
class Stage:
    """One virtual stage: its blocks, the pipe rank running it, and its compiled Program.

    `data_inputs` are model inputs the stage reads from the batch itself (tokens on the first
    stage, targets on the last); `recv`/`send` name the boundary tensors of its edges."""

    index: int
    rank: int
    chunk: int
    blocks: tuple[str, ...]
    program: Program
    data_inputs: tuple[str, ...]
    recv: tuple[str, ...]
    send: tuple[str, ...]

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the loss."""
        return self.program.loss is not None


@attrs.frozen
class StageGraph:
    """Everything the pipeline executor and `soapstone show` need for one pipeline layout."""

    model: str
    parallel: str | None  # None: the model on one rank
    mesh: tuple[tuple[str, int], ...]  # the full mesh, pipe axis included
    axis: str | None  # the pipe axis (None: one stage, no pipeline)
    stages: tuple[Stage, ...]  # virtual stages in model order
    edges: tuple[Edge, ...]
    schedule: str  # a name of shard/plan/schedules/registry.py
    microbatches: int
    chunks: int
    batch_dim: str | None  # the dim microbatching cuts (None: no batched input)
    batch: int  # its global size
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # param -> virtual stages using it
    # the model's inputs no stage reads (declared, never used): a batch may carry them
    unread: tuple[str, ...] = ()

    @property
    def pipe(self) -> int:
        """Number of pipe ranks."""
        return dict(self.mesh)[self.axis] if self.axis is not None else 1

    @property
    def program(self) -> Program:
        """The one stage's Program of a layout without a pipeline."""
        if len(self.stages) != 1:
            # not user input: only code that knows the layout has one stage asks
            raise ValueError(f"layout {self.parallel} has {len(self.stages)} stages, not one")
        return self.stages[0].program

    @property
    def world_size(self) -> int:
        """Ranks the whole layout needs."""
        return math.prod(size for _, size in self.mesh)

    @property
    def microbatch(self) -> int:
        """Global size of the batch dim in one microbatch."""
        return self.batch // self.microbatches

    def stages_of(self, rank: int) -> tuple[Stage, ...]:
        """The virtual stages pipe rank `rank` runs, in chunk order."""
        return tuple(s for s in self.stages if s.rank == rank)

    def deferred(self, stage: Stage) -> tuple[str, ...]:
        """The stage's parameters tied across stages (a gradient bucket each, reduced last)."""
        mine = {p.name for p in stage.program.params}
        return tuple(n for n, _ in self.shared if n in mine)
