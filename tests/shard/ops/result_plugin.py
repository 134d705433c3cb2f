"""A --plugin for tests/shard/ops/test_custom_result.py: examples/swiglu.par's `swiglu` layer
(the example's math) whose function misbehaves on one world rank, as a buggy plugin would.
SOAPSTONE_TEST_RESULT=RANK:MODE picks the rank (-1: every rank) and what it does instead of
returning the example's float tensor: long, double (a tensor of the wrong dtype), none, tuple,
short (its last dim one shorter) or exit (raise SystemExit(3))."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from soapstone.dsl.layers.custom import LayerRegistry, load_plugin

_rank_text, MODE = os.environ.get("SOAPSTONE_TEST_RESULT", "-1:ok").split(":")
RANK = int(_rank_text)
# the example's layer (its signature and math), loaded aside and wrapped below
_example = LayerRegistry()
load_plugin(str(Path(__file__).resolve().parents[3] / "examples/custom_layer.py"), _example)
_BASE = _example.get("swiglu")


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def swiglu(x, w1, w3, w2):
    """The example's swiglu; on the chosen rank what MODE says instead."""
    out = _BASE.fn(x, w1, w3, w2)
    if RANK not in (-1, _rank()):
        return out
    if MODE == "exit":
        raise SystemExit(3)
    return {"long": lambda: out.long(), "double": lambda: out.double(), "none": lambda: None,
            "tuple": lambda: (out,), "short": lambda: out[..., :-1], "ok": lambda: out}[MODE]()


# what `--plugin` registers (load_plugin takes the layers a module's functions carry)
swiglu.__soapstone_layer__ = attrs.evolve(_BASE, fn=swiglu)
