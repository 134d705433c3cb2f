"""A batch's integer inputs checked against the range the model indexes with them.

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
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute


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
