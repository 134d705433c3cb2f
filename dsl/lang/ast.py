"""The syntax tree of a .par file, as the parser builds it (before any name is resolved).

Every node carries `loc` (an `ir.Loc`). Expressions: Name, Num, Str, BinOp, Neg, Call, Map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from soapstone.dsl.model.ir import Loc


@dataclass(slots=True)
class Name:
    id: str
    loc: Loc


@dataclass(slots=True)
class Num:
    value: int | float
    loc: Loc


@dataclass(slots=True)
class Str:
    value: str
    loc: Loc


@dataclass(slots=True)
class BinOp:
    op: str  # + - * /
    left: object
    right: object
    loc: Loc


@dataclass(slots=True)
class Neg:
    operand: object
    loc: Loc


@dataclass(slots=True)
class Map:
    """`a -> b` inside a call: linear(x, hidden -> vocab)."""

    src: object
    dst: object
    loc: Loc


@dataclass(slots=True)
class Kwarg:
    name: str
    value: object
    loc: Loc


@dataclass(slots=True)
class Call:
    func: str
    args: list  # expressions and Kwarg, in source order
    loc: Loc  # the whole call
    func_loc: Loc  # the layer name only


@dataclass(slots=True)
class DimDecl:
    name: str
    expr: object
    loc: Loc


@dataclass(slots=True)
class InputDecl:
    name: str
    dtype: str
    dtype_loc: Loc
    dims: list  # [(name, loc)]
    loc: Loc


@dataclass(slots=True)
class Assign:
    target: str
    expr: object
    loc: Loc  # the target name


@dataclass(slots=True)
class Repeat:
    count: object
    name: str
    body: list
    loc: Loc  # the instance name


@dataclass(slots=True)
class OutputStmt:
    name: str
    expr: object | None
    mark: str | None  # the word after `as` (must be `loss`)
    loc: Loc
    mark_loc: Loc | None = None


@dataclass(slots=True)
class Tie:
    """`tie a.weight = b.table`: param `name` is param `target` (one storage)."""

    name: str
    target: str
    loc: Loc  # the tied (left) name
    target_loc: Loc


@dataclass(slots=True)
class ModelDef:
    name: str
    body: list
    loc: Loc
    file: str = ""


@dataclass(slots=True)
class Soap:
    kind: str  # sample | attribute | parameter
    groups: list  # [([(dim, loc)], axis, axis_loc)]
    loc: Loc
    balanced: list = field(default_factory=list)  # [([(dim, loc)], axis, keyword loc)]


@dataclass(slots=True)
class StageDef:
    repeat: str
    lo: int
    hi: int
    axis: str
    stage: int
    loc: Loc  # the repeat name
    range_loc: Loc
    axis_loc: Loc
    stage_loc: Loc


@dataclass(slots=True)
class BranchDef:
    value: str
    axis: str
    coord: int
    loc: Loc  # the value name
    axis_loc: Loc
    coord_loc: Loc


@dataclass(slots=True)
class Operator:
    KEYWORD = "operator"  # a once-only statement: its keyword names it in messages

    stages: list  # StageDef and BranchDef
    loc: Loc


@dataclass(slots=True)
class ScheduleStmt:
    KEYWORD = "schedule"

    kind: str
    kind_loc: Loc
    options: list  # [(key, value, loc)]
    loc: Loc


@dataclass(slots=True)
class Zero:
    KEYWORD = "zero"

    level: int
    loc: Loc


@dataclass(slots=True)
class Recompute:
    KEYWORD = "recompute"

    repeat: str  # the repeat whose blocks run their forward again in backward, or `selective`
    loc: Loc


@dataclass(slots=True)
class Offload:
    KEYWORD = "offload"

    what: str  # what moves to host memory: `optimizer`
    loc: Loc


@dataclass(slots=True)
class Overlap:
    KEYWORD = "overlap"

    what: str  # whose collectives run overlapped with their matmuls: `tensor`
    loc: Loc


@dataclass(slots=True)
class ParallelDef:
    name: str
    model: str
    model_loc: Loc
    mesh: list  # [(axis, size, loc)]
    body: list
    loc: Loc
    file: str = ""


@dataclass(slots=True)
class Include:
    path: str
    loc: Loc


@dataclass(slots=True)
class File:
    path: str
    items: list = field(default_factory=list)
