"""The files and directories a command writes, checked before a byte is written.

An output is refused (BadInput, exit 2) when it is a directory where a file goes, in a
directory that does not exist or cannot be written, a file that cannot be written, or the same
file as one of the command's inputs (the spec and its includes, --data, --plugin, ...): opening
an input for writing truncates it before the command has read it, which destroyed specs and
token files. An OSError met while writing all the same becomes a BadInput naming the path
(`cannot_write`). `run --save` checks its directory here too. Torch-free: plan and tokenize
use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.lang.errors import BadInput


def same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file (hard and symbolic links too)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):  # an unreadable path or a NUL byte: not provably the same
        return False


def spec_files(spec: str) -> list[str]:
    """The spec and every file it includes, transitively (those that parse; the spec's own
    loading reports the rest)."""
    from soapstone.dsl.lang import ast
    from soapstone.dsl.lang.parser import parse

    found: list[str] = []
    todo = [Path(spec)]
    while todo:
        path = todo.pop()
        try:
            target = path.resolve()
            if str(target) in found:
                continue
            found.append(str(target))
            tree = parse(target.read_text(), str(path))
        except (OSError, UnicodeDecodeError, UserError, RecursionError):
            continue
        todo += [target.parent / item.path for item in tree.items
                 if isinstance(item, ast.Include)]
    return found


def spec_inputs(args) -> list[tuple[str, str]]:
    """(what, path) of the spec, its includes and each --plugin file the flags name."""
    spec = getattr(args, "spec", None)
    files = spec_files(spec) if spec else []
    return ([("the spec", spec)] if spec else []) + \
        [("the spec's include", f) for f in files[1:]] + \
        [("--plugin", p) for p in getattr(args, "plugin", None) or ()]


def check_file(path: str, flag: str, example: str,
               inputs: Iterable[tuple[str, str]] = ()) -> None:
    """An output file: not a directory, in a directory that exists and can be written, itself
    writable if it exists, and none of `inputs` ((what, path) pairs) (BadInput)."""
    try:
        file_checks(path, flag, example, inputs)
    except OSError as e:  # a stat that fails (a name too long, a directory not searchable)
        raise cannot_write(flag, path, e) from None


def file_checks(path: str, flag: str, example: str, inputs) -> None:
    """check_file's checks, whose stat calls may raise OSError."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{flag} {path}: is a directory; give a file in it, e.g. "
                       f"{flag} {p / example}")
    if not p.resolve().parent.is_dir():
        raise BadInput(f"{flag} {path}: the directory {p.parent} does not exist")
    for what, source in inputs:
        if source and os.path.exists(source) and same_file(path, source):
            raise BadInput(f"{flag} {path}: the same file as {what} {source}; writing it "
                           "would destroy that input; give another path")
    if p.exists():
        # devices and pipes (/dev/null) are written as they are; a regular file must be
        # writable (root passes access(2) on most: then the write tells, via cannot_write)
        if p.is_file() and not os.access(p, os.W_OK):
            raise BadInput(f"{flag} {path}: cannot write it (permission denied); give a path "
                           "you can write")
        return
    # access(2) is not enough: root may `write` /sys and /proc, whose files cannot be
    # created; the one sure test is creating the file (removed again at once)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:  # created meanwhile (a dangling link): the write will tell
        return
    except OSError as e:
        raise cannot_write(flag, path, e) from None
    os.close(fd)
    p.unlink(missing_ok=True)


def check_dir(path: str, flag: str) -> None:
    """An output directory: created if missing, and writable (BadInput), as --save's is."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise BadInput(f"{flag} {path}: exists and is not a directory")
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot create it ({e.strerror}); give a directory you "
                       "can write") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: not writable; give a directory you can write")


def cannot_write(flag: str, path: str, error: OSError) -> BadInput:
    """The BadInput of an OSError met writing `path` (a full disk, a read-only place)."""
    return BadInput(f"{flag} {path}: cannot write it ({error.strerror or error}); give a path "
                    "you can write")


def writes_to(error: OSError, path: str) -> bool:
    """Whether `error` is about `path` (or about no file: a write to an open one)."""
    return error.filename is None or same_file(str(error.filename), path)


def rank0_verdict(comm, check: Callable[[], object]):
    """Run `check` on rank 0 only, which writes the outputs, and raise its UserError on every
    rank (collective over the world: no rank goes on to wait for one that stopped; rank 0
    prints). Returns what `check` returned on rank 0, None elsewhere."""
    problem, got = None, None
    if comm.rank == 0:
        try:
            got = check()
        except UserError as e:
            problem = e
    text = problem.format() if problem is not None else None
    if comm.size > 1:
        from mpi4py import MPI

        text = MPI.COMM_WORLD.bcast(text, root=0)
    if problem is not None:
        raise problem
    if text is not None:
        raise BadInput(text)
    return got
