"""`load`: a .par file (or text) -> Spec, with includes resolved and everything checked."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import Diagnostic, SpecError, did_you_mean
from soapstone.dsl.lang.parser import Sources, parse
from soapstone.dsl.layers.custom import DEFAULT, LayerRegistry
from soapstone.dsl.model.checker import check_model
from soapstone.dsl.model.ir import Model, Parallel
from soapstone.dsl.model.parallel_checker import check_parallel
from soapstone.shard.plan.sizes import MAX_DIM


@attrs.define
class Spec:
    """A loaded spec: checked models and parallel blocks by name (in file order)."""

    file: str
    models: dict[str, Model]
    parallels: dict[str, Parallel]
    diagnostics: list[Diagnostic] = attrs.field(factory=list)
    # layouts that are sound at the file's own dims but cannot take the --dim overrides:
    # left out of `parallels`, kept with their reasons (what `parallel(name)` raises)
    refused: dict[str, list[Diagnostic]] = attrs.field(factory=dict)

    def check(self) -> Spec:
        """Raise SpecError if anything in the spec is invalid; return self otherwise."""
        if self.diagnostics:
            raise SpecError(self.diagnostics)
        return self

    def model(self, name: str | None = None) -> Model:
        """The model `name`, or the only model when name is None."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            if not self.models:
                raise SpecError([Diagnostic(self.file, 0, 0, "the spec defines no model")])
            raise SpecError([Diagnostic(self.file, 0, 0, "the spec defines several models",
                                        f"pick one: {', '.join(self.models)}")])
        if name not in self.models:
            raise SpecError([Diagnostic(self.file, 0, 0, f"no model named '{name}'",
                                        did_you_mean(name, self.models)
                                        or f"models: {', '.join(self.models) or '(none)'}")])
        return self.models[name]

    def parallel(self, name: str) -> Parallel:
        """The parallel block `name` (a refused one: SpecError with its reasons)."""
        if name in self.refused:
            raise SpecError(self.refused[name])
        if name not in self.parallels:
            near = did_you_mean(name, self.parallels) if isinstance(name, str) else None
            raise SpecError([Diagnostic(self.file, 0, 0, f"no parallel block named '{name}'",
                                        near or
                                        f"parallel blocks: {', '.join(self.parallels) or '(none)'}"
                                        )])
        return self.parallels[name]

    def refusals(self) -> list[str]:
        """One line per refused layout: its name and the first reason, at its place."""
        lines = []
        for name, diags in self.refused.items():
            d = diags[0]
            where = f"{d.file}:{d.line}:{d.col}: " if d.line > 0 else ""
            more = f" (and {len(diags) - 1} more)" if len(diags) > 1 else ""
            lines.append(f"note: layout {name} cannot take these --dim sizes, left out: "
                         f"{where}{d.message}{more}")
        return lines


def _is_path(src) -> bool:
    if isinstance(src, os.PathLike):
        return True
    return "\n" not in src and "{" not in src and (src.endswith(".par") or os.path.isfile(src))


