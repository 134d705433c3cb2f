"""House rules that the source itself can be checked for, read statically (ast, no imports):
no import circles between soapstone's modules, no private name used outside its own file, no
module over 600 lines, no room over 15 modules (the tests' folders too), every package in the
wheel, a docstring on every public function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"dsl": "soapstone.dsl", "shard": "soapstone.shard", "comm": "soapstone.comm",
         "grammar": "soapstone.grammar"}
# The C halves of Python modules (setup.py's extensions): private by the usual convention, and
# imported only by the Python module each serves.
EXTENSIONS = {"soapstone.comm.observe._flight_ring", "soapstone.comm.observe._tensor_reader"}
MAX_LINES = 600
MAX_MODULES = 15  # per folder, its __init__ apart: past it, a concept gets a sub-room
# Over MAX_LINES, being split by the engineers who own them (remove each when it is done).
TOO_LONG_FOR_NOW: set[str] = set()
# Benchmarks whose public functions still lack their one-line docstrings (remove each when done).
UNDOCUMENTED_FOR_NOW = {
    "bench/bench_abort.py", "bench/bench_activations.py", "bench/bench_async_save.py",
    "bench/bench_ckpt.py", "bench/bench_dp.py", "bench/bench_executor.py", "bench/bench_hf.py",
    "bench/bench_memory.py", "bench/bench_parse.py", "bench/bench_pipe.py",
    "bench/bench_pipe_memory.py", "bench/bench_plan.py", "bench/bench_plan_published.py",
    "bench/bench_plan_vs_run.py", "bench/bench_recompute.py", "bench/bench_selective.py",
    "bench/bench_token_data.py", "bench/bench_tp.py", "bench/bench_verify.py",
    "bench/bench_watchdog.py", "bench/bench_zb.py", "bench/bench_zbv.py"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for room, package in ROOMS.items():
        for f in sorted((ROOT / room).rglob("*.py")):
            parts = list(f.relative_to(ROOT / room).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if init else parts)])] = (f, init)
    return out


MODULES = _modules()


def _base(name: str, init: bool, node: ast.ImportFrom) -> str:
    """The module an ImportFrom reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = name.split(".")[: len(name.split(".")) - (0 if init else 1)]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(name: str) -> list[tuple[str, int, str | None]]:
    """(module imported, line, the name taken from it or None) for every import statement of
    module `name`, wherever it stands: at the top, under TYPE_CHECKING or inside a function.
    A function's import runs later than the module's, but the modules still depend on each
    other both ways, which is the circle the house forbids (issue 26: communicator <-> debug
    and tasks <-> token_memmap were circles only through function imports)."""
    f, init = MODULES[name]
    out = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, init, node)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, node.lineno, None) if sub in MODULES or sub in EXTENSIONS
                           else (base, node.lineno, a.name))
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    circles = _circles(graph)
    assert not circles, "import circles (each a set of modules that import each other):\n" + \
        "\n".join("  " + " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_crosses_a_file():
    """No `from X import _name` and no `module._name` of another soapstone module."""
    bad = []
    for name, (f, _) in MODULES.items():
        tree = ast.parse(f.read_text(), str(f))
        modules = {}  # local name -> the soapstone module it is bound to
        for t, line, taken in _imports(name):
            if not t.startswith("soapstone."):
                continue
            private = taken if taken is not None else t.rsplit(".", 1)[-1]
            if private.startswith("_") and not private.startswith("__") and \
                    t not in EXTENSIONS and (taken is not None or t != name):
                bad.append(f"{f.relative_to(ROOT)}:{line}: imports {private} from "
                           f"{t if taken is not None else t.rsplit('.', 1)[0]}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _base(name, MODULES[name][1], node)
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        modules[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        modules[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in modules and node.attr.startswith("_") and \
                    not node.attr.startswith("__"):
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: uses "
                           f"{modules[node.value.id]}.{node.attr}")
    assert not bad, "private names used outside their file:\n  " + "\n  ".join(bad)


def test_no_module_over_600_lines():
    long = {str(f.relative_to(ROOT)): n for f, _ in MODULES.values()
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= TOO_LONG_FOR_NOW, f"modules over {MAX_LINES} lines: {long}"


def test_no_room_over_15_modules():
    counts: dict[str, int] = {}
    for f, init in MODULES.values():
        if not init:
            room = str(f.parent.relative_to(ROOT))
            counts[room] = counts.get(room, 0) + 1
    big = {room: n for room, n in counts.items() if n > MAX_MODULES}
    assert not big, f"rooms over {MAX_MODULES} modules (split one concept into a sub-room): {big}"


def test_no_room_of_the_tests_over_15_modules():
    """The suite mirrors the package room by room, so its folders keep the same bound."""
    counts: dict[str, int] = {}
    for f in (ROOT / "tests").rglob("*.py"):
        room = str(f.parent.relative_to(ROOT))
        counts[room] = counts.get(room, 0) + 1
    big = {room: n for room, n in counts.items() if n > MAX_MODULES}
    assert not big, f"test folders over {MAX_MODULES} modules (give a room its folder): {big}"


def test_the_wheel_lists_every_package():
    """pyproject's package list is every folder of a room that holds an __init__.py: a package
    left out is missing from the wheel (the H100's gpu-check found shard.plan.schedules so)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    packages = {name for name, (_, init) in MODULES.items() if init}
    assert listed == packages, (f"missing from pyproject: {sorted(packages - listed)}; "
                                f"listed but no package: {sorted(listed - packages)}")


def _public_functions(f: Path):
    """A file's public module-level functions and public methods of its public classes."""
    tree = ast.parse(f.read_text(), str(f))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from (k for k in node.body if isinstance(k, ast.FunctionDef))
        elif isinstance(node, ast.FunctionDef):
            yield node


def test_public_functions_have_docstrings():
    """Module-level public functions in the rooms (a class's methods there are often a
    grammar's or a protocol's callbacks) and in bench/ (with their classes' methods) each have
    a docstring."""
    bench = sorted((ROOT / "bench").glob("*.py"))
    files = [f for f, _ in MODULES.values()] + bench
    bad = [f"{f.relative_to(ROOT)}:{node.lineno}: {node.name}" for f in files
           if str(f.relative_to(ROOT)) not in UNDOCUMENTED_FOR_NOW
           for node in _public_functions(f)
           if (f in bench or node.col_offset == 0) and not node.name.startswith("_")
           and ast.get_docstring(node) is None]
    assert not bad, "public functions without a docstring:\n  " + "\n  ".join(bad)
