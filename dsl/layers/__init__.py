"""Layers: the built-in ones (one module each), `moe`, and the registry custom layers join.

Importing this package registers every built-in layer in `LAYERS` (registry.py); a new
built-in layer is one module here, imported below.
"""

from soapstone.dsl.layers import (  # noqa: F401 - each registers its layers
    attention,
    elementwise,
    embedding,
    linear,
    loss,
    moe,
    norms,
    positions,
)
from soapstone.dsl.layers.registry import LAYERS, LayerDef

__all__ = ["LAYERS", "LayerDef"]
