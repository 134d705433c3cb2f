"""Gradient buckets: overlapped, bucketed gradient reduction for data parallel and ZeRO 1/2/3.

Parameters are packed, in reverse program order (the order backward produces their
gradients), into buckets of at most `bucket_mb` MiB (the first at most 1 MiB, as in PyTorch
DDP so that communication starts early). A bucket holds parameters with the same grad_sync
axes and the same split axes (so its shard's contribution to the global norm has one
reduction group); under ZeRO-3 it also never spans two blocks. Each bucket owns one flat
buffer of its parameters (the parameters are views into it) and one flat fp32 gradient buffer.

A post-accumulate-grad hook on every parameter copies the fresh gradient into its bucket's
slot; when a bucket is complete its collective starts asynchronously, and buckets are
launched strictly in index order (a bucket completed early waits for its predecessors), so
every rank issues the same collectives in the same order. Under ZeRO-2/3 the launch of a
bucket waits the reduce-scatter launched REDUCTIONS_IN_FLIGHT buckets before it
(bucket_plan.py), whose full gradient buffer is then freed, so backward holds a few full
buffers rather than every one (FSDP2 frees each layer's likewise); every rank waits at the same
launches, in order, and waits the last ones at the end of backward. `finish()` (called by the
optimizer's step) waits for the rest. Per ZeRO stage, over the data axes (the other grad_sync
axes, e.g. "model" for
sequence-parallel layernorm weights, are a plain allreduce):

  stage 0  allreduce the full gradient buffer.
  stage 1  reduce-scatter it: each rank keeps a contiguous 1/N of every bucket; it updates
           only that shard (optimizer state 1/N) and allgathers the parameters afterwards.
  stage 2  as 1, but the full gradient buffer lives only from the bucket's first gradient to
           its reduce-scatter; each rank keeps (and accumulates into) its gradient shard.
  stage 3  as 2, and the parameters too are kept as shards (see zero.py).

The loss is already the global mean, so partial gradients are SUMMED, never averaged.

Deferred parameters (`deferred=`, given by the executor for weights tied across pipeline
stages) get a bucket each that is never launched during backward: the caller
adds to its local sum (`unreduced_grad(name)`, e.g. the other stages' gradients summed over the
pipe axis) and `finish()` then reduces it like any other bucket.
"""

from __future__ import annotations

import collections
import contextlib

import attrs
import torch

from soapstone.shard.parallel.bucket_plan import REDUCTIONS_IN_FLIGHT, plan_buckets
from soapstone.shard.parallel.zero_stage import ZeroStage


@attrs.define
class Slot:
    """One parameter's place in its bucket's flat buffers."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]


@attrs.define
class Segment:
    """What this rank's optimizer updates for one bucket: fp32 master values and gradients."""

    master: torch.Tensor | None
    grad: torch.Tensor | None


def _progress(comm) -> None:
    """Let MPI advance pending nonblocking collectives (MPICH progresses them only inside MPI
    calls; without this, 'async' reductions would only move at wait())."""
    mpi = getattr(comm, "mpi", None)
    if mpi is not None:
        mpi.Iprobe()


