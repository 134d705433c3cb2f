"""Boxes: rectangular regions of a global tensor, the unit a checkpoint reads and writes.

A box is (offset, shape) per dim. A rank's tensor-parallel shard is one box; a ZeRO shard is a
contiguous flat range of that box (row-major), which `flat_boxes` cuts into at most
2*ndim - 1 boxes, so both save and load speak boxes only. Pure Python (no torch).
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class Box:
    """A region of a global tensor: `shape` elements per dim starting at `offset`."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when they do not overlap."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in
                   zip(self.offset, self.shape, other.offset, other.shape, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of `outer`'s own (local) tensor."""
        return tuple(slice(a - b, a - b + n)
                     for a, b, n in zip(self.offset, outer.offset, self.shape, strict=True))

    def to_data(self) -> dict:
        """JSON-ready: {"offset": [...], "shape": [...]}."""
        return {"offset": list(self.offset), "shape": list(self.shape)}


def flat_boxes(box: Box, start: int, stop: int) -> list[Box]:
    """The elements start..stop-1 of `box` in row-major order, as boxes in that order."""
    if start >= stop:
        return []
    if not box.shape:
        return [box]
    inner = math.prod(box.shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = Box(box.offset[1:], box.shape[1:])

    def row(r: int, a: int, b: int) -> list[Box]:
        return [Box((box.offset[0] + r, *s.offset), (1, *s.shape))
                for s in flat_boxes(rest, a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(Box((box.offset[0] + r0, *box.offset[1:]), (r1 - r0, *box.shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out
