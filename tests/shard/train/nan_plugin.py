"""A --plugin for tests/shard/train/test_nonfinite.py: examples/swiglu.par's `swiglu` layer
(the example's math) whose output is NaN at one call on one world rank, as a bad batch would
make it there. SOAPSTONE_TEST_NAN=RANK:CALL poisons call number CALL (1-based, counting that
rank's forward calls of the layer: examples/swiglu.par calls it twice a step) on world rank
RANK only; the other ranks learn of it only through the collectives, so they must still
decide alike."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from soapstone.dsl.layers.custom import LayerRegistry, load_plugin

RANK, CALL = (int(x) for x in os.environ.get("SOAPSTONE_TEST_NAN", "-1:0").split(":"))
_calls = [0]
# the example's layer (its signature and math), loaded aside and wrapped below
_example = LayerRegistry()
load_plugin(str(Path(__file__).resolve().parents[3] / "examples/custom_layer.py"), _example)
_BASE = _example.get("swiglu")


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def swiglu(x, w1, w3, w2):
    """The example's swiglu; NaN at the poisoned call."""
    out = _BASE.fn(x, w1, w3, w2)
    if x.requires_grad or x.grad_fn is not None:  # a training forward, not an evaluation
        _calls[0] += 1
        if _rank() == RANK and _calls[0] == CALL:
            return out * float("nan")
    return out


# what `--plugin` registers (load_plugin takes the layers a module's functions carry)
swiglu.__soapstone_layer__ = attrs.evolve(_BASE, fn=swiglu)