class Bucket:
    """A group of parameters reduced together."""

    def __init__(self, index: int, slots: list[Slot], sync: tuple[str, ...],
                 dp: tuple[str, ...], split: tuple[str, ...], block: str | None, mesh,
                 zero: ZeroStage, dtype: torch.dtype, deferred: bool = False):
        self.index, self.slots, self.block = index, slots, block
        self.deferred = deferred  # reduced only in finish() (see the module doc)
        self.sync, self.dp, self.split = sync, dp, split
        self.rest = tuple(a for a in sync if a not in dp)
        self.comm_all = mesh.comm(*sync) if sync and mesh is not None else None
        self.comm_dp = mesh.comm(*dp) if dp and mesh is not None else None
        self.comm_rest = mesh.comm(*self.rest) if self.rest and mesh is not None else None
        self.n = self.comm_dp.size if self.comm_dp is not None else 1
        self.rank = self.comm_dp.rank if self.comm_dp is not None else 0
        self.zero = zero.on(self.n)  # the stage this bucket runs (0 on one data rank)
        self.sharded = self.zero.shards_optimizer
        used = sum(s.numel for s in slots)
        self.numel = -(-used // self.n) * self.n  # padded so that it splits evenly
        self.shard = self.numel // self.n
        self.dtype = dtype
        self.device = slots[0].param.device  # the model's: flat buffers live beside it
        # master weights, gradients and optimizer state: fp32 (fp64 for a float64 model)
        self.mdtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.handle = None
        self.filled = 0
        self.dirty = False  # gradients added since the last launch
        # stage 0: zero_grad leaves last step's sums in full_grad instead of zeroing it (a
        # pass over every gradient byte saved): each slot's first gradient then overwrites
        # its piece, and `settle` zeroes the pieces no gradient reached before a launch
        self.stale = False
        self.written: set[int] = set()  # offsets of the slots written since it went stale
        self.full_grad: torch.Tensor | None = None  # stage 0/1: persistent; 2/3: transient
        self.grad_shard: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None  # stage 0: the reduced gradient
        self.flat_param: torch.Tensor | None = None
        self.master: torch.Tensor | None = None

    @property
    def keeps_full_grad(self) -> bool:
        """Whether the full gradient buffer persists between steps (stages 0 and 1)."""
        return self.zero.keeps_full_grad

    def shard_range(self) -> slice:
        """This rank's slice of the bucket's flat buffers."""
        return slice(self.rank * self.shard, (self.rank + 1) * self.shard)

    def norm_axes(self) -> tuple[str, ...]:
        """Axes over which this rank's gradient segment is a disjoint piece of the whole."""
        return tuple(sorted(set(self.split) | (set(self.dp) if self.sharded else set())))

    def persistent_grad(self) -> torch.Tensor:
        """A zeroed full gradient buffer that lives through the run (stages 0 and 1): stage 0
        allreduces it in place every step, so it goes where the communicator reduces fastest
        (MPI ranks on one node: shared memory, comm/backends/shm.py). Collective."""
        if not self.sharded and self.comm_all is not None and self.device.type == "cpu":
            t = self.comm_all.shared_zeros(self.numel, self.mdtype)
            if t is not None:
                return t
        return torch.zeros(self.numel, dtype=self.mdtype, device=self.device)

    # --- gradients ------------------------------------------------------------------------
    # Every launch reduces the contributions added since the previous launch; results fold
    # into the segment's gradient (`acc` for stage 0, `grad_shard` for 1-3), so gradient
    # accumulation is right with or without no_sync.
    def add_grad(self, slot: Slot, g: torch.Tensor) -> None:
        """Add parameter gradient g into the bucket's full gradient buffer at slot."""
        if self.handle is not None:
            self.complete()  # a previous microbatch's reduction of this bucket
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.numel, dtype=self.mdtype, device=self.device)
        piece = self.full_grad[slot.offset:slot.offset + slot.numel]
        if self.stale and slot.offset not in self.written:
            self.written.add(slot.offset)
            piece.copy_(g.reshape(-1))
        else:
            piece.add_(g.reshape(-1))
        self.dirty = True

    def settle(self) -> None:
        """Zero the pieces of a stale full_grad that no gradient overwrote (parameters this
        step did not use): from here on it holds the step's sums only."""
        if self.stale:
            for s in self.slots:
                if s.offset not in self.written:
                    self.full_grad[s.offset:s.offset + s.numel].zero_()
            self.stale = False
            self.written.clear()

    def launch(self) -> None:
        """Start this bucket's reduction (async)."""
        self.dirty = False
        self.settle()
        if not self.sharded:
            if self.comm_all is None:
                self._fold_full()
            else:
                self.handle = self.comm_all.allreduce(self.full_grad, async_op=True)
            return
        self.handle = self.comm_dp.reduce_scatter(self.full_grad, 0, async_op=True)
        if not self.keeps_full_grad:
            self.full_grad = None  # freed once the reduce-scatter is done (the handle holds it)

    def _fold_full(self) -> None:
        if self.acc is None:
            self.acc, self.full_grad = self.full_grad, None
        else:
            self.acc.add_(self.full_grad)
            self.full_grad = None

    def complete(self) -> None:
        """Wait for the pending reduction and fold its result into the segment gradient."""
        if self.handle is None:
            return
        out = self.handle.wait()
        self.handle = None
        if not self.sharded:
            self._fold_full()
            return
        if self.comm_rest is not None:
            self.comm_rest.allreduce(out)
        if self.grad_shard is None:
            self.grad_shard = out
        else:
            self.grad_shard.add_(out)
        if self.keeps_full_grad:  # stage 1: the persistent buffer starts again from zero
            self.full_grad.zero_()

    def segment(self) -> Segment:
        """This rank's master values and reduced gradient for the bucket."""
        return Segment(self.master, self.grad_shard if self.sharded else self.acc)


