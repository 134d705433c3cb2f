"""One communication call of one rank (`Op`, what sequence.py lists and prove.py pairs), and
the world ranks of a mesh's communicators (`MeshRanks`, as comm/mesh.py builds them). Pure
data: no torch.
"""

from __future__ import annotations

import functools
import math

import attrs

from soapstone.shard.plan.dtypes import DTYPES

F64 = "f64"  # the dtype the loss, the grad norm and tied weights are summed in


@attrs.frozen
class Op:
    """One communication call of one rank (sequence.py's module doc says which, in what order)."""

    kind: str  # allreduce | reduce_scatter | allgather | alltoall | broadcast | send | recv |
    # wait (completing a posted send or receive, the same peer and tag; no call of its own)
    axes: tuple[str, ...]  # the communicator's mesh axes
    ranks: tuple[int, ...]  # its world ranks, in its own rank order
    shape: tuple[int, ...]  # the tensor passed to the call (-1: rows the routing decides)
    dtype: str
    bytes: int  # what this rank sends, in the comm layer's stats convention
    phase: str  # forward | backward | grad sync | grad norm | loss | tied sum | p2p
    stage: int | None = None  # virtual stage (None: the whole rank's step)
    mb: int | None = None  # microbatch
    source: str = ""  # what made it: the spec's value, a bucket, the loss
    peer: int = -1  # p2p: the other side's world rank
    tag: tuple = ()  # p2p: (direction A|G, edge, microbatch, tensor index)
    waits: str = ""  # a wait: the kind of the call it completes (send | recv)
    # the communicator as the flight recorder names it: `data+model[0,1,2,3]`
    key: str = attrs.field(init=False, eq=False, repr=False)

    @key.default
    def _key(self) -> str:
        return _comm_key(self.axes, self.ranks)

    @property
    def is_p2p(self) -> bool:
        """A send, a receive, or a wait on one."""
        return self.kind in ("send", "recv", "wait")

    @property
    def is_call(self) -> bool:
        """A call the flight recorder numbers (a wait completes an earlier one)."""
        return self.kind != "wait"

    def waited(self) -> Op:
        """The wait completing this posted send or receive (its cost not counted again)."""
        return Op("wait", self.axes, self.ranks, self.shape, self.dtype, self.bytes, self.phase,
                  self.stage, self.mb, self.source, self.peer, self.tag, self.kind)

    def signature(self) -> tuple:
        """What every member of a collective must agree on: kind, shape, dtype."""
        return (self.kind, self.shape, self.dtype)

    def describe(self) -> str:
        """One line: `allreduce (8, 16, 32) f32 on model[0,1] (forward, stage 0, mb 1, from x)`."""
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        peer = ""
        if self.is_p2p:
            peer = (" to" if self.kind == "send" else " from" if self.kind == "recv" else
                    " on the message with") + f" rank {self.peer}"
        where = [self.phase]
        if self.stage is not None:
            where.append(f"stage {self.stage}")
        if self.mb is not None:
            where.append(f"microbatch {self.mb}")
        src = f", from {self.source}" if self.source else ""
        return f"{self.kind}{peer} {shape} {self.dtype} on {self.key} ({', '.join(where)}{src})"

    def to_data(self) -> dict:
        """JSON-ready: what the watchdog is handed (comm must not import the plan)."""
        dtype = DTYPES[self.dtype].torch_name if self.dtype in DTYPES else self.dtype
        return {"op": self.kind, "key": self.key, "shape": list(self.shape),
                "dtype": dtype, "bytes": self.bytes, "peer": self.peer,
                "what": self.describe()}


@functools.lru_cache(maxsize=4096)
def _comm_key(axes: tuple[str, ...], ranks: tuple[int, ...]) -> str:
    return f"{'+'.join(axes)}[{','.join(map(str, ranks))}]"


def _coords(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(sizes):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def _rank_of(coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    r = 0
    for c, n in zip(coords, sizes, strict=True):
        r = r * n + c
    return r


class MeshRanks:
    """Row-major world ranks of a mesh, and the ranks of each communicator (as comm/mesh.py)."""

    def __init__(self, mesh: tuple[tuple[str, int], ...]):
        self.axes = tuple(a for a, _ in mesh)
        self.sizes = tuple(n for _, n in mesh)
        self.shape = dict(mesh)
        self._groups: dict[tuple, tuple[tuple[str, ...], tuple[int, ...]]] = {}

    def group(self, rank: int, axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(axes in mesh order, world ranks of the communicator over them holding `rank`)."""
        axes = tuple(axes)
        got = self._groups.get((rank, axes))
        if got is None:
            got = self._groups[(rank, axes)] = self._group(rank, axes)
        return got

    def _group(self, rank: int, axes: tuple[str, ...]):
        axes = tuple(a for a in self.axes if a in set(axes))
        mine = _coords(rank, self.sizes)
        ranks = []
        for i in range(math.prod(self.shape[a] for a in axes)):
            c = list(mine)
            for a in reversed(axes):
                k = self.axes.index(a)
                i, c[k] = divmod(i, self.shape[a])
            ranks.append(_rank_of(tuple(c), self.sizes))
        return axes, tuple(ranks)

    def coord(self, rank: int, axis: str) -> int:
        """`rank`'s coordinate on `axis`."""
        return _coords(rank, self.sizes)[self.axes.index(axis)]

    def moved(self, rank: int, axis: str, coord: int) -> int:
        """The world rank `rank` would be at coordinate `coord` of `axis`."""
        key = (rank, axis, coord)
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = self._moved(rank, axis, coord)
        return got

    def _moved(self, rank: int, axis: str, coord: int) -> int:
        c = list(_coords(rank, self.sizes))
        c[self.axes.index(axis)] = coord
        return _rank_of(tuple(c), self.sizes)
