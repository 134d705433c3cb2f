"""The temporaries a Redistribute step's collective makes beside its input and output.

The runtime's collectives (comm/autograd.py over comm/backends/mpi.py and nccl.py) move
contiguous [n, *chunk] blocks. Along a dim with only size-1 dims before it that is the
tensor's own layout; along any other (the sequence of a [batch, seq, hidden] value) they
rearrange:
- reduce_scatter copies its whole input into chunk-major order first (`chunks_first`);
- allgather receives into an [n, *shard] buffer, then concatenates it into the output
  (`concat_from_first`), the two alive together;
- alltoall copies its input chunk-major along the split dim (as reduce_scatter), receives
  into a buffer of the same size, and concatenates that into the output unless the concat
  dim is leading (then the output is a view of it).
Each backward is its transpose: reduce_scatter's an allgather of the output's gradient,
allgather's (grad partial) a reduce_scatter of the whole gradient, a slice's an allgather,
alltoall's the inverse alltoall. An allreduce clones its input into its output, a
replicated gather's backward slices its gradient into the input's: no temporary beyond
the values themselves.

explain's walks (activations.py) add these at the step, forward and backward, and again in
a recompute range's second run.
"""

from __future__ import annotations

import math

from soapstone.shard.plan.layout import RedistributeKind
from soapstone.shard.plan.program import Program, Redistribute

K = RedistributeKind


def leading(shape: tuple[int, ...], dims: tuple[str, ...], dim: str) -> bool:
    """Whether `dim`'s chunks are contiguous in a contiguous tensor: no dim before it but
    size-1 ones."""
    return math.prod(shape[:dims.index(dim)]) == 1


def collective_scratch(step: Redistribute, program: Program) -> tuple[int, int]:
    """(forward, backward) bytes `step`'s collective allocates besides its input and output
    (module doc); (0, 0) for integer values, which take no backward and gather flat."""
    src, out = program.value(step.src), program.value(step.out)
    if not src.is_float:
        return 0, 0
    full = max(src.nbytes, out.nbytes)  # the gathered (or to-be-scattered) size

    def rearranged(dim: str) -> bool:
        return not leading(src.local_shape, src.dims, dim)

    if step.kind is K.REDUCE_SCATTER:
        scattered = rearranged(step.to.dim)
        return (full if scattered else 0), (full if scattered else 0)
    if step.kind is K.ALLGATHER:
        gathered = rearranged(step.frm.dim)
        back = full if gathered and step.grad == "partial" else 0
        return (full if gathered else 0), back
    if step.kind is K.SLICE:
        return 0, (full if rearranged(step.to.dim) else 0)
    if step.kind is K.ALLTOALL:
        return _alltoall(src, step.to.dim, step.frm.dim), \
            _alltoall(out, step.frm.dim, step.to.dim)
    return 0, 0


def _alltoall(x, split: str, concat: str) -> int:
    """An alltoall of `x` (split along `split`, concatenated along `concat`): the send copy
    when `split` is not leading, and the receive buffer unless the output is a view of it."""
    send = 0 if leading(x.local_shape, x.dims, split) else x.nbytes
    recv = 0 if leading(x.local_shape, x.dims, concat) else x.nbytes
    return send + recv
