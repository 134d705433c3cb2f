"""A parameter's initial values, drawn for one box (a rank's shard) without the whole tensor.

Each scheme of ParamSpec.init (`zeros`, `ones`, `normal(STD)`, `uniform(BOUND)`) is a function
of (seed, parameter name, flat index) through the counter-based generator of counter_rng.py, so
a rank draws exactly its shard, in time and memory proportional to it, and the values equal
the same positions of the single-rank model's tensor bit for bit.
"""

from __future__ import annotations

import torch

from soapstone.shard.plan.dtypes import DTYPES
from soapstone.shard.plan.program import ParamSpec
from soapstone.shard.runtime.init.counter_rng import draw, key_of

TORCH_DTYPES = {name: getattr(torch, d.torch_name) for name, d in DTYPES.items()}


def init_shard(p: ParamSpec, seed: int, box: tuple[slice, ...], device=None) -> torch.Tensor:
    """The initial values of `p` inside `box` (one slice per dim of its global shape)."""
    dtype = TORCH_DTYPES[p.dtype]
    shape = tuple(s.stop - s.start for s in box)
    if p.init == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    if p.init == "ones":
        return torch.ones(shape, dtype=dtype, device=device)
    kind, _, arg = p.init.partition("(")
    if kind not in ("normal", "uniform"):  # not user input: the checkers admit no other init
        raise ValueError(f"parameter {p.name}: unknown init {p.init!r}")
    return draw(kind, key_of(seed, p.name), p.shape, box, float(arg.rstrip(")")), dtype,
                device)


def empty_shard(p: ParamSpec, box: tuple[slice, ...], device=None) -> torch.Tensor:
    """Storage for `p` inside `box`, not drawn: for weights a file fills right after (a
    draw would cost the time and, for a layout's first touch, the memory of a whole init)."""
    return torch.empty(tuple(s.stop - s.start for s in box), dtype=TORCH_DTYPES[p.dtype],
                       device=device)


def init_full(p: ParamSpec, seed: int, device=None) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter: a function of (seed, name) only."""
    return init_shard(p, seed, tuple(slice(0, n) for n in p.shape), device)
