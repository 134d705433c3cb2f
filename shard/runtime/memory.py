"""Memory accounting: the bytes each rank holds for parameters, gradients and optimizer state,
measured from the tensors themselves (each storage counted once), not from a formula."""

from __future__ import annotations

import torch


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
