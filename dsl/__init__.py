"""soapstone.dsl: the .par language front end (parse, check, IR) and the CLI.

Public API:
    load(path_or_text, dims=None, layers=None) -> Spec   spec.models, spec.parallels, ...
    layer(...)                              decorator registering a custom layer (default registry)
    LayerRegistry                           built-in + custom layers, passed to load(layers=)
    SpecError, Diagnostic                   every spec problem, with file:line:col
    format_model(model), format_parallel(par)  the IR as text (what `soapstone show` prints)
    ir                                      the IR classes

Nothing here imports torch.
"""

from . import ir
from .custom import LayerRegistry, layer
from .errors import Diagnostic, SpecError
from .irtext import format_model, format_parallel
from .spec import Spec, load

__all__ = ["Diagnostic", "LayerRegistry", "Spec", "SpecError", "format_model", "format_parallel",
           "ir", "layer", "load"]
