"""Old import paths of modules that moved rooms: they keep working for one release, with a
DeprecationWarning that names the new path.

A package lists its moved modules once, in its `__init__.py`:

    __getattr__ = moved.keep_old_paths(__name__, {"executor": "runtime.executor"})

Then `import soapstone.shard.executor`, `from soapstone.shard.executor import Executor` and
`soapstone.shard.executor` as an attribute all reach soapstone.shard.runtime.executor. Nothing
here imports torch: the table is names, and a module is imported only when it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable

REMOVED_IN = "0.3"
_MISSING = object()  # getattr's default: no such name


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands back the module at its new path."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved

    def find_spec(self, name, path=None, target=None):
        """A spec for an old path; None for every other name."""
        if name not in self.moved:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        """The module at the new path, imported under its own name (one module, two names)."""
        new = self.moved[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in soapstone {REMOVED_IN}",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module has run already."""


def keep_old_paths(package: str, moved: dict[str, str],
                   names: Callable[[str], object] | None = None) -> Callable[[str], object]:
    """Serve `package.OLD` from `package.NEW` for each OLD -> NEW (relative dotted paths);
    returns the package's `__getattr__`. `names`, if given, answers any other attribute."""
    table = {f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()}
    sys.meta_path.append(MovedModules(table))

    def __getattr__(attr: str):
        if f"{package}.{attr}" in table:
            return importlib.import_module(f"{package}.{attr}")
        if names is not None:
            return names(attr)
        raise AttributeError(f"module {package!r} has no attribute {attr!r}")

    return __getattr__


def names_from(package: str, *modules: str) -> Callable[[str], object]:
    """A package's `__getattr__` that lends the public names of its `modules` (the first that
    has the name), imported on first use (a module that became a package of the same name
    keeps its names this way, also those that moved to a module of their own)."""

    def __getattr__(attr: str):
        if importlib.util.find_spec(f"{package}.{attr}") is not None:  # a module of the package
            return importlib.import_module(f"{package}.{attr}")
        if not attr.startswith("_"):
            for module in modules:
                found = getattr(importlib.import_module(f"{package}.{module}"), attr, _MISSING)
                if found is not _MISSING:
                    return found
        raise AttributeError(f"module {package!r} has no attribute {attr!r}")

    return __getattr__
