"""What the primitive ops' kernels run in: a rank's shards, dims aligned, statistics combined.

Each op's kernel lives in its record (shard/ops/<family>.py) and takes the Compute step, its
arg tensors (dims in the order of their program values) and a `Shards` context that knows the
mesh and the global offset of every local slice. An op split along a dim it reduces over
(`step.dist`) runs its distributed form: it combines partial statistics across that axis with
autograd-aware allreduces (`Stats`, in the order its record's `dist_stats` lists them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from soapstone.comm import autograd as ag
from soapstone.shard.ops.einsum import einsum_spec, matmul_split  # noqa: F401 - ops' old names
from soapstone.shard.ops.record import Reduce
from soapstone.shard.plan.balanced import local_positions, nested_runs, own_axes, unzigzag, zigzag
from soapstone.shard.plan.program import Compute, Program, Value

OpFn = Callable[[Compute, list[torch.Tensor], "Shards"], torch.Tensor]
# every primitive's kernel by kind, read off the records once (the dispatch of run_op)


class Shards:
    """Where this rank's pieces sit in the global tensors: offsets and axis communicators."""

    def __init__(self, program: Program, mesh=None):
        self.program = program
        self.mesh = mesh
        self.sizes = dict(program.dims)
        self.training = True
        self.rng_seed = 0  # dropout masks depend on (seed, step, op) only, never on the layout
        self.rng_step = 0
        # Where this program's batch sits in the global batch when it runs one microbatch
        # (pipeline, gradient accumulation): dim -> (offset, global size). Random draws are
        # made at the global size and this window is sliced, as data-parallel ranks do.
        self.window: dict[str, tuple[int, int]] = {}
        # The share of the step's loss gradient this forward's loss carries (1 / microbatches,
        # over gradient accumulation too): a layer's own loss term (moe's balance loss) is
        # scaled by it in backward, as the training loss is.
        self.loss_scale = 1.0
        self.device = torch.device("cpu")  # where the ops' own index tensors are made
        # tensors fixed by the program and this rank's place in it (rope's cos/sin tables),
        # made once instead of every layer of every step
        self.constants: dict[tuple, tuple[torch.Tensor, ...]] = {}
        # --precision float8: the output of each step that runs in float8 -> its matmul
        # (set by the runtime: shard/runtime/float8.py; empty otherwise)
        self.float8: dict[str, Callable] = {}
        # values no step reads after their last consumer and no autograd node keeps: a
        # record with grad_in_place may write their gradient over them (overwrite_plan.py)
        self.overwritable: frozenset[str] = frozenset()

    def float8_kernel(self, step: Compute) -> Callable | None:
        """The float8 matmul `step` runs with, or None (it runs in its inputs' dtype)."""
        return self.float8.get(step.out)

    def comm(self, axis: str):
        """The communicator along one mesh axis."""
        return self.mesh.comm(axis)

    def offset(self, value: Value, dim: str) -> int:
        """Global index of this rank's first element along `dim` of `value` (a contiguous
        split, over one axis or nested over several: a balanced one has no single offset,
        `index` gives its positions)."""
        axes = value.layout.dim_axes(dim)
        if not axes:
            return 0
        if dim in self.program.balanced:
            raise RuntimeError(f"{value.name}: {dim} is split balanced; read its positions "
                               "with Shards.index")
        piece = value.layout.piece(dim, {a: self.mesh.coord(a) for a in axes},
                                   {a: self.mesh.size(a) for a in axes})
        return piece * value.local_shape[value.dims.index(dim)]

    def balanced_over(self, value: Value, dim: str) -> str | None:
        """The axis `dim` of `value` is split over in zigzag chunks (balanced), or None."""
        axes = value.layout.dim_axes(dim)
        if not axes or dim not in self.program.balanced:
            return None
        head = self._balanced_axes()[dim]
        if axes[0] != head:  # the compiler never cuts a balanced dim inside without it
            raise RuntimeError(f"{value.name}: {dim} is split balanced over {head}, but this "
                               f"value cuts it over {', '.join(axes)} only")
        return head

    def _balanced_axes(self) -> dict[str, str]:
        """Each balanced dim's own axis: the first in mesh order any value splits it over (a
        second axis, sequence parallel, cuts inside its pieces: the checker orders them)."""
        if "balanced" not in self.constants:
            self.constants["balanced"] = (own_axes(self.program),)
        return self.constants["balanced"][0]

    def _inner_piece(self, value: Value, dim: str) -> tuple[int, int]:
        """(which piece, of how many) of this rank's outer piece of `dim` it holds along
        the axes after the outermost (sequence parallel inside context parallel)."""
        piece, pieces = 0, 1
        for axis in value.layout.dim_axes(dim)[1:]:
            piece, pieces = piece * self.mesh.size(axis) + self.mesh.coord(axis), \
                pieces * self.mesh.size(axis)
        return piece, pieces

    def positions(self, value: Value, dim: str) -> list[int] | None:
        """The global positions of this rank's elements along `dim` where the split is
        balanced (zigzag chunks, then a contiguous piece of their concatenation where a second
        axis cuts it too); None where they are one contiguous run."""
        axis = self.balanced_over(value, dim)
        if axis is None:
            return None
        held = local_positions(self.sizes[dim], self.mesh.size(axis), self.mesh.coord(axis))
        n = value.local_shape[value.dims.index(dim)]
        piece, _ = self._inner_piece(value, dim)
        return held[piece * n:(piece + 1) * n]

    def runs(self, value: Value, dim: str) -> list[tuple[int, int, int]]:
        """This rank's runs of consecutive positions along `dim` (balanced.rank_runs): its
        two zigzag chunks where balanced (or the parts of them its piece holds), else its one
        slice."""
        n = value.local_shape[value.dims.index(dim)]
        axis = self.balanced_over(value, dim)
        if axis is None:
            return [(0, self.offset(value, dim), n)]
        return nested_runs(self.sizes[dim], self.mesh.size(axis), self.mesh.coord(axis), True,
                           *self._inner_piece(value, dim))

    def index(self, value: Value, dim: str) -> torch.Tensor:
        """The global positions of this rank's elements along `dim`, on the run's device."""
        pos = self.positions(value, dim)
        if pos is not None:
            return torch.tensor(pos, dtype=torch.int64, device=self.device)
        n = value.local_shape[value.dims.index(dim)]
        return torch.arange(n, dtype=torch.int64, device=self.device) + self.offset(value, dim)

    def reorder(self, x: torch.Tensor, d: int, parts: int, back: bool = False) -> torch.Tensor:
        """`x` (dim d whole) permuted into the rank order of a balanced split over `parts`
        ranks (back: a gathered one into natural order again); autograd permutes the
        gradient back."""
        key = ("zigzag", x.shape[d], parts, back, x.device)
        if key not in self.constants:
            order = (unzigzag if back else zigzag)(x.shape[d], parts)
            self.constants[key] = (torch.tensor(order, dtype=torch.int64, device=x.device),)
        return x.index_select(d, self.constants[key][0])

    def local_slices(self, value: Value) -> tuple[slice | list[int], ...]:
        """This rank's window into the global tensor (a balanced dim's: its positions)."""
        return tuple(self.positions(value, d) or
                     slice(self.offset(value, d), self.offset(value, d) + n)
                     for d, n in zip(value.dims, value.local_shape, strict=True))

    def global_sizes(self, value: Value) -> tuple[int, ...]:
        """The shape of `value` in the whole batch (a microbatch's dims at their global size)."""
        return tuple(self.window[d][1] if d in self.window else self.sizes[d]
                     for d in value.dims)

    def global_slices(self, value: Value) -> tuple[slice, ...]:
        """This rank's window into `global_sizes(value)`: local_slices shifted by the window."""
        return tuple(slice(s.start + self.window[d][0], s.stop + self.window[d][0])
                     if d in self.window and isinstance(s, slice) else s
                     for d, s in zip(value.dims, self.local_slices(value), strict=True))

    def arg(self, step: Compute, i: int) -> Value:
        """The program value of arg i."""
        return self.program.value(step.args[i])

    def out(self, step: Compute) -> Value:
        """The program value the step produces."""
        return self.program.value(step.out)


