"""Launch real MPI jobs from pytest, and run batches of test cases inside them.

Two halves in one file:
- pytest side: `run_mpi(n, args)` runs `mpiexec -n N <python> args...` under a timeout and
  returns an MPIResult; `run_cases(n, "tests/comm/comm_cases.py")` runs, in one launch (each
  process pays the torch import once), every `case_*` function of a module (or of several:
  a list) that declares world size n, and returns per-case, per-rank results. Each case
  declares its world sizes with `@ranks(2, 4)`; `case_sizes(path)` reads the declarations
  without importing the module (no torch at collection) and `case_params(path)` turns them
  into pytest parameters, noting the file and sizes a session will launch (`planned`), so
  that conftest's `comm_runs` launches every planned file of one world size together. A case
  without a declaration is an error, so none is silently left out.
- rank side: `python tests/support/mpirun.py CASES_FILE[,CASES_FILE...] OUT_DIR` is what each
  rank runs. For each file in turn it imports it and calls each case declared for its world
  size in file order, writes one JSON line per case to OUT_DIR/rank<R>.jsonl and prints
  `PASS|FAIL|SKIP name` per case; a file that fails to import fails its cases. A case raises
  `Skip` when it does not apply here for another reason (a backend, a device). A per-case
  watchdog (faulthandler) kills a rank that hangs, dumping its stack.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

SUPPORT = Path(__file__).resolve().parent  # importable by every case file: mpirun, measure, ...
ROOT = SUPPORT.parents[1]
CASE_TIMEOUT_S = float(os.environ.get("SOAPSTONE_CASE_TIMEOUT", "60"))


_PLANNED: dict[str, set[int]] = {}  # case file -> the world sizes this session's tests run it at
# case file -> the (test module, case, size) parameters that ask for it
_ASKED: dict[str, set[tuple[str, str, int]]] = {}


class Skip(Exception):
    """Raised by a case that does not apply here (its world sizes are declared, not skipped)."""


def case_key(cases_file: str | Path) -> str:
    """One name per case file, however the caller spells its path."""
    return str(Path(ROOT, cases_file).resolve())


def planned(n: int) -> list[str]:
    """The case files this session's collected tests run at world size n, in collection order."""
    return [f for f, sizes in _PLANNED.items() if n in sizes]


def keep_planned(chosen: set[tuple[str, str, int]]) -> None:
    """After collection: plan only the (test module, case, size) parameters left selected
    (-k, --lf, a node id), so a launch runs no file that no chosen test reads."""
    for f, asked in _ASKED.items():
        _PLANNED[f] = {n for (mod, case, n) in asked if (mod, case, n) in chosen}


def ranks(*sizes: int):
    """Declare the world sizes a case runs at: `@ranks(2, 4)` above `def case_...():`, in
    literal numbers (`case_sizes` reads them from the source; the case itself is unchanged)."""
    if not sizes or not all(isinstance(n, int) and n >= 1 for n in sizes):
        raise ValueError(f"@ranks takes world sizes >= 1, got {sizes}")
    return lambda case: case


# ---------------------------------------------------------------------------- pytest side --
def mpiexec() -> str | None:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


@attrs.define
class MPIResult:
    """What a launch did: exit code, the combined output, wall seconds, timed out or not."""

    n: int
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def report(self) -> str:
        """Everything every rank printed, for a failure message."""
        head = f"mpiexec -n {self.n} {' '.join(self.args)}: "
        head += "TIMED OUT" if self.timed_out else f"exit {self.returncode}"
        return f"{head} after {self.seconds:.1f}s\n--- stdout ---\n{self.stdout}\n" \
               f"--- stderr ---\n{self.stderr}"


