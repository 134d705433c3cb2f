"""What checking one parallel block reads and builds: the block and its model
(`Ctx`, never changed) and what its statements establish (`Facts`), shared by the
statement readers and the rules across statements (parallel_checker.py, schedule_rules.py).
Pure Python; never imports torch."""

from __future__ import annotations

import attrs

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import Diagnostic
from soapstone.dsl.lang.parser import Sources
from soapstone.dsl.model.ir import Branch, Loc, Model, StageAssignment

Diags = list[Diagnostic]


@attrs.frozen
class Ctx:
    """The block being checked and its model: what every rule reads, never changes."""

    p: ast.ParallelDef
    model: Model
    sources: Sources
    dims: dict[str, int]
    batch: str | None  # the inputs' leading dim: what `sample` maps

    @classmethod
    def of(cls, p: ast.ParallelDef, model: Model, sources: Sources) -> Ctx:
        """The context of one parallel block."""
        first = model.inputs[0].type.dims if model.inputs else ()
        return cls(p, model, sources, dict(model.dims), first[0] if first else None)

    def diag(self, loc: Loc | None, message: str, hint: str | None = None) -> Diagnostic:
        """A diagnostic at `loc`, in this block's file."""
        return self.sources.diag(loc, message, hint, self.p.file)


@attrs.define
class Facts:
    """What the statements read so far establish; the rules across statements read it."""

    mesh: dict[str, int]  # the well-formed axes
    mapped: dict[str, tuple[str, str]] = attrs.Factory(dict)  # dim -> (statement kind, axis)
    map_loc: dict[str, Loc] = attrs.Factory(dict)  # dim -> where it is mapped
    soap: dict[str, list[tuple[str, str]]] = attrs.Factory(
        lambda: {"sample": [], "attribute": [], "parameter": []})
    failed: set[str] = attrs.Factory(set)  # statement kinds with a mapping rejected
    used: dict[str, str] = attrs.Factory(dict)  # axis -> what uses it
    seen: dict[str, Loc] = attrs.Factory(dict)  # once-only statement keyword -> where
    stages: list[StageAssignment] = attrs.Factory(list)
    pipe_axis: str | None = None
    has_stages: bool = False
    stage_seq: list[int] = attrs.Factory(list)  # each block's stage, when every block has one
    stage_locs: list[Loc] = attrs.Factory(list)
    branches: list[Branch] = attrs.Factory(list)
    schedule: ast.ScheduleStmt | None = None
    zero: int = 0
    recompute: str | None = None
    offload: str | None = None
    overlap: str | None = None
    balanced: list[str] = attrs.Factory(list)  # dims split in zigzag order
