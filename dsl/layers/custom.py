"""Custom layers written in Python: a named-dim signature plus a torch function over local shards.

    @soapstone.dsl.layer(
        "swiglu",
        inputs=["x[..., hidden]"],
        params={"w1": ("[hidden, ffn]", "normal(0.02)"),
                "w3": ("[hidden, ffn]", "normal(0.02)"),
                "w2": ("[ffn, hidden]", "normal(0.02)")},
        output="[..., hidden]",
        dims=("ffn",),
        shard={"ffn": "partial"},
    )
    def swiglu(x, w1, w3, w2): ...

Patterns name *dim variables*: `hidden` above binds to whatever dim x has last; each name in
`dims` binds, in order, to a dim name passed positionally after the inputs (`swiglu(x, ffn)`).
A leading `...` matches any number of leading dims and reappears in `output`. `shard` lists the
dim variables that may be split over a mesh axis and what the output then is: "split" (split the
same way; the dim must be in the output) or "partial" (each rank's output is a partial sum).
Leading `...` dims are always freely splittable. The function receives LOCAL shards: the input
tensors, then the params in declared order, and returns the output tensor.

A spec calling the layer gets one IR op of kind `custom:<name>` whose args are the inputs then
the params, and whose attrs map each dim variable to the model dim it bound
(`(("ffn", "ffn"), ("hidden", "hidden"))`), and whose `shard` says how each bound model dim may
split (`(("ffn", "partial"),)`): the compiler reads the op, never the registry. Nothing here
imports torch; a spec never runs code by itself: layers are registered by importing a plugin
(`--plugin module_or_file.py`).

Layers live in a `LayerRegistry` (the built-ins plus the custom layers added to it) that
`load(path, layers=registry)` checks a spec against. The decorator and `load_plugin` fill the
default registry, `DEFAULT`, which `load` uses when given none; `LayerRegistry.layer` and
`load_plugin(ref, layers=registry)` fill another one.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from soapstone.comm.errors import UserError
from soapstone.dsl.layers.registry import LAYERS, LayerDef

_PATTERN = re.compile(r"^\s*(?:([A-Za-z_]\w*)\s*)?\[(.*)\]\s*$")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")
_INITS = re.compile(r"^(normal\([0-9.eE+-]+\)|uniform\([0-9.eE+-]+\)|zeros|ones)$")
SHARD_KINDS = ("split", "partial")


class LayerError(UserError, ValueError):
    """A custom layer's definition that cannot work (a plugin's @layer): names the layer, what
    is wrong and the fix (exit 2; the plugin's file and line are added where it is loaded)."""


@attrs.frozen
class Pattern:
    """`x[..., hidden]`: an optional name, whether it starts with `...`, then dim variables."""

    name: str
    ellipsis: bool
    dims: tuple[str, ...]

    def __str__(self) -> str:
        inner = (["..."] if self.ellipsis else []) + list(self.dims)
        return f"{self.name}[{', '.join(inner)}]"


@attrs.frozen
class CustomParam:
    """A weight of a custom layer: its shape pattern and init."""

    name: str
    shape: Pattern
    init: str


@attrs.frozen
class CustomLayer:
    """The frozen definition the compiler uses: `fn` is the torch implementation."""

    name: str
    inputs: tuple[Pattern, ...]
    params: tuple[CustomParam, ...]
    output: Pattern
    dims: tuple[str, ...]
    shard: tuple[tuple[str, str], ...]
    fn: Callable | None = attrs.field(default=None, eq=False)

    @property
    def kind(self) -> str:
        """The IR op kind of a call to this layer."""
        return f"custom:{self.name}"

    def shard_mode(self, dim_var: str) -> str | None:
        """"split", "partial", or None (may not be split) for one dim variable."""
        return dict(self.shard).get(dim_var)


def parse_pattern(text: str, what: str) -> Pattern:
    """`x[..., hidden]` -> Pattern (LayerError naming `what` if malformed)."""
    m = _PATTERN.match(text)
    if not m:
        raise LayerError(f"{what}: {text!r} is not a shape pattern like 'x[..., hidden]'")
    parts = [p.strip() for p in m.group(2).split(",") if p.strip()]
    ellipsis = bool(parts) and parts[0] == "..."
    if ellipsis:
        parts = parts[1:]
    for p in parts:
        if not _IDENT.match(p):
            raise LayerError(f"{what}: {p!r} in {text!r} is not a dim name ('...' only leads)")
    if len(set(parts)) != len(parts):
        raise LayerError(f"{what}: a dim repeats in {text!r}; name each dim once")
    return Pattern(m.group(1) or "", ellipsis, tuple(parts))


def define(
    name: str,
    *,
    inputs: Sequence[str],
    params: Mapping[str, tuple[str, str]] | None = None,
    output: str,
    dims: Sequence[str] = (),
    shard: Mapping[str, str] | None = None,
    fn: Callable | None = None,
) -> CustomLayer:
    """A custom layer's checked definition (LayerError if the signature is malformed)."""
    if not isinstance(name, str) or not _IDENT.match(name):
        raise LayerError(f"layer name {name!r} is not an identifier; use letters, digits and _")
    # listed first, as a generator would be spent by the check; a lone string stays one (it
    # is a sequence of one-letter patterns or dims: say so, not what it makes)
    inputs, dims = (list(v) if isinstance(v, Iterable) and not isinstance(v, str) else v
                    for v in (inputs, dims))
    for arg, value in (("inputs", inputs), ("dims", dims)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise LayerError(f"layer {name}: {arg}={value!r}; give a list of strings, e.g. "
                             + ("inputs=['x[..., hidden]']" if arg == "inputs"
                                else "dims=['ffn']"))
    if not isinstance(params or {}, Mapping) or not all(
            isinstance(v, tuple | list) and len(v) == 2 and all(isinstance(x, str) for x in v)
            for v in (params or {}).values()):
        raise LayerError(f"layer {name}: params={params!r}; give a dict of name -> (shape, "
                         "init), e.g. {'w': ('[hidden, ffn]', 'normal(0.02)')}")
    if name in LAYERS:
        raise LayerError(f"{name!r} is a built-in layer; give yours another name")
    ins = tuple(parse_pattern(p, f"layer {name} input") for p in inputs)
    if not ins:
        raise LayerError(f"layer {name}: needs at least one input; give inputs=['x[...]']")
    for i, p in enumerate(ins):
        if not p.name:
            ins = ins[:i] + (attrs.evolve(p, name=f"in{i}"),) + ins[i + 1 :]
    bound: set[str] = set(dims)
    for p in ins:
        bound.update(p.dims)
    ps = []
    for pname, spec in (params or {}).items():
        shape_text, init = spec
        shape = parse_pattern(shape_text, f"layer {name} param {pname}")
        if shape.ellipsis:
            raise LayerError(f"layer {name} param {pname}: params cannot use '...'; name "
                             "every dim")
        if not _INITS.match(init):
            raise LayerError(f"layer {name} param {pname}: init {init!r} is not one of "
                             "normal(STD), uniform(BOUND), zeros, ones")
        ps.append(CustomParam(pname, shape, init))
        bound.update(shape.dims)
    out = parse_pattern(output, f"layer {name} output")
    if out.ellipsis and not any(p.ellipsis for p in ins):
        raise LayerError(f"layer {name}: output uses '...' but no input does; drop it or "
                         "lead an input with it")
    unbound = [d for d in out.dims if d not in bound]
    for p in ps:
        unbound += [d for d in p.shape.dims if d not in bound]
    if unbound:
        raise LayerError(f"layer {name}: dims {unbound} are bound by no input and no `dims` arg;"
                         " add them to an input or to dims=[...]")
    free = [d for p in ps for d in p.shape.dims if d not in set(dims) and
            not any(d in i.dims for i in ins)]
    if free:
        raise LayerError(f"layer {name}: param dims {free} must come from an input or `dims`")
    sh = dict(shard or {})
    for d, mode in sh.items():
        if mode not in SHARD_KINDS:
            raise LayerError(f"layer {name}: shard[{d!r}] must be 'split' or 'partial'")
        if d not in bound:
            raise LayerError(f"layer {name}: shard names {d!r}, which is no dim of the layer; "
                             "name a dim of its inputs or params")
        if mode == "split" and d not in out.dims:
            raise LayerError(f"layer {name}: shard[{d!r}] = 'split' needs {d!r} in the output")
    return CustomLayer(name, ins, tuple(ps), out, tuple(dims), tuple(sorted(sh.items())), fn)


def check_function(layer: CustomLayer, fn) -> None:
    """LayerError unless `fn` can be called as `layer`'s function: with its inputs, then its
    params, positionally. Checked at the decorator, where a wrong signature is written: at the
    first forward it would be a TypeError from deep inside the runtime, mid-step."""
    args = [p.name for p in layer.inputs] + [p.name for p in layer.params]
    want = f"{layer.name}({', '.join(args)})"
    if not callable(fn):
        raise LayerError(f"layer {layer.name}: @layer decorates {type(fn).__name__} {fn!r}; "
                         f"decorate a function `def {want}: ...`")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: nothing to check against
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise LayerError(f"layer {layer.name}: its function {getattr(fn, '__name__', fn)}"
                         f"{sig} cannot take the layer's {len(args)} arguments ({e}); the "
                         f"runtime calls it as `{want}`: its inputs, then its params in "
                         "declared order") from None


@attrs.define
class LayerRegistry:
    """The layers a spec may call: the built-ins and the custom layers added here."""

    _custom: dict[str, CustomLayer] = attrs.field(factory=dict, init=False)

    def builtin(self, name: str) -> LayerDef | None:
        """The built-in layer `name`, or None."""
        return LAYERS.get(name)

    def custom(self, name: str) -> CustomLayer | None:
        """The custom layer `name`, or None."""
        return self._custom.get(name)

    def names(self) -> list[str]:
        """Every layer a spec may call: the built-ins, then the custom layers."""
        return list(LAYERS) + list(self._custom)

    def add(self, layer: CustomLayer) -> None:
        """Add (or replace) a custom layer."""
        if layer.name in LAYERS:
            raise LayerError(f"{layer.name!r} is a built-in layer; give yours another name")
        self._custom[layer.name] = layer

    def remove(self, name: str) -> None:
        """Forget a custom layer (no error if there is none)."""
        self._custom.pop(name, None)

    def get(self, name: str) -> CustomLayer:
        """The custom layer `name` (KeyError if none)."""
        return self._custom[name]

    def registered(self) -> dict[str, CustomLayer]:
        """The custom layers, by name."""
        return dict(self._custom)

    def functions(self) -> dict[str, Callable]:
        """Each custom layer's torch function, by name: the runtime's `custom=` argument."""
        return {name: layer.fn for name, layer in self._custom.items()}

    def layer(self, name: str, **signature) -> Callable[[Callable], Callable]:
        """A decorator adding a custom layer here (the signature as `define`'s); returns `fn`."""

        checked = define(name, **signature)  # a bad signature fails at the decorator line

        def register(fn: Callable) -> Callable:
            check_function(checked, fn)
            defn = attrs.evolve(checked, fn=fn)
            fn.__soapstone_layer__ = defn  # lets load_plugin find it in an imported module
            self.add(defn)
            return fn

        return register


DEFAULT = LayerRegistry()  # what `@layer` and `--plugin` fill, and `load` checks against

# The registry `@layer` adds to: DEFAULT, or the one a load_plugin call is importing into.
_TARGET: contextvars.ContextVar[LayerRegistry] = contextvars.ContextVar("target",
                                                                         default=DEFAULT)


def layer(name: str, **signature) -> Callable[[Callable], Callable]:
    """Register a custom layer (a decorator; the signature as `define`'s keyword arguments, see
    the module docstring). Returns `fn` unchanged."""
    return _TARGET.get().layer(name, **signature)


def get(name: str) -> CustomLayer:
    """The custom layer `name` of the default registry (KeyError if none)."""
    return DEFAULT.get(name)


def registered() -> dict[str, CustomLayer]:
    """The default registry's custom layers, by name."""
    return DEFAULT.registered()


def unregister(name: str) -> None:
    """Forget a custom layer of the default registry (tests)."""
    DEFAULT.remove(name)


def load_plugin(ref: str, layers: LayerRegistry | None = None) -> None:
    """Import a plugin (a module name or a path to a .py file); its layers go into `layers`
    (the default registry when None)."""
    target = DEFAULT if layers is None else layers
    token = _TARGET.set(target)
    try:
        module = _import(ref)
    finally:
        _TARGET.reset(token)
    # a module imported before ran its decorators then: take its layers from it
    for obj in vars(module).values():
        defn = getattr(obj, "__soapstone_layer__", None)
        if isinstance(defn, CustomLayer):
            target.add(defn)


def _import(ref: str):
    if ref.endswith(".py") or "/" in ref or Path(ref).is_file():
        path = Path(ref).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"plugin file {ref} does not exist")
        modname = "soapstone_plugin_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(modname, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(ref)