def run_mpi(n: int, args: list[str], timeout: float = 120, env: dict | None = None,
            check: bool = False) -> MPIResult:
    """Run `mpiexec -n n <python> *args` from the repo root; never hangs past `timeout`.

    The python is sys.executable (so args usually start with a script or `-m mod`).
    check=True raises AssertionError with every rank's output unless the job succeeded.
    """
    launcher = mpiexec()
    if launcher is None and n != 1:
        raise RuntimeError("no mpiexec next to sys.executable nor on PATH; pip install mpich")
    # one rank needs no launcher: MPI initialises as a singleton
    cmd = ([launcher, "-n", str(n)] if launcher else []) + [sys.executable, *args]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # oversubscribed ranks must not fight for cores
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    t0 = time.monotonic()
    # own session, so a timeout can kill mpiexec and every rank it started
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(p.pid, 9)
        out, err = p.communicate()
    res = MPIResult(n, list(args), p.returncode, out, err, time.monotonic() - t0, timed_out)
    if check:
        assert res.ok, res.report()
    return res


@attrs.define
class CaseResults:
    """Per-case outcomes of one `run_cases` launch: `cases[name][rank] = (status, message)`
    for the first file; `by_file[case_key(file)]` likewise for each file it ran."""

    launch: MPIResult
    cases: dict[str, dict[int, tuple[str, str]]]
    by_file: dict[str, dict[str, dict[int, tuple[str, str]]]] = attrs.Factory(dict)

    def of(self, cases_file: str | Path) -> CaseResults | None:
        """The outcomes of one of the launch's files (None if it did not run that file)."""
        cases = self.by_file.get(case_key(cases_file))
        return None if cases is None else CaseResults(self.launch, cases, self.by_file)

    def check(self, name: str) -> None:
        """Assert case `name` passed on every rank; pytest.skip if every rank skipped it."""
        import pytest

        per_rank = self.cases.get(name, {})
        missing = [r for r in range(self.launch.n) if r not in per_rank]
        if missing:
            pytest.fail(f"case {name} reported nothing on ranks {missing} (crash or hang)\n"
                        + self.launch.report())
        bad = {r: m for r, (s, m) in per_rank.items() if s == "FAIL"}
        if bad:
            text = "\n".join(f"[rank {r}] {m}" for r, m in sorted(bad.items()))
            pytest.fail(f"case {name} failed at n={self.launch.n}:\n{text}")
        if all(s == "SKIP" for s, _ in per_rank.values()):
            pytest.skip(per_rank[0][1] or "not applicable at this size")


def case_sizes(cases_file: str | Path) -> dict[str, tuple[int, ...]]:
    """Each `case_*` function of a case module, in file order, with the world sizes its
    `@ranks(...)` declares (parsed, not imported). ValueError names a case without one."""
    tree = ast.parse(Path(ROOT, cases_file).read_text())
    sizes = {}
    for f in tree.body:
        if not (isinstance(f, ast.FunctionDef) and f.name.startswith("case_")):
            continue
        calls = [d for d in f.decorator_list if isinstance(d, ast.Call)
                 and getattr(d.func, "id", getattr(d.func, "attr", None)) == "ranks"]
        if len(calls) != 1:
            raise ValueError(f"{cases_file}:{f.lineno}: {f.name} must declare its world sizes "
                             f"once, e.g. @ranks(2, 4) (from mpirun import ranks)")
        sizes[f.name] = tuple(ast.literal_eval(a) for a in calls[0].args)
    return sizes


def case_names(cases_file: str | Path) -> list[str]:
    """The `case_*` functions of a case module, in file order (parsed, not imported)."""
    return list(case_sizes(cases_file))


def case_params(cases_file: str | Path, cases=None, sizes=None) -> list[tuple[str, int]]:
    """`(case, n)` for each case (of `cases`, default all) and each world size it declares (of
    `sizes`, default all): `@pytest.mark.parametrize("case,n", case_params(FILE))`."""
    declared = case_sizes(cases_file)
    unknown = sorted(set(cases or ()) - set(declared))
    if unknown:
        raise ValueError(f"{cases_file} has no cases {unknown}")
    params = [(c, n) for c, ns in declared.items() if cases is None or c in cases
              for n in ns if sizes is None or n in sizes]
    key = case_key(cases_file)
    if Path(key).is_relative_to(ROOT):  # the repo's case files (not a test's scratch one)
        module = sys._getframe(1).f_globals.get("__name__", "")  # the test module asking
        _PLANNED.setdefault(key, set()).update(n for _, n in params)
        _ASKED.setdefault(key, set()).update((module, c, n) for c, n in params)
    return params


