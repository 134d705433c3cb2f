"""Crash-safe publishing of a checkpoint directory, and what a failed write says (no torch).

A save writes everything into DIR/step-NNNNNNNN.tmp-XXXXXXXX, fsyncs each file, the index and
the directory, and only then makes it DIR/step-NNNNNNNN by one atomic rename. Re-saving a step
that exists swaps the two directories in one atomic call (Linux renameat2 RENAME_EXCHANGE), so
the old checkpoint stays whole until the new one has replaced it, and only then is deleted.
Where the filesystem has no such call, the old one is renamed aside (step-N.old-XXXXXXXX)
first: a crash between the two renames leaves both complete, the old one set aside.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from soapstone.shard.checkpoint import index as ix

AT_FDCWD = -100
RENAME_EXCHANGE = 2
FULL = (errno.ENOSPC, errno.EDQUOT)


def make_temp(root: Path, step: int) -> Path:
    """A fresh, empty directory for the save of `step`: root/step-NNNNNNNN.tmp-XXXXXXXX."""
    return Path(tempfile.mkdtemp(prefix=f"{ix.step_dir(root, step).name}.tmp-", dir=root))


def publish(tmp: Path, final: Path) -> None:
    """Make the complete directory `tmp` the checkpoint `final` by one atomic rename (an
    existing `final` is swapped out whole, then deleted); durable when it returns."""
    ix.fsync_dir(tmp)
    root = final.parent
    if not final.exists():
        os.rename(tmp, final)
        ix.fsync_dir(root)
        return
    old = root / f"{final.name}.old-{uuid.uuid4().hex[:8]}"
    if exchange(tmp, final):
        ix.fsync_dir(root)  # published; what follows is housekeeping (prune retries it)
        try:
            os.rename(tmp, old)  # the replaced checkpoint, named for what it is until deleted
        except OSError:
            old = tmp
    else:
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(old, final)  # put the complete one back
            raise
        ix.fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the C library or the
    filesystem has no such call."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                     ctypes.c_uint]
    if call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def failure(e: OSError, what: str) -> str:
    """A failed write as agree() carries it: `VERDICT|DETAIL` (see `disk_message`)."""
    name = errno.errorcode.get(e.errno, "OSError")
    verdict = ("is full" if e.errno in FULL else
               "failed (EIO: an input/output error)" if e.errno == errno.EIO else
               f"cannot be written ({name})")
    return f"{verdict}|{name}: {e.strerror} {what}"


def disk_message(root: Path, step: int, nbytes: int, problem: str, who: str = "") -> str:
    """The one line every rank exits with after a failed save (`problem` from `failure`; `who`
    names the rank that met it)."""
    verdict, _, detail = problem.partition("|")
    try:
        done, _ = ix.scan(root)
    except OSError:
        done = []
    last = f"step {done[-1][0]}" if done else "none"
    return (f"the disk at {root} {verdict} after {nbytes} bytes of step {step}; the last "
            f"complete checkpoint is {last} ({who}{detail}; the partial save was removed and "
            "earlier checkpoints are untouched: free space, then --resume from it)")
