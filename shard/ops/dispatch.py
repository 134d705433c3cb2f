"""Running one primitive op: its record's kernel, or a custom layer's function. Apart from
kernels.py, which the families' kernels import, so that no family imports the registry that
imports it."""

from __future__ import annotations

import torch

from soapstone.shard.ops.custom import PREFIX, checked_result
from soapstone.shard.ops.kernels import OpFn, Shards
from soapstone.shard.ops.registry import RECORDS
from soapstone.shard.plan.program import Compute

REGISTRY: dict[str, OpFn] = {k: r.kernel for k, r in RECORDS.items() if r.kernel is not None}


def run_op(step: Compute, args: list[torch.Tensor], ctx: Shards, custom: dict) -> torch.Tensor:
    """Dispatch one Compute step to its implementation."""
    if step.kind.startswith(PREFIX):
        if step.kind not in custom:
            name = step.kind.split(":", 1)[1]
            raise KeyError(f"custom layer {name!r} has no implementation here: pass "
                           f"custom={{{name!r}: fn}} to ShardedModel (--plugin does it)")
        return checked_result(step, args, custom[step.kind](*args))
    fn = REGISTRY.get(step.kind)
    if fn is None:
        raise KeyError(f"no local implementation for primitive {step.kind!r}")
    return fn(step, args, ctx)
