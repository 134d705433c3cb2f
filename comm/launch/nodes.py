"""Which node each rank of a launch is on: what placement and the launch check read.

A node is the ranks that share memory (MPI.COMM_TYPE_SHARED). SOAPSTONE_RANKS_PER_NODE=N
instead makes every N consecutive world ranks a node: simulated nodes on one machine, used
only for grouping and placement (which mesh axes cross nodes, the equal-nodes check), never
for choosing a GPU, which follows the real node (comm/launch/device.py). Nodes of unequal size are
bad input: the mesh's innermost axes would be laid over node boundaries differently on
different nodes.
"""

from __future__ import annotations

import os
from collections import Counter

from soapstone.comm.errors import UserError

ENV = "SOAPSTONE_RANKS_PER_NODE"


class NodeError(UserError, ValueError):
    """A launch whose nodes cannot hold the layout evenly, or a bad SOAPSTONE_RANKS_PER_NODE."""


def ranks_per_node_override() -> int | None:
    """SOAPSTONE_RANKS_PER_NODE as an integer >= 1, None when unset (NodeError when bad)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise NodeError(f"{ENV} = {text!r}: give the ranks of one simulated node, an integer "
                        ">= 1 (or unset it to use the real nodes)")
    return int(text)


def node_map(mpi_comm=None) -> list[int]:
    """The node of every world rank, numbered in the order of their first rank (collective
    over `mpi_comm`, default MPI.COMM_WORLD; every rank gets the same list)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    per_node = ranks_per_node_override()
    if per_node is not None:
        return [r // per_node for r in range(comm.Get_size())]
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = local.bcast(comm.Get_rank(), root=0)
    finally:
        local.Free()
    leaders = comm.allgather(leader)
    number = {lead: i for i, lead in enumerate(dict.fromkeys(leaders))}
    return [number[lead] for lead in leaders]


def check_nodes(node_of: list[int]) -> None:
    """NodeError when the nodes hold unequal numbers of ranks (the same verdict on every rank,
    since every rank holds the same map)."""
    sizes = Counter(node_of)
    if len(set(sizes.values())) <= 1:
        return
    per = ", ".join(str(sizes[n]) for n in sorted(sizes))
    override = ranks_per_node_override()
    if override is not None:
        raise NodeError(f"{ENV}={override}: {len(node_of)} ranks do not fill nodes of "
                        f"{override} (they hold {per}); launch a multiple of {override} ranks "
                        f"or set {ENV} to a divisor of {len(node_of)}")
    raise NodeError(f"the launch put {len(node_of)} ranks on {len(sizes)} nodes of unequal "
                    f"size ({per}); launch the same number on every node (mpiexec -ppn N, "
                    "srun --ntasks-per-node N)")
