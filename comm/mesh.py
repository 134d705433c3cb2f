"""Mesh: named axes over the world communicator, row-major (the last axis varies fastest)."""

from __future__ import annotations

from .communicator import CommError, Communicator


class Mesh:
    """`Mesh(world, pipe=2, data=2, model=2)`: rank r sits at the row-major coordinates of r.

    `comm(*axes)` is the sub-communicator of the ranks that differ only along `axes`, its ranks
    ordered row-major over those axes (in mesh order). The one-axis communicators are created
    eagerly (every rank takes part, so no rank can hang waiting for one that asks for another
    axis); multi-axis ones on first use, which is collective over the world: all ranks must ask
    for the same ones in the same order.
    """

    def __init__(self, world: Communicator, **shape: int):
        if not shape:
            raise CommError("Mesh: give at least one axis, e.g. Mesh(world, data=2)")
        for name, n in shape.items():
            if not isinstance(n, int) or n < 1:
                raise CommError(f"Mesh: axis {name}={n!r} must be a positive int")
        total = 1
        for n in shape.values():
            total *= n
        if total != world.size:
            dims = " x ".join(f"{k}={v}" for k, v in shape.items())
            raise CommError(
                f"Mesh: {dims} needs {total} ranks, but the world has {world.size}; "
                f"make the axis sizes multiply to {world.size}"
            )
        self.world = world
        self.shape = dict(shape)
        self.axes = tuple(shape)
        self.rank = world.rank
        self._coords = self.coords_of(world.rank)
        self._comms: dict[tuple[str, ...], Communicator] = {}
        for axis in self.axes:
            self.comm(axis)

    def size(self, axis: str) -> int:
        """Number of ranks along `axis`."""
        return self.shape[self._axis(axis)]

    def coord(self, axis: str) -> int:
        """This rank's index along `axis`."""
        return self._coords[self.axes.index(self._axis(axis))]

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinates of world rank `rank`."""
        out = []
        for n in reversed(self.shape.values()):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank_of(self, **coords: int) -> int:
        """World rank at the given coordinates (unnamed axes: this rank's coordinate)."""
        r = 0
        for axis, n in self.shape.items():
            c = coords.get(axis, self.coord(axis))
            if not 0 <= c < n:
                raise CommError(f"Mesh.rank_of: {axis}={c} is outside [0, {n - 1}]")
            r = r * n + c
        return r

    def comm(self, *axes: str) -> Communicator:
        """The cached sub-communicator over `axes` (collective on first use)."""
        if not axes:
            raise CommError("Mesh.comm: name at least one axis, e.g. mesh.comm('data')")
        key = tuple(a for a in self.axes if a in {self._axis(x) for x in axes})
        found = self._comms.get(key)
        if found is None:
            color = key_ = 0
            for axis, c in zip(self.axes, self._coords, strict=True):
                if axis in key:
                    key_ = key_ * self.shape[axis] + c
                else:
                    color = color * self.shape[axis] + c
            found = self._comms[key] = self.world.split(color, key_)
        return found

    def _axis(self, axis: str) -> str:
        if axis not in self.shape:
            raise CommError(f"Mesh: no axis {axis!r}; the axes are {', '.join(self.axes)}")
        return axis

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"Mesh({dims}; rank {self.rank} at {self._coords})"
