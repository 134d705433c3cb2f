"""Mesh: named axes over the world communicator, row-major (the last axis varies fastest)."""

from __future__ import annotations

import itertools
import math

from soapstone.comm.communicator import Communicator
from soapstone.comm.errors import CommError


class Mesh:
    """`Mesh(world, pipe=2, data=2, model=2)`: rank r sits at the row-major coordinates of r.

    `comm(*axes)` is the sub-communicator of the ranks that differ only along `axes`, its ranks
    ordered row-major over those axes (in mesh order). The constructor creates the
    communicator of every non-empty subset of the axes (2^k - 1 splits of the world, in one
    fixed order on every rank), so `comm()` is a lookup that never communicates: ranks may ask
    for different communicators in different orders (pipeline stages do) without a hang. Each
    subset gets its own communicator even where two subsets hold the same ranks (size-1 axes),
    so their messages never mix and their byte counters stay apart.

    `free()` (or `with Mesh(...) as mesh:`) releases them; every rank should free its mesh.
    """

    def __init__(self, world: Communicator, **shape: int):
        if not shape:
            raise CommError("Mesh: give at least one axis, e.g. Mesh(world, data=2)")
        for name, n in shape.items():
            if not isinstance(n, int) or n < 1:
                raise CommError(f"Mesh: axis {name}={n!r} must be a positive int")
        total = math.prod(shape.values())
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
        self._freed = False
        for k in range(1, len(self.axes) + 1):
            for key in itertools.combinations(self.axes, k):  # mesh order: same on all ranks
                self._comms[key] = self._split(key)

    def size(self, axis: str) -> int:
        """Number of ranks along `axis`."""
        return self.shape[self._axis(axis)]

    def coord(self, axis: str) -> int:
        """This rank's index along `axis`."""
        return self._coords[self.axes.index(self._axis(axis))]

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinates of world rank `rank`."""
        if not isinstance(rank, int) or not 0 <= rank < self.world.size:
            raise CommError(f"Mesh.coords_of: rank {rank!r} is not a world rank; "
                            f"pass an int in [0, {self.world.size - 1}]")
        out = []
        for n in reversed(self.shape.values()):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank_of(self, **coords: int) -> int:
        """World rank at the given coordinates (unnamed axes: this rank's coordinate)."""
        for axis in coords:  # a misspelt axis would otherwise be this rank's coordinate
            self._axis(axis)
        r = 0
        for axis, n in self.shape.items():
            c = coords.get(axis, self.coord(axis))
            if not isinstance(c, int) or not 0 <= c < n:
                raise CommError(f"Mesh.rank_of: {axis}={c!r} is not a coordinate; "
                                f"pass an int in [0, {n - 1}]")
            r = r * n + c
        return r

    def comm(self, *axes: str) -> Communicator:
        """The sub-communicator over `axes` (created in the constructor; no communication)."""
        if not axes:
            raise CommError("Mesh.comm: name at least one axis, e.g. mesh.comm('data')")
        if self._freed:
            raise CommError("Mesh.comm: this mesh was freed; build a new Mesh")
        named = {self._axis(x) for x in axes}
        return self._comms[tuple(a for a in self.axes if a in named)]

    def _split(self, key: tuple[str, ...]) -> Communicator:
        color = rank = 0
        for axis, c in zip(self.axes, self._coords, strict=True):
            if axis in key:
                rank = rank * self.shape[axis] + c
            else:
                color = color * self.shape[axis] + c
        comm = self.world.split(color, rank)
        comm.label = "+".join(key)  # how reports and flight-recorder dumps name it
        return comm

    def free(self) -> None:
        """Free every communicator this mesh created (not the world); safe to call twice."""
        comms, self._comms = list(self._comms.values()), {}
        self._freed = True
        for c in comms:
            c.free()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def _axis(self, axis: str) -> str:
        if not isinstance(axis, str) or axis not in self.shape:
            raise CommError(f"Mesh: no axis {axis!r}; the axes are {', '.join(self.axes)}")
        return axis

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"Mesh({dims}; rank {self.rank} at {self._coords})"
