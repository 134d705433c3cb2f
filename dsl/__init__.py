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

from soapstone.comm import moved
from soapstone.dsl.lang.errors import Diagnostic, SpecError
from soapstone.dsl.lang.spec import Spec, load
from soapstone.dsl.layers.custom import LayerRegistry, layer
from soapstone.dsl.model import ir
from soapstone.dsl.model.irtext import format_model, format_parallel

__all__ = ["Diagnostic", "LayerRegistry", "Spec", "SpecError", "format_model", "format_parallel",
           "ir", "layer", "load"]

# modules that moved rooms (0.2): their old paths work until 0.3, with a DeprecationWarning
__getattr__ = moved.keep_old_paths(__name__, {
    "ast": "lang.ast",
    "build": "app.build",
    "checker": "model.checker",
    "custom": "layers.custom",
    "errors": "lang.errors",
    "golden_run": "app.golden_run",
    "hf": "interop.hf",
    "init_weights": "app.init_weights",
    "ir": "model.ir",
    "irtext": "model.irtext",
    "language_model": "model.language_model",
    "layout_proof": "compile.layout_proof",
    "lower": "compile.lower",
    "moe_layer": "layers.moe",
    "par_lexer": "lang.lexer",
    "parallel_checker": "model.parallel_checker",
    "parser": "lang.parser",
    "plan_search": "search.plan_search",
    "rules": "compile.rules",
    "run_checkpoints": "app.run_checkpoints",
    "show_text": "app.show_text",
    "spec": "lang.spec",
    "stages": "compile.stages",
})
