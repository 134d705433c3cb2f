"""ZeRO-3: parameters kept as shards, gathered per block just before use and freed after.

The hook into the runtime is the `provider=` argument of `ShardedModel.forward` (the
executor passes the optimizer's `param_provider`): forward runs inside
`provider.forward_context()` and calls `before_step(i, env)` / `after_step(i)` around each
Program step. This provider

- gathers a bucket's parameters (an allgather of the flat shard over the data axes) at the
  step that first uses one of them, and starts the allgather of the next bucket in forward
  order right away (prefetch), so it overlaps the current block's compute;
- frees the gathered buffer after the step that last uses it (the parameters become empty);
- inside forward_context, registers autograd saved-tensor hooks: a saved tensor whose storage
  is a gathered bucket is stored as (bucket, size, stride, offset) instead of a reference, so
  freeing really frees. In backward, unpacking it gathers the bucket again (prefetching the
  bucket that backward needs next) and the buffer is freed when the bucket's last gradient
  has arrived (the gradient hook of data_parallel.py calls `grad_done`).

Buckets under ZeRO-3 never span two blocks (ParamSpec.block), so "the next bucket" is the
rest of this block or the next block.
"""

from __future__ import annotations

import contextlib

import torch

from soapstone.shard.plan.program import Compute


def release_params(bucket, dtype: torch.dtype) -> None:
    """Point a bucket's parameters at a one-element placeholder broadcast to their shape (no
    memory, but autograd's AccumulateGrad still sees the right shape)."""
    one = torch.zeros(1, dtype=dtype, device=bucket.device)
    for s in bucket.slots:
        s.param.data = one.expand(s.shape)


class _Packed:
    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index, size, stride, offset):
        self.index, self.size, self.stride, self.offset = index, size, stride, offset


class Zero3Provider:
    """Supplies a ZeRO-3 model's parameters to ShardedModel.forward (see the module doc)."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.model = reducer.model
        self.buckets = reducer.buckets
        owner = {s.name: b for b in self.buckets if b.zero.shards_params for s in b.slots}
        self.owner = owner
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, step in enumerate(self.model.program.steps):
            names = step.args if isinstance(step, Compute) else (step.src,)
            at = self.model.run_index.get(i, i)  # a fused chain reads the weight where it runs
            for a in names:
                b = owner.get(a)
                if b is not None:
                    first[b.index] = min(first.get(b.index, at), at)
                    last[b.index] = max(last.get(b.index, at), at)
        self.order = sorted(first, key=first.get)  # bucket indices in forward order
        self.gather_at: dict[int, list[int]] = {}
        self.free_at: dict[int, list[int]] = {}
        for idx in self.order:
            self.gather_at.setdefault(first[idx], []).append(idx)
            self.free_at.setdefault(last[idx], []).append(idx)
        self.full: dict[int, torch.Tensor] = {}
        self.pending: dict[int, object] = {}
        self.by_ptr: dict[int, int] = {}
        self.shard_cache: dict[int, torch.Tensor] = {}
        self.gathers = 0  # allgathers issued (for tests and benchmarks)
        self.peak_live = 0  # most gathered buckets alive at once

    # --- gathering and freeing ------------------------------------------------------------
    def _source(self, b) -> torch.Tensor:
        if b.master.dtype == self.reducer.dtype:
            return b.master
        src = self.shard_cache.get(b.index)
        if src is None:
            src = self.shard_cache[b.index] = b.master.to(self.reducer.dtype)
        return src

    def prefetch(self, idx: int) -> None:
        """Start bucket idx's allgather (async) unless it is gathered or pending."""
        if idx in self.full or idx in self.pending:
            return
        b = self.buckets[idx]
        self.gathers += 1
        self.pending[idx] = b.comm_dp.allgather(self._source(b), 0, async_op=True)

    def gather(self, idx: int) -> torch.Tensor:
        """Bucket idx's full flat parameters (waiting for its allgather); its params view them."""
        full = self.full.get(idx)
        if full is not None:
            return full
        self.prefetch(idx)
        full = self.pending.pop(idx).wait()
        self.full[idx] = full
        self.peak_live = max(self.peak_live, len(self.full))
        self.by_ptr[full.untyped_storage().data_ptr()] = idx
        for s in self.buckets[idx].slots:
            s.param.data = full[s.offset:s.offset + s.numel].view(s.shape)
        return full

    def release(self, idx: int) -> None:
        """Free bucket idx's gathered buffer; its params become empty placeholders."""
        full = self.full.pop(idx, None)
        if full is None:
            return
        del self.by_ptr[full.untyped_storage().data_ptr()]
        release_params(self.buckets[idx], full.dtype)

    def _next_of(self, idx: int, step: int) -> int | None:
        k = self.order.index(idx) + step
        return self.order[k] if 0 <= k < len(self.order) else None

    # --- the ShardedModel hook ------------------------------------------------------------
    def forward_context(self):
        """Context for forward: the saved-tensor hooks that let gathered buckets be freed."""
        if not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def before_step(self, i: int, env: dict, ahead: int = +1) -> None:
        """Before Program step i: gather the buckets first used there, prefetch the one
        `ahead` of each in forward order (the next; the one before when recompute runs the
        step again in backward, as an unpack does)."""
        if i == 0:
            env.update(self.model.params)
        for idx in self.gather_at.get(i, ()):
            self.gather(idx)
            nxt = self._next_of(idx, ahead)
            if nxt is not None:
                self.prefetch(nxt)

    def after_step(self, i: int) -> None:
        """After Program step i: free the buckets last used there."""
        for idx in self.free_at.get(i, ()):
            self.release(idx)

    # --- backward -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if not self.by_ptr or t.layout != torch.strided:
            return t
        idx = self.by_ptr.get(t.untyped_storage().data_ptr())
        if idx is None:
            return t
        return _Packed(idx, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        full = self.gather(x.index)
        prev = self._next_of(x.index, -1)
        if prev is not None:
            self.prefetch(prev)
        return full.as_strided(x.size, x.stride, x.offset)

    def gather_for(self, names) -> None:
        """Gather the buckets of parameters `names` for a rebuild in backward (`recompute
        ops`): a rebuilt matmul's weight is one whose gradient backward has still to make, so
        its bucket is gathered or about to be (and not yet freed): gathering it here moves
        backward's own gather earlier, its unpack then finds it, and no gather is added."""
        for n in names:
            b = self.owner.get(n)
            if b is not None:
                self.gather(b.index)

    def grad_done(self, b) -> None:
        """Called by the gradient hook: once a bucket has all its gradients, free it."""
        if b.zero.shards_params and b.filled == len(b.slots):
            self.release(b.index)

    def backward_done(self) -> None:
        """End of backward: free every gathered bucket and drain pending prefetches."""
        for idx in list(self.full):
            self.release(idx)
        for idx in list(self.pending):
            self.pending.pop(idx).wait()

    def params_updated(self) -> None:
        """After the optimizer step: drop the cached compute-dtype shards."""
        self.shard_cache.clear()

    @contextlib.contextmanager
    def gathered(self):
        """Every ZeRO-3 parameter holds its full value inside the block."""
        peak = self.peak_live  # deliberate, not a training-time peak
        for idx in self.order:
            self.gather(idx)
        try:
            yield
        finally:
            for idx in self.order:
                self.release(idx)
            self.peak_live = peak