class GradReducer:
    """Owns a ShardedModel's buckets: flat params, gradient hooks, reductions (one per model)."""

    def __init__(self, model, zero: int | ZeroStage | None = None, bucket_mb: float = 25.0,
                 data_axes: tuple[str, ...] | None = None, deferred: tuple[str, ...] = (),
                 overlap: bool = True):
        program = model.program
        self.model = model
        self.zero = ZeroStage.of(program.zero if zero is None else zero)
        self.mesh = model.mesh
        self.overlap = overlap
        self.data_axes = tuple(program.zero_axes if data_axes is None else data_axes)
        # the flat parameters hold the model's compute dtype (bf16 under mixed precision)
        self.dtype = model.compute_dtype or next(
            (p.dtype for p in model.params.values() if p.is_floating_point()), torch.float32)
        self.deferred = tuple(deferred)
        self.buckets = self._make_buckets(bucket_mb)
        self.slot_of: dict[int, tuple[Bucket, Slot]] = {}
        for b in self.buckets:
            for s in b.slots:
                self.slot_of[id(s.param)] = (b, s)
        self._init_flat()
        self._accumulating = False
        self._next = 0
        self._callback_queued = False
        self._grads_exposed = False
        self.launched_in_backward = 0  # buckets launched from gradient hooks (overlap)
        # ZeRO-2/3 buckets whose reduce-scatter (holding the full buffer) may still run, at
        # most `reductions_in_flight` (None: all, waited at the step; bench_dp's baseline)
        self.in_flight: collections.deque[Bucket] = collections.deque()
        self.reductions_in_flight: int | None = REDUCTIONS_IN_FLIGHT
        self.provider = None  # ZeRO-3: where the forward gets its parameters (zero.py)
        if self.zero.shards_params:
            from soapstone.shard.parallel.zero import Zero3Provider

            self.provider = Zero3Provider(self)
        for b in self.buckets:
            for s in b.slots:
                s.param.register_post_accumulate_grad_hook(self._on_grad)

    # --- construction ---------------------------------------------------------------------
    def _make_buckets(self, bucket_mb: float) -> list[Bucket]:
        model = self.model
        buckets = []
        for i, plan in enumerate(plan_buckets(model.program, self.zero, self.data_axes,
                                              self.deferred, bucket_mb)):
            slots, off = [], 0
            for name in plan.names:
                p = model.params[name]
                slots.append(Slot(name, p, off, p.numel(), tuple(p.shape)))
                off += p.numel()
            buckets.append(Bucket(i, slots, plan.sync, plan.dp, plan.split, plan.block,
                                  self.mesh, self.zero, self.dtype, deferred=plan.deferred))
        return buckets

    def _init_flat(self) -> None:
        with torch.no_grad():
            for b in self.buckets:
                full = torch.zeros(b.numel, dtype=b.mdtype, device=b.device)
                for s in b.slots:
                    full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                if b.zero.shards_params:
                    b.master = full[b.shard_range()].clone()
                    from soapstone.shard.parallel.zero import release_params

                    release_params(b, self.dtype)
                    continue
                b.flat_param = full if self.dtype == b.mdtype else full.to(self.dtype)
                for s in b.slots:
                    s.param.data = b.flat_param[s.offset:s.offset + s.numel].view(s.shape)
                if b.sharded:
                    view = b.flat_param[b.shard_range()]
                    b.master = view if self.dtype == b.mdtype else full[
                        b.shard_range()].clone()
                else:
                    b.master = b.flat_param if self.dtype == b.mdtype else full
                if b.keeps_full_grad:
                    b.full_grad = b.persistent_grad()

    # --- during backward ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally (stages 0/1)."""
        old, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = old

    @contextlib.contextmanager
    def one_backward(self):
        """Context: the autograd calls inside count as one backward (a zero-bubble W makes
        one per piece of the graph): the end-of-backward work runs once, at the exit."""
        self._callback_queued = True  # so no call queues it; the exit runs it
        try:
            yield
        finally:
            self._end_backward()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        b, s = self.slot_of[id(p)]
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._grads_exposed:
            self._hide_grads()
        b.add_grad(s, p.grad)
        p.grad = None
        b.filled += 1
        if self.provider is not None:
            self.provider.grad_done(b)
        if b.filled == len(b.slots) and self.overlap:
            self._launch_ready()
        elif b.comm_all is not None:
            _progress(b.comm_all)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and \
                self.buckets[self._next].filled == len(self.buckets[self._next].slots):
            self._launch(self.buckets[self._next])
            self.launched_in_backward += 1
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        if b.deferred:
            return  # reduced in finish(), after the caller's own sum
        if self._accumulating and b.keeps_full_grad:
            return  # reduce the accumulated sum later
        if b.dirty:
            b.launch()
            # a bucket that also allreduces over other axes (sequence-parallel norm weights,
            # experts' replicas) is waited at the step, where the call plan puts that allreduce
            if b.sharded and not b.keeps_full_grad and b.comm_rest is None and \
                    self.reductions_in_flight is not None:
                self.in_flight.append(b)
                while len(self.in_flight) > self.reductions_in_flight:
                    self.in_flight.popleft().complete()  # frees its full buffer

    def _end_backward(self) -> None:
        """Autograd's end-of-backward callback: launch what is left (unused params too)."""
        for b in self.buckets[self._next:]:
            self._launch(b)
        while self.in_flight:  # the next microbatch's forward holds no full buffer
            self.in_flight.popleft().complete()
        for b in self.buckets:
            b.filled = 0
        self._next = 0
        self._callback_queued = False
        if self.provider is not None:
            self.provider.backward_done()

    # --- at the optimizer step ------------------------------------------------------------
    def unreduced_grad(self, name: str) -> torch.Tensor:
        """A deferred parameter's gradient as accumulated on this rank, not yet reduced over
        any axis: a flat view the caller may add to in place before finish()."""
        b, s = self.slot_of[id(self.model.params[name])]
        if not b.deferred:  # not user input: the executor asks for its tied weights only
            raise ValueError(f"{name} is not a deferred parameter (build_optimizer(deferred=...))")
        if b.full_grad is None:
            b.full_grad = torch.zeros(b.numel, dtype=b.mdtype, device=b.device)
        b.settle()
        b.dirty = True
        return b.full_grad[s.offset:s.offset + s.numel]

    def finish(self) -> None:
        """Wait for every reduction (launching any still pending); idempotent."""
        for b in self.buckets:
            if b.dirty:
                b.launch()
        for b in self.buckets:
            b.complete()
            if b.sharded and b.grad_shard is None:
                b.grad_shard = torch.zeros(b.shard, dtype=b.mdtype, device=b.device)
            if not b.sharded and b.acc is None:
                b.acc = torch.zeros(b.numel, dtype=b.mdtype, device=b.device)
        self.in_flight.clear()
        self._expose_grads()

    def _expose_grads(self) -> None:
        """Stage 0 in fp32: p.grad are views of the reduced buffer until the next backward."""
        if self.dtype not in (torch.float32, torch.float64):
            return
        for b in self.buckets:
            if not b.sharded:
                for s in b.slots:
                    s.param.grad = b.acc[s.offset:s.offset + s.numel].view(s.shape)
        self._grads_exposed = True

    def _hide_grads(self) -> None:
        if not self._grads_exposed:
            return
        for b in self.buckets:
            for s in b.slots:
                s.param.grad = None
        self._grads_exposed = False

    def segments(self) -> list[Segment]:
        """Every bucket's segment (what the optimizer updates), in bucket order."""
        return [b.segment() for b in self.buckets]

    def nonfinite_slots(self, flats: list[torch.Tensor | None]) -> list[str]:
        """The parameters whose piece of flats[i] holds a NaN or an infinity, where flats[i]
        is laid out as bucket i's segment (its reduced gradient, master values or an
        optimizer state buffer: this rank's shard under ZeRO >= 1). A slow path, for a report."""
        out = []
        for b, flat in zip(self.buckets, flats, strict=True):
            if flat is None or not flat.is_floating_point() or bool(torch.isfinite(flat).all()):
                continue
            lo = b.shard_range().start if b.sharded else 0
            for s in b.slots:
                a, z = max(s.offset - lo, 0), min(s.offset + s.numel - lo, flat.numel())
                if a < z and not bool(torch.isfinite(flat[a:z]).all()):
                    out.append(s.name)
        return out

    def global_grad_norm(self) -> float:
        """sqrt of the sum of squares over every element of the global gradient, counted once:
        a segment split over some axes is summed over them; replicas are not summed."""
        return self.global_grad_norm_sq() ** 0.5

    def global_grad_norm_sq(self, weights: dict[str, float] | None = None) -> float:
        """The squared global norm of this model's gradient (collective over its mesh).
        weights: a factor per deferred parameter (e.g. 1/copies for a weight tied across
        pipeline stages, so that the sum over stages counts it once)."""
        sums: dict[tuple[str, ...], float] = {}
        for b in self.buckets:
            g = b.segment().grad
            key = b.norm_axes()
            sq = float(torch.linalg.vector_norm(g)) ** 2 if g is not None else 0.0
            if weights and b.deferred:
                sq *= weights.get(b.slots[0].name, 1.0)
            sums[key] = sums.get(key, 0.0) + sq
        total = 0.0
        for key in sorted(sums):
            t = torch.tensor([sums[key]], dtype=torch.float64, device=self.model.device)
            if key and self.mesh is not None:
                self.mesh.comm(*key).allreduce(t)
            total += float(t)
        return total

    def publish_params(self) -> None:
        """After the update: every rank's parameters hold the new values again."""
        self._hide_grads()
        pending = []
        with torch.no_grad():
            for b in self.buckets:
                if b.zero.shards_params:
                    continue  # gathered from the master shard at the next forward
                if b.sharded:
                    src = b.master if b.master.dtype == self.dtype else b.master.to(self.dtype)
                    pending.append((b, b.comm_dp.allgather(src.contiguous(), 0, async_op=True)))
                elif b.master is not b.flat_param:
                    b.flat_param.copy_(b.master)
            for b, h in pending:
                b.flat_param.copy_(h.wait())
        if self.provider is not None:
            self.provider.params_updated()

    def zero_grad(self) -> None:
        """Clear the gradients for the next step (buffers zeroed or dropped per ZeRO stage)."""
        self._hide_grads()
        self.in_flight.clear()
        for b in self.buckets:
            b.complete()
            b.dirty = False
            if not b.sharded:
                if b.acc is not None:
                    b.full_grad, b.acc = b.acc, None
                if b.full_grad is not None:
                    b.stale = True
                    b.written.clear()
            elif b.keeps_full_grad:
                b.full_grad.zero_()
                b.grad_shard = None
            else:
                b.full_grad = None
                if b.grad_shard is not None:
                    b.grad_shard.zero_()

    def gathered(self):
        """Context: ZeRO-3 parameters hold their full values inside (see zero.py)."""
        return self.provider.gathered()
