"""Named-dim layouts: for each mesh axis a tensor is split along one dim, partial, or replicated.

One dim may be split over several axes (sequence parallelism inside context parallelism: the
sequence over cp, then over the tensor axis within each cp piece). The pieces nest in mesh-axis
order: the first axis cuts the dim, the next cuts each of those pieces, so undoing the
innermost split (a gather over it) leaves the outer split as it was.

The same algebra as OneFlow SBP, GSPMD and DTensor placements, keyed by dim *names* as in
Mesh-TensorFlow. An axis absent from a layout is replicated. Pure Python: the compiler and
`soapstone show` use it without torch.
"""

from __future__ import annotations

import enum

import attrs

from soapstone.shard.plan.dtypes import DTYPE_BYTES


@attrs.frozen
class Replicate:
    """Every rank of the axis holds the same full tensor."""

    def __str__(self) -> str:
        return "replicate"


@attrs.frozen
class Partial:
    """Each rank of the axis holds one term of a pending sum."""

    def __str__(self) -> str:
        return "partial"


@attrs.frozen
class Split:
    """The tensor is cut into equal pieces along `dim`, one per rank of the axis."""

    dim: str

    def __str__(self) -> str:
        return self.dim


@attrs.frozen
class Owned:
    """Only coordinate `coord` of the axis computes the tensor (a branch placed there by an
    `operator` statement); the other ranks hold a zero placeholder."""

    coord: int

    def __str__(self) -> str:
        return f"owned:{self.coord}"


# Typed, never strings: a dim may be called anything, "P" and "R" included.
Placement = Replicate | Partial | Split | Owned
R = Replicate()
P = Partial()


def placement_to_data(p: Placement) -> dict:
    """A placement as JSON-ready data: {"kind": "split", "dim": d}, {"kind": "partial"}, ..."""
    kind = {Replicate: "replicate", Partial: "partial", Split: "split", Owned: "owned"}[type(p)]
    return {"kind": kind, **attrs.asdict(p)}


def token(p: Placement) -> str:
    """A placement in a value's name (`x@model:P`): short, and stable for golden files."""
    return {Replicate: "R", Partial: "P"}.get(type(p)) or (
        p.dim if isinstance(p, Split) else f"@{p.coord}")


@attrs.frozen
class Layout:
    """Placement per mesh axis; an axis absent from `placements` is replicated."""

    placements: tuple[tuple[str, Placement], ...] = ()  # (axis, placement), in mesh-axis order

    @staticmethod
    def of(mesh_axes: tuple[str, ...], mapping: dict[str, Placement]) -> Layout:
        """Build a layout from {axis: placement}, dropping replicated axes."""
        return Layout(tuple((a, mapping[a]) for a in mesh_axes if mapping.get(a, R) != R))

    def get(self, axis: str) -> Placement:
        """The placement on one axis."""
        return dict(self.placements).get(axis, R)

    def with_(self, mesh_axes: tuple[str, ...], axis: str, placement: Placement) -> Layout:
        """This layout with one axis changed."""
        mapping = dict(self.placements)
        mapping[axis] = placement
        return Layout.of(mesh_axes, mapping)

    def split_axis(self, dim: str) -> str | None:
        """The (outermost) axis `dim` is split over, if any."""
        for axis, p in self.placements:
            if p == Split(dim):
                return axis
        return None

    def dim_axes(self, dim: str) -> tuple[str, ...]:
        """Every axis `dim` is split over, outermost first (the module doc's nesting)."""
        return tuple(a for a, p in self.placements if p == Split(dim))

    def split_axes(self) -> tuple[str, ...]:
        """The axes over which the tensor is cut into pieces."""
        return tuple(a for a, p in self.placements if isinstance(p, Split))

    def cuts_inside(self, mesh_axes: tuple[str, ...], axis: str, placement: Placement) -> int:
        """How many axes after `axis` (in mesh order) also cut the dim `placement` splits (0:
        its cut on `axis` is, or would be, the innermost; only such a cut may change)."""
        if not isinstance(placement, Split):
            return 0
        later = mesh_axes[mesh_axes.index(axis) + 1:]
        return sum(a in later for a in self.dim_axes(placement.dim))

    def local_sizes(self, dims: tuple[str, ...], sizes: dict[str, int],
                    mesh: dict[str, int]) -> tuple[int, ...]:
        """The per-rank shape of a tensor with these dims under this layout."""
        out = []
        for d in dims:
            n = sizes[d]
            for axis in self.dim_axes(d):
                n //= mesh[axis]
            out.append(n)
        return tuple(out)

    def piece(self, dim: str, coord: dict[str, int], mesh: dict[str, int]) -> int:
        """Which of the dim's equal pieces the rank at `coord` holds (0 where it is whole):
        the coordinates over its axes read as one number, outermost first."""
        index = 0
        for axis in self.dim_axes(dim):
            index = index * mesh[axis] + coord[axis]
        return index

    def __str__(self) -> str:
        if not self.placements:
            return "replicate"
        return ", ".join(f"{p}@{a}" for a, p in self.placements)


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a dense tensor."""
    n = DTYPE_BYTES[dtype]
    for s in shape:
        n *= s
    return n


class RedistributeKind(enum.StrEnum):
    """What turns one placement into another on one axis (a Redistribute step's kind; what
    each moves forward and backward: shard/plan/collectives.py's table). Its str is its name
    as `show` prints it."""

    ALLREDUCE = "allreduce"  # P -> R
    REDUCE_SCATTER = "reduce_scatter"  # P -> S
    ALLGATHER = "allgather"  # S -> R
    SLICE = "slice"  # R -> S (local, free)
    ALLTOALL = "alltoall"  # S(a) -> S(b)
    BROADCAST = "broadcast"  # owned -> R
    ZERO_FILL = "zero_fill"  # owned -> P (free)
    # R -> P and S -> P are never needed: partials only arise from contractions (and
    # branches), so transition refuses them (lowering's cost: infinite)
    INVALID = "invalid"


# What turning one placement into another on one axis costs, in the collective that does it.
def transition(src: Placement, dst: Placement) -> RedistributeKind | None:
    """The collective that turns placement `src` into `dst` on one axis (None: nothing to do)."""
    K = RedistributeKind
    if src == dst:
        return None
    if isinstance(src, Owned):  # the owner's value as a partial sum (zeros elsewhere) or R
        return {P: K.ZERO_FILL, R: K.BROADCAST}.get(dst, K.INVALID)
    if isinstance(dst, Owned):
        return K.INVALID
    if src == P:
        return K.ALLREDUCE if dst == R else K.REDUCE_SCATTER
    if src == R:
        return K.SLICE if dst != P else K.INVALID
    return K.ALLGATHER if dst == R else (K.ALLTOALL if dst != P else K.INVALID)
