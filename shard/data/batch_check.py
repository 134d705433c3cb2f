"""A batch checked before it is cut into microbatches: its keys, types, dtypes and shapes
(`check_batch`), and its integer inputs against the range the model indexes with them.

Every rank holds the same full batch, so every rank refuses a bad one alike, before any
collective: a missing input would be a KeyError on the ranks whose stage reads it while the
others wait for them, an extra one would be silently ignored (a misspelt name among them),
float ids and int32 targets are torch's errors deep in a kernel, and a numpy array or a list
an AttributeError.

An embedding's ids index its table's rows and a cross-entropy's targets its classes. On one
rank a value outside that range is torch's IndexError deep in a kernel; under a split vocab
each shard masks the ids outside its own rows, so it would train silently on zero rows. The
executor checks every full batch before it is cut into microbatches instead: every rank holds
the same full batch, so every rank raises the same DataError together.
"""

from __future__ import annotations

import attrs
import torch

from soapstone.shard.data.errors import DataError
from soapstone.shard.plan.dtypes import DTYPES
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.plan.stage_graph import StageGraph


@attrs.frozen
class IndexRange:
    """An input whose values must lie in 0..limit-1: what they index, for the message."""

    name: str
    limit: int
    what: str


def index_ranges(programs: list[Program]) -> dict[str, IndexRange]:
    """Input name -> its IndexRange, for the inputs the programs' embeddings index their
    tables with and their cross-entropies take as targets (the first such use decides)."""
    out: dict[str, IndexRange] = {}
    for p in programs:
        # a redistributed input (`tokens@model:R`) is read by its op under another name
        src = {s.out: s.src for s in p.steps if isinstance(s, (Redistribute, CopyTo))}
        sizes = dict(p.dims)
        for s in p.steps:
            if not isinstance(s, Compute) or s.kind not in ("embedding", "cross_entropy"):
                continue
            if s.kind == "embedding":
                arg, limit = s.args[0], sizes[str(s.attr("vocab"))]
                what = f"the rows of {s.args[1]}"
            else:
                real = s.attr("classes")  # a padded class dim: only the real classes count
                arg = s.args[1]
                limit = int(real) if real is not None else sizes[str(s.attr("over"))]
                what = f"the {s.attr('over')} classes of the cross-entropy"
            while arg in src:
                arg = src[arg]
            if arg in p.inputs:
                out.setdefault(arg, IndexRange(arg, limit, what))
    return out


def check_ranges(ranges: dict[str, IndexRange], batch: dict[str, torch.Tensor]) -> None:
    """DataError naming the input, the first value outside its range, where, and the range."""
    for name, r in ranges.items():
        t = batch.get(name)
        if t is None or t.numel() == 0 or t.is_floating_point():
            continue
        bad = (t < 0) | (t >= r.limit)
        if not bool(bad.any()):
            continue
        at = tuple(int(i) for i in bad.nonzero()[0])
        value = int(t[at])
        raise DataError(f"input {name}: value {value} at {list(at)} is outside the valid range "
                        f"0..{r.limit - 1} ({r.what}: {r.limit})")


def check_batch(graph: StageGraph, batch, what: str = "batch") -> None:
    """DataError unless `batch` is a dict holding the data inputs of `graph`'s stages (and
    none but the model's inputs), each a torch.Tensor of its declared kind (an integer input
    any integer dtype, a float input any float dtype) and full global shape; the message
    names the input."""
    if not isinstance(batch, dict):
        raise DataError(f"{what} is of type {type(batch).__name__}; pass a dict of input name -> "
                        "torch.Tensor (the full global batch)")
    values = {n: s.program.value(n) for s in graph.stages for n in s.data_inputs}
    sizes = {d: n for s in graph.stages for d, n in s.program.dims}
    declared = [*values, *graph.unread]  # an input declared and never read may come along
    missing = [n for n in values if n not in batch]
    extra = sorted(str(k) for k in batch if k not in declared)
    if missing or extra:
        said = [f"missing {', '.join(missing)}"] if missing else []
        said += [f"no input named {', '.join(extra)}"] if extra else []
        raise DataError(f"{what}: {'; '.join(said)}; the model's inputs are "
                        f"{', '.join(declared)}")
    for name, v in values.items():
        t = batch[name]
        # the batch dim is cut into microbatches: each stage's Program holds one of them
        want = [graph.batch if d == graph.batch_dim else sizes[d] for d in v.dims]
        shape = ", ".join(f"{d}={n}" for d, n in zip(v.dims, want, strict=True))
        if not isinstance(t, torch.Tensor):
            raise DataError(f"{what}: input {name} is of type {type(t).__name__}; pass a "
                            f"torch.Tensor of {v.dtype}[{shape}] (torch.as_tensor(...))")
        # an integer input of any width is taken (the executor indexes with int64), a float
        # input in any float dtype (cast to the model's)
        integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        if not (t.is_floating_point() if v.is_float else integer):
            dtype = getattr(torch, DTYPES[v.dtype].torch_name)
            raise DataError(f"{what}: input {name} is {t.dtype}, the spec declares {v.dtype}; "
                            f"pass it as {dtype} (`.to({dtype})`)")
        if list(t.shape) != want:
            raise DataError(f"{what}: input {name} has shape {list(t.shape)}, the layout "
                            f"takes the full global batch [{shape}]")
