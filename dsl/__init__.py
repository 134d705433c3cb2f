"""soapstone.dsl: the .par language front end (parse, check, IR) and the CLI.

Public API:
    load(path_or_text, dims=None) -> Spec   spec.models, spec.parallels, spec.model(), ...
    layer(...)                              decorator registering a custom layer
    SpecError, Diagnostic                   every spec problem, with file:line:col
    format_model(model), format_parallel(par)  the IR as text (what `soapstone show` prints)
    ir                                      the IR classes

Nothing here imports torch.
"""

from . import ir
from .custom import layer
from .errors import Diagnostic, SpecError
from .irtext import format_model, format_parallel
from .spec import Spec, load

__all__ = ["Diagnostic", "Spec", "SpecError", "format_model", "format_parallel", "ir", "layer",
           "load"]