def load(src: str | os.PathLike, dims: dict[str, int] | None = None, *,
         filename: str | None = None, check: bool = True,
         layers: LayerRegistry | None = None) -> Spec:
    """Parse and check a spec from a path or from its text.

    `dims` overrides dim sizes by name (an unknown name is an error). `layers` are the layers
    it may call (the default registry, which `@layer` and `--plugin` fill, when None). With
    check=False the diagnostics are kept in `spec.diagnostics` (and `spec.check()` raises
    them) instead of raising at once; models and parallel blocks with errors are left out.
    A parallel block that checks at the file's dims but not with `dims` is no error: it is
    left out into `spec.refused` with its reasons (`spec.refusals()`, one line each), so the
    file's other layouts go on; `spec.parallel(name)` of it raises them."""
    layers = DEFAULT if layers is None else layers
    sources = Sources()
    diags: list[Diagnostic] = []
    files: list[ast.File] = []
    if _is_path(src):
        path = Path(src)
        file = filename or str(src)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError([Diagnostic(file, 0, 0, f"cannot read the spec: {e}")]) from None
        base = path.resolve()
    else:
        text = str(src)
        file = filename or "<string>"
        base = Path.cwd() / "<string>"
    _read(text, file, base, sources, diags, files, stack=[base], seen={base})
    models: dict[str, Model] = {}
    parallels: dict[str, Parallel] = {}
    mdefs: dict[str, ast.ModelDef] = {}
    pdefs: dict[str, ast.ParallelDef] = {}
    failed: set[str] = set()
    refused: dict[str, list[Diagnostic]] = {}
    overrides: dict[str, int] = {}
    for name, value in (dims or {}).items():  # bad values are reported once, up front,
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:  # and dropped
            diags.append(Diagnostic(file, 0, 0, f"--dim {name}={value}: dim sizes are "
                                    "integers >= 1", f"e.g. --dim {name}=16"))
        elif value > MAX_DIM:
            diags.append(Diagnostic(file, 0, 0, f"--dim {name}={value}: torch's sizes are "
                                    f"64-bit: at most {MAX_DIM}", f"e.g. --dim {name}=16"))
        else:
            overrides[name] = value
    used: set[str] = set()
    for f in files:
        for item in f.items:
            if isinstance(item, ast.ModelDef):
                if item.name in mdefs:
                    first = mdefs[item.name].loc
                    diags.append(sources.diag(item.loc, f"model '{item.name}' is defined twice",
                                              f"first defined at {first}"))
                    continue
                mdefs[item.name] = item
                model, ds = check_model(item, sources, overrides, used, layers)
                diags += ds
                if model is None:
                    failed.add(item.name)
                else:
                    models[item.name] = model
    for name in overrides:
        if name not in used:
            known = {d for m in mdefs.values() for s in m.body if isinstance(s, list)
                     for d in (x.name for x in s)}
            diags.append(Diagnostic(file, 0, 0, f"--dim {name}: no model declares a dim '{name}'",
                                    did_you_mean(name, known)))
    for f in files:
        for item in f.items:
            if isinstance(item, ast.ParallelDef):
                if item.name in pdefs:
                    first = pdefs[item.name].loc
                    diags.append(sources.diag(item.loc,
                                              f"parallel block '{item.name}' is defined twice",
                                              f"first defined at {first}"))
                    continue
                pdefs[item.name] = item
                if item.model in failed:
                    continue
                if item.model not in models:
                    diags.append(sources.diag(item.model_loc, f"unknown model '{item.model}'",
                                              did_you_mean(item.model, mdefs)))
                    continue
                par, ds = check_parallel(item, models[item.model], sources)
                if ds and overrides and _sound_at_file_dims(item, mdefs[item.model], sources,
                                                            layers):
                    refused[item.name] = ds  # the overrides' fault: the other layouts go on
                    continue
                diags += ds
                if par is not None:
                    parallels[item.name] = par
    spec = Spec(file, models, parallels, diags, refused)
    if check:
        spec.check()
    return spec


def _sound_at_file_dims(pdef: ast.ParallelDef, mdef: ast.ModelDef, sources,
                        layers: LayerRegistry) -> bool:
    """Whether the layout checks without the --dim overrides (the file's own dims)."""
    model, ds = check_model(mdef, sources, {}, set(), layers)
    return model is not None and not ds and not check_parallel(pdef, model, sources)[1]


def _read(text, file, base: Path, sources, diags, files, stack, seen) -> None:
    try:
        tree = parse(text, file, sources)
    except SpecError as e:
        diags += e.diagnostics
        return
    for item in tree.items:
        if not isinstance(item, ast.Include):
            continue
        target = (base.parent / item.path).resolve()
        shown = os.path.relpath(target) if not os.path.isabs(item.path) else item.path
        if target in stack:
            chain = " -> ".join([p.name for p in stack[stack.index(target):]] + [target.name])
            diags.append(sources.diag(item.loc, f"include cycle: {chain}",
                                      "a file cannot include itself, even indirectly"))
            continue
        if target in seen:
            continue  # already included through another file
        try:
            sub = target.read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = "no such file" if isinstance(e, FileNotFoundError) else str(e)
            diags.append(sources.diag(item.loc, f"cannot include '{item.path}': {reason}",
                                      f"includes are relative to {base.parent}"))
            continue
        seen.add(target)
        _read(sub, shown, target, sources, diags, files, stack + [target], seen)
    files.append(tree)

