"""Which mesh axes stay inside a node and which cross nodes.

Ranks sit on the mesh row-major (comm.Mesh: the last axis varies fastest), and a launcher
fills nodes with consecutive ranks (`mpiexec -ppn 8`, Slurm's block distribution), so the
innermost axes are laid inside a node, as Megatron and torchtitan lay tensor parallelism on
NVLink and data parallelism across nodes. For each axis, one of its groups (the ranks that
differ only along it) touches as many nodes as `nodes` says: 1 is inside a node. A
tensor-parallel axis (one a `parameter` statement splits a dim over, not the data axis of an
expert split) that crosses nodes runs its per-layer collectives over the inter-node network:
`tp_warnings` names the fix. No torch.
"""

from __future__ import annotations

import enum
import math

import attrs


class Span(enum.Enum):
    """Where one axis's groups lie."""

    INSIDE = "inside a node"
    ACROSS = "across nodes"


@attrs.frozen
class AxisPlacement:
    """One mesh axis: its size, whether a group of it crosses nodes, and how many nodes one
    group touches at most."""

    axis: str
    size: int
    span: Span
    nodes: int

    def to_data(self) -> dict:
        """The axis as JSON."""
        return {"axis": self.axis, "size": self.size, "span": self.span.name.lower(),
                "nodes": self.nodes}


def block_nodes(world: int, per_node: int) -> list[int]:
    """The node of each rank when nodes take `per_node` consecutive ranks."""
    return [r // per_node for r in range(world)]


def place(mesh: tuple[tuple[str, int], ...], node_of: list[int]) -> tuple[AxisPlacement, ...]:
    """Every axis of `mesh` ((axis, size), row-major) placed over `node_of` (world rank ->
    node)."""
    sizes = [n for _, n in mesh]
    out = []
    for i, (axis, n) in enumerate(mesh):
        stride = math.prod(sizes[i + 1:])
        widest = 1
        for r in range(len(node_of)):
            if (r // stride) % n:  # not the first rank of its group along `axis`
                continue
            widest = max(widest, len({node_of[r + k * stride] for k in range(n)}))
        out.append(AxisPlacement(axis, n, Span.INSIDE if widest == 1 else Span.ACROSS, widest))
    return tuple(out)


def tensor_axes(par) -> tuple[str, ...]:
    """The axes a layout's `parameter` statements split dims over, less its data axes (an
    expert split over the data axis is expert parallelism, whose alltoall may cross nodes)."""
    data = {axis for _, axis in par.sample}
    return tuple(dict.fromkeys(a for _, a in par.parameter if a not in data))


def tp_warnings(par, placed: tuple[AxisPlacement, ...], per_node: int | str) -> list[str]:
    """A warning per tensor-parallel axis of `par` that crosses nodes, naming the fix."""
    out = []
    tp = tensor_axes(par)
    axes = [p.axis for p in placed]
    for p in placed:
        if p.axis not in tp or p.span is Span.INSIDE:
            continue
        fixes = []
        if axes[-1] != p.axis:
            inner = [f"{a} = {s}" for a, s in par.mesh if a != p.axis] + [f"{p.axis} = {p.size}"]
            fixes.append(f"make it the last (innermost) axis: mesh({', '.join(inner)})")
        if isinstance(per_node, int) and (p.size > per_node or per_node % p.size):
            fixes.append(f"give it a size that divides {per_node}")
        fix = " and ".join(fixes) or "launch with consecutive ranks on each node"
        out.append(f"layout {par.name}: tensor-parallel axis {p.axis} ({p.size} ranks) crosses "
                   f"{p.nodes} nodes of {per_node} ranks, so its per-layer collectives go over "
                   f"the inter-node network; {fix}")
    return out


def format_placement(placed: tuple[AxisPlacement, ...], per_node: int | str,
                     where: str) -> str:
    """`placement (8 ranks per node, from --profile h100-80gb): model inside a node, ...`."""
    parts = [f"{p.axis}={p.size} {p.span.value}" + (f" ({p.nodes})" if p.nodes > 1 else "")
             for p in placed]
    return f"placement ({per_node} ranks per node, {where}): {', '.join(parts)}"
