"""Dropping old checkpoints (save.prune) never leaves a half-deleted step-NNNNNNNN: each is
renamed step-N.del-XXXXXXXX before its files go, so a kill mid-delete leaves a name readers
pass over, and the next save's prune removes it.

- a real prune process killed with SIGKILL while it deletes a checkpoint padded with many files
  (slow to delete): the checkpoint's own name is gone, the leftover is a .del- directory;
  resume takes the newest complete checkpoint and the next save removes the leftover;
- the leftover made by hand (of a step newer than any checkpoint): `run --resume` passes over
  it saying why, and the next save's prune removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_checkpoint import ROOT, cli, trainer

from soapstone.shard.checkpoint import resume, save
from soapstone.shard.checkpoint.index import scan

# the child: prune DIR down to its newest checkpoint once the parent says go
PRUNE = ("import sys\nfrom soapstone.shard.checkpoint.save import prune\n"
         "print('ready', flush=True)\nsys.stdin.readline()\nprune(sys.argv[1], 1, 4)\n")


def saved(root: Path, *steps: int) -> None:
    """Real one-rank checkpoints of examples/gpt.par under root, one per step."""
    t = trainer()
    done = 0
    for s in steps:
        list(t.run(s - done, done))
        done = s
        save(t.executor, root, s, 0, {"accumulate": 1})


def entries(root: Path, prefix: str) -> int | None:
    """How many files the directory named `prefix` (or a renamed one) holds; None when gone."""
    for p in root.iterdir():
        if p.name.startswith(prefix):
            try:
                return len(os.listdir(p))
            except FileNotFoundError:  # renamed or removed as we looked: look again
                return entries(root, prefix)
    return None


def kill_mid_prune(root: Path, pad: int) -> int:
    """Pad step 2 with `pad` empty files, start a prune of root down to step 4 in a fresh
    process, and SIGKILL it once step 2 has lost some files; the child's exit status (0: it
    finished first)."""
    old = root / "step-00000002"
    for i in range(pad):
        (old / f"pad{i:07d}").touch()
    full = pad + len(os.listdir(root / "step-00000004"))
    child = subprocess.Popen([sys.executable, "-c", PRUNE, str(root)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # against a hang only
    try:
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        while child.poll() is None:
            assert time.monotonic() < deadline, "the prune neither deleted a file nor ended"
            left = entries(root, old.name)
            if left is None or left < full:
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    return child.returncode


def test_a_prune_killed_mid_delete_leaves_no_half_checkpoint(tmp_path):
    """SIGKILL during the deletion: no step-00000002 is left, only a .del- leftover; resume
    takes step 4; the next save's prune removes the leftover."""
    root = tmp_path / "ck"
    saved(root, 2, 4)
    keep = tmp_path / "keep"
    shutil.copytree(root, keep)
    pad = 20_000
    # the kill must land while files go: a prune that finished first is tried again, larger
    while (rc := kill_mid_prune(root, pad)) == 0 and pad < 320_000:
        shutil.rmtree(root)
        shutil.copytree(keep, root)
        pad *= 2
    assert rc == -signal.SIGKILL, f"every prune finished before its kill (up to {pad} files)"
    names = sorted(p.name for p in root.iterdir())
    assert names[-1] == "step-00000004" and len(names) == 2, names
    assert names[0].startswith("step-00000002.del-"), names  # never a half step-00000002
    leftover = root / names[0]
    done, skipped = scan(root)
    assert [s for s, _ in done] == [4]
    assert skipped == [(leftover, "a pruned checkpoint of step 2 whose deletion was cut "
                                  "short: the next save removes it")]
    t = trainer(draw=False)
    assert resume(t.executor, root)["dir"] == str(root / "step-00000004")
    list(t.run(2, 4))
    save(t.executor, root, 6, 0, {"accumulate": 1}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
    assert resume(trainer(draw=False).executor, root)["dir"] == str(root / "step-00000006")


def test_the_leftover_of_a_killed_prune_is_passed_over_then_removed(tmp_path):
    """A .del- directory (what a prune killed mid-delete leaves: its index, not all its files),
    of a step newer than any checkpoint: resume passes over it saying why and takes step 4;
    the next save's prune removes it, whatever its step."""
    root = tmp_path / "ck"
    saved(root, 2, 4)
    leftover = root / "step-00000008.del-0badf00d"
    shutil.copytree(root / "step-00000004", leftover)
    (leftover / "rank00000.safetensors").unlink()
    (resumed,) = cli(["run", "examples/gpt.par", "--quiet", "--steps", "6", "--resume",
                      str(root), "--save", str(root), "--keep", "2"])
    assert resumed["rc"] == 0, resumed["text"]
    text = resumed["text"]
    assert f"ignoring {leftover}: a pruned checkpoint of step 8 whose deletion was cut " \
        "short" in text, text
    assert f"resumed from {root / 'step-00000004'} at step 4" in text, text
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
