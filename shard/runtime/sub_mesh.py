"""A mesh seen without one axis (the pipe axis): what each stage's ShardedModel runs on."""

from __future__ import annotations


class SubMesh:
    """A mesh seen without one axis: what a stage's ShardedModel runs on. Communicators are
    the full mesh's (those over the remaining axes hold ranks of one pipe stage)."""

    def __init__(self, mesh, drop: str):
        self.mesh = mesh
        self.shape = {a: n for a, n in mesh.shape.items() if a != drop}
        self.axes = tuple(self.shape)
        self.rank = mesh.rank

    def comm(self, *axes: str):
        """The full mesh's communicator over `axes` (none of them the dropped axis)."""
        return self.mesh.comm(*axes)

    def coord(self, axis: str) -> int:
        """This rank's coordinate along `axis` of the full mesh."""
        return self.mesh.coord(axis)

    def size(self, axis: str) -> int:
        """How many ranks `axis` of the full mesh has."""
        return self.mesh.size(axis)