def run_cases(n: int, cases_file: str | Path | list, timeout: float | None = None,
              env: dict | None = None) -> CaseResults:
    """Run every case of `cases_file` (path from the repo root; or a list of them, one after
    the other) that declares world size `n` on `n` ranks, in one launch. timeout: of the
    launch (default 180 s a file; each case has its own watchdog besides)."""
    files = [case_key(f) for f in (cases_file if isinstance(cases_file, list) else [cases_file])]
    with tempfile.TemporaryDirectory(prefix="soapstone-cases-") as out:
        args = [str(Path(__file__).resolve()), ",".join(files), out]
        launch = run_mpi(n, args, timeout=timeout or 180 * len(files), env=env)
        by_file: dict[str, dict[str, dict[int, tuple[str, str]]]] = {f: {} for f in files}
        for f in Path(out).glob("rank*.jsonl"):
            rank = int(f.stem[4:])
            for line in f.read_text().splitlines():
                row = json.loads(line)
                by_file[row["file"]].setdefault(row["case"], {})[rank] = \
                    (row["status"], row["message"])
    return CaseResults(launch, by_file[files[0]], by_file)


# ------------------------------------------------------------------------------ rank side --
def _rank_main(argv: list[str]) -> int:
    files, out_dir = argv[0].split(","), Path(argv[1])
    sys.path[:0] = [str(ROOT), str(SUPPORT)]
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with open(out_dir / f"rank{rank}.jsonl", "w") as log:
        for cases_file in files:
            _run_file(cases_file, rank, size, log)
    MPI.COMM_WORLD.Barrier()
    return 0


def _run_file(cases_file: str, rank: int, size: int, log) -> None:
    """Import one case file and run its cases declared for this world size (module doc)."""
    names = [name for name, sizes in case_sizes(cases_file).items() if size in sizes]
    # what a file sets for its own cases (SOAPSTONE_P2P, its sys.path) ends with them
    env, path = dict(os.environ), list(sys.path)
    try:
        _run_cases(cases_file, names, rank, log)
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


def _run_cases(cases_file: str, names: list[str], rank: int, log) -> None:
    """Import the case file and run `names`, one JSON line each (a failed import fails them,
    a `Skip` raised at import skips them)."""
    import faulthandler
    import importlib.util
    import traceback

    faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # its import too
    skip = None
    try:
        spec = importlib.util.spec_from_file_location(f"_cases_{Path(cases_file).stem}",
                                                      cases_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Skip as e:
        module, skip = None, str(e)
    except (Exception, SystemExit):  # noqa: BLE001 - any failure fails this file's cases only
        module, why = None, "importing the case file failed:\n" + traceback.format_exc()
    faulthandler.cancel_dump_traceback_later()
    for name in names:
        # a hung collective cannot be interrupted from Python: dump the stack and exit,
        # so mpiexec tears the job down and the report names the case
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            if skip is not None:
                raise Skip(skip)
            if module is None:
                raise AssertionError(why)
            getattr(module, name)()
            status, message = "PASS", ""
        except Skip as e:
            status, message = "SKIP", str(e)
        except Exception:
            status, message = "FAIL", traceback.format_exc()
        faulthandler.cancel_dump_traceback_later()
        log.write(json.dumps({"file": cases_file, "case": name, "status": status,
                              "message": message}) + "\n")
        log.flush()
        print(f"[rank {rank}] {status} {name}", flush=True)


if __name__ == "__main__":
    # run as the module `mpirun`, so that case files' `from mpirun import Skip` is this Skip
    sys.path.insert(0, str(SUPPORT))
    import mpirun

    sys.exit(mpirun._rank_main(sys.argv[1:]))
