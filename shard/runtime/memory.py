"""Memory accounting: the bytes each rank holds for parameters, gradients and optimizer state,
measured from the tensors themselves (each storage counted once), not from a formula; and
`LiveBytes`, the tensors a stretch of code allocates and still holds, with their peak."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # its only home in torch


def _add(seen: dict[int, int], t: torch.Tensor | None) -> None:
    if t is None or t.layout != torch.strided:
        return
    st = t.untyped_storage()
    if st.nbytes():
        seen[st.data_ptr()] = st.nbytes()


def memory_report(model, optimizer=None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: bytes this rank holds right now.

    params: the model's parameter storages plus fp32 masters kept apart (bf16 or ZeRO-3);
    grads: .grad tensors and the reducer's gradient buffers; optimizer: the update rule's state.
    A storage shared by two of these (a master that is a view of the flat params) counts once,
    under the first."""
    seen: dict[int, int] = {}
    for p in model.params.values():
        _add(seen, p.data)
    red = getattr(optimizer, "reducer", None)
    if red is not None:
        for b in red.buckets:
            _add(seen, b.flat_param)
            _add(seen, b.master)
        if red.provider is not None:
            for t in red.provider.full.values():
                _add(seen, t)
    params = sum(seen.values())
    grads_seen: dict[int, int] = {}
    for p in model.params.values():
        _add(grads_seen, p.grad)
    if red is not None:
        for b in red.buckets:
            for t in (b.full_grad, b.acc, b.grad_shard):
                _add(grads_seen, t)
    grads = sum(v for k, v in grads_seen.items() if k not in seen)
    opt = 0
    if optimizer is not None:
        opt_seen: dict[int, int] = {}
        for st in optimizer.state:
            for t in st.values():
                _add(opt_seen, t)
        opt = sum(v for k, v in opt_seen.items() if k not in seen and k not in grads_seen)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


class LiveBytes(TorchDispatchMode):
    """While active: the bytes of tensor storage allocated since it began and still alive
    (`live`), and their high-water mark (`peak`).

    Every op's outputs pass through this dispatch mode (forward, and backward, which autograd
    runs on the calling thread on CPU); an output whose storage is new (none of the op's
    inputs has it: not a view, not in place) is counted until CPython frees that storage, which
    a finalizer on torch's Python storage object (kept as long as the storage lives) reports.
    So the figures follow the tensors themselves, exactly and deterministically: no timing, no
    allocator or resident-memory noise, and buffers written outside torch (an MPI receive
    into a torch.empty) count from their allocation. Storage made before it began
    (parameters, the batch) is not counted; nor is a kernel's internal scratch, which never
    becomes a tensor."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.tracked: dict[int, int] = {}  # data pointer -> bytes of each storage counted
        # data pointer -> [pointer, id of the storage]: what its finalizer frees, moved when
        # the storage is resized in place; emptied storages wait in `parked` by id
        self.cells: dict[int, list] = {}
        self.parked: dict[int, list] = {}

    def __enter__(self):
        _METERS.add(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _METERS.discard(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors(out))
        if outs:
            given = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))
                     if t.layout == torch.strided}
            for t in outs:
                if t.layout == torch.strided:
                    self._count(t.untyped_storage(), given)
        return out

    def _count(self, st, given: set[int]) -> None:
        ptr, n = st.data_ptr(), st.nbytes()
        if n and ptr in self.tracked and ptr not in given:
            self._settle()  # its address may be one an unreported resize let go
        if not n or ptr in given or ptr in self.tracked:
            return
        cell = [ptr, id(st), weakref.ref(st)]
        self._hold(ptr, n, cell)
        weakref.finalize(st, self._free, cell)

    def _hold(self, ptr: int, n: int, cell: list, settle: bool = True) -> None:
        cell[0] = ptr
        self.tracked[ptr] = n
        self.cells[ptr] = cell
        self.live += n
        if self.live > self.peak and settle:
            self._settle()

    def _settle(self) -> None:
        """Follow storages resized in place that no one reported (a collective matmul's
        per-chunk outputs, emptied once their rows are copied out), before a new peak counts
        them."""
        for ptr, cell in list(self.cells.items()):
            st = cell[2]()
            if st is not None and (st.data_ptr() != ptr or st.nbytes() != self.tracked[ptr]):
                self._moved(st, ptr, settle=False)
        self.peak = max(self.peak, self.live)  # every storage followed: one grown counts

    def _moved(self, st, old: int, settle: bool = True) -> None:
        cell = self.cells.pop(old, None) if old else self.parked.pop(id(st), None)
        if cell is None:
            return
        if old:
            self.live -= self.tracked.pop(old)
        if st.nbytes():
            self._hold(st.data_ptr(), st.nbytes(), cell, settle)
        else:
            cell[0] = None
            self.parked[cell[1]] = cell

    def _free(self, cell: list) -> None:
        if cell[0] is None:
            self.parked.pop(cell[1], None)
            return
        self.live -= self.tracked.pop(cell[0])
        self.cells.pop(cell[0])


_METERS: weakref.WeakSet = weakref.WeakSet()  # the LiveBytes now active


def storage_resized(st, old: int) -> None:
    """Tell the active LiveBytes that storage `st` (at data pointer `old` before; 0 when it
    was empty) was resized in place: selective recompute empties and refills storage that
    autograd's saved tensors share, which no torch op reports."""
    for meter in list(_METERS):
        meter._moved(st, old)


def _tensors(x):
    """The tensors in an op's arguments or results (nested tuples, lists, dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