def align(t: torch.Tensor, dims: tuple[str, ...], target: tuple[str, ...]) -> torch.Tensor:
    """View `t` (with `dims`) laid out along `target`, size-1 where it lacks a dim."""
    if dims == target[len(target) - len(dims):]:
        return t  # already the trailing dims, in order: torch broadcasting does the rest
    order = [dims.index(d) for d in target if d in dims]
    t = t.permute(order) if order != list(range(len(order))) else t
    shape = []
    it = iter(t.shape)
    for d in target:
        shape.append(next(it) if d in dims else 1)
    return t.reshape(shape)


class Stats:
    """The statistics a distributed form combines across ranks, taken in order from its
    record's `dist_stats` (what `show`, `explain` and the verifier count): the op's code and
    the record cannot drift, since a reduction the record does not list, or of another kind,
    is an error."""

    def __init__(self, step: Compute, ctx: Shards, records: tuple):
        """`records`: the calling family's RECORDS (passed in, so the families need not
        import the registry that imports them)."""
        self.step, self.ctx = step, ctx
        self.rows = iter(next(r for r in records if r.name == step.kind).dist_stats)

    def reduce(self, t: torch.Tensor, op: Reduce) -> torch.Tensor:
        """Allreduce the local statistic `t` with `op` over every axis the op is split on; its
        gradient is summed back where the record says so, else passes through (a max is a
        constant for stability: no gradient)."""
        row = next(self.rows, None)
        if row is None or row.reduce is not op:
            want = row.reduce.value if row else None
            raise RuntimeError(f"{self.step.kind}: reduction {op.value} where its record's "
                               f"dist_stats lists {want}")
        for axis in self.step.dist:
            comm = self.ctx.comm(axis)
            if op is Reduce.MAX:
                t = comm.allreduce(t.detach().clone(), op=op.value)
            else:
                t = ag.all_reduce(t, comm, backward="allreduce" if row.backward else "identity")
        return t
