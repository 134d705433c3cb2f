"""Damaged checkpoints and full disks, through the real command line.

- the corpus of tests/shard/checkpoint/ckpt_damage.py, built from real checkpoints: every entry
through `run --resume`, `run --init`, `ckpt verify` and `ckpt inspect`, each ending as the entry
says (exit 2 naming the damage, never a traceback); the rank cases (swapped rank files, a byte only
rank 1 reads) under mpiexec in tests/shard/checkpoint/ckpt_cases.py;
- a --save DIR whose newest checkpoint lost a file: resume passes over it, saying why;
- re-saving a step that exists replaces it whole;
- a full disk during a save: a real tmpfs too small for the second checkpoint, in a private
  mount namespace (`unshare`; as another user than root, a user namespace): every rank exits 2
  with one line, the partial save is removed, the first checkpoint verifies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_damage import corpus
from test_checkpoint import ROOT, cli, trainer

from soapstone.shard.checkpoint import read, save

GPT = ["run", "examples/gpt.par", "--quiet", "--steps", "3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Real checkpoints at step 2: gpt (AdamW) and, for the wrong-model cases, ops."""
    root = tmp_path_factory.mktemp("ckpt")
    for name, how in (("good", ()), ("ops", ("fp32", "adamw", "tests/specs/ops_layouts.par",
                                             "ops"))):
        t = trainer(*how)
        list(t.run(2))
        save(t.executor, root / name, 2, 0, {"accumulate": 1})
    return root


def test_damaged_checkpoints_exit_2_naming_the_damage(saved, tmp_path):
    """Each corpus entry: resume, init, verify and inspect end as it says, in one process."""
    argvs, want = [], []
    for e in corpus(saved / "ops" / "step-00000002"):
        d = tmp_path / e.name / "step-00000002"
        shutil.copytree(saved / "good" / "step-00000002", d)
        fragment = e.apply(d)
        root = str(d.parent)  # a --save DIR holding the one damaged checkpoint
        argvs += [[*GPT, "--resume", root], [*GPT, "--init", root], ["ckpt", "verify", root],
                  ["ckpt", "inspect", root]]
        fails = (True, e.init, e.verify, not e.data and e.verify)
        want += [(e.name, 2, fragment) if bad else (e.name, 0, "") for bad in fails]
    for (name, rc, fragment), got in zip(want, cli(*argvs), strict=True):
        assert got["rc"] == rc and fragment in got["text"], (name, fragment, got)
        assert "Traceback" not in got["text"], (name, got["text"])


def test_any_mutated_index_field_is_a_checkpoint_error(saved, tmp_path):
    """300 index.json files, each with one or two fields set to a value of another type or
    range, or deleted: reading and checking them raises CheckpointError and nothing else."""
    import json

    from json_mutants import mutants

    from soapstone.shard.checkpoint.index import CheckpointError
    from soapstone.shard.checkpoint.verify import check_files

    d = tmp_path / "step-00000002"
    shutil.copytree(saved / "good" / "step-00000002", d)
    base = json.loads((d / "index.json").read_text())
    values = [None, -1, 0, 1, 2**40, 1.5, "x", [], {}, [1], {"a": 1}, True, [0, 0], [-1, 0]]

    for index in mutants(base, values, 300):
        (d / "index.json").write_text(json.dumps(index))
        try:
            check_files(d, read(d))
        except CheckpointError:
            pass


def test_resume_passes_over_a_broken_newest_checkpoint(saved, tmp_path):
    """A --save DIR whose step 4 lost its rank file (what a crash of an older soapstone left)
    and an unfinished save: resume takes step 2 and names both with why; verify fails."""
    d = tmp_path / "ck"
    shutil.copytree(saved / "good", d)
    t = trainer()
    list(t.run(4))
    save(t.executor, d, 4, 0, {"accumulate": 1})
    (d / "step-00000004" / "rank00000.safetensors").unlink()
    (d / "step-00000006.tmp-x1y2z3").mkdir()
    resumed, verified = cli([*GPT, "--resume", str(d)], ["ckpt", "verify", str(d)])
    assert resumed["rc"] == 0, resumed["text"]
    text = resumed["text"]
    assert f"ignoring {d / 'step-00000004'}: " in text and "rank00000.safetensors: missing" \
        in text, text
    assert f"ignoring {d / 'step-00000006.tmp-x1y2z3'}: an unfinished save of step 6" in text
    assert f"resumed from {d / 'step-00000002'} at step 2" in text
    assert verified["rc"] == 2 and "rank00000.safetensors: missing" in verified["text"]


def test_resaving_a_step_replaces_it_whole(saved, tmp_path):
    """save() of a step that exists swaps the new one in: nothing else is left beside it."""
    d = tmp_path / "ck"
    shutil.copytree(saved / "good", d)
    t = trainer()
    list(t.run(3))
    save(t.executor, d, 2, 7, {"accumulate": 1})
    assert [p.name for p in d.iterdir()] == ["step-00000002"]
    assert read(d / "step-00000002").seed == 7
    (verified,) = cli(["ckpt", "verify", str(d)])
    assert verified["rc"] == 0 and "ok: " in verified["text"], verified["text"]


def test_an_exported_file_carries_its_checksums(saved, tmp_path):
    """`ckpt export` writes each parameter's checksums into the file; `run --init FILE` checks
    them: a flipped byte is exit 2 naming it."""
    from ckpt_damage import flip, piece_middle

    f = tmp_path / "w.safetensors"
    (exported,) = cli(["ckpt", "export", str(saved / "good"), "-o", str(f)])
    assert exported["rc"] == 0, exported["text"]
    at, key = piece_middle(f, "linear0.weight")
    flip(f, at)
    (init,) = cli([*GPT, "--init", str(f)])
    assert init["rc"] == 2 and f"{key} (param/{key}, step 2): bytes" in init["text"], init


def test_verify_and_inspect_need_no_torch(saved):
    """`ckpt verify` and `ckpt inspect` run where torch cannot be imported (a login node)."""
    from no_torch import BLOCKED

    for action, says in (("verify", "every checksum matches"), ("inspect", "step 2  seed 0")):
        p = subprocess.run([sys.executable, "-c", BLOCKED, "ckpt", action, str(saved / "good")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and says in p.stdout, p.stdout + p.stderr


# --- a full disk, for real -------------------------------------------------------------------
def namespace() -> list[str] | None:
    """The command prefix of a private mount namespace where this user can mount a tmpfs, or
    None where there is none (no unshare, or namespaces refused)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-Urm"]
    probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


@pytest.mark.parametrize("mode", [(), ("--async-save",)], ids=["sync", "async"])
def test_full_disk_mid_save_exits_2_on_every_rank_and_keeps_the_last_checkpoint(tmp_path, mode):
    """dp2 saving steps 2 and 4 to a tmpfs with room for one checkpoint and a half: the save
    of step 4 meets ENOSPC; every rank exits 2, rank 0 says so in one line; step 2 stays and
    verifies, no trace of step 4 is left. With --async-save the write that fails runs on a
    background thread: the ranks learn it where they agree on its outcome (the run's end here),
    and end the same way."""
    from mpirun import mpiexec

    prefix = namespace()
    if prefix is None:
        pytest.skip("no private mount namespace to mount a small tmpfs in (unshare -m needs "
                    "root, unshare -Urm user namespaces)")
    mnt, out = tmp_path / "disk", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    cli_cmd = f"{sys.executable} -m soapstone.dsl.cli"
    # the gpt example's checkpoint takes ~480 KiB of tmpfs pages over both ranks
    script = f"""
mount -t tmpfs -o size=720k tmpfs {mnt} || exit 97
OMP_NUM_THREADS=1 {mpiexec()} -n 2 {cli_cmd} run examples/gpt.par --parallel dp2 --quiet \\
    --steps 4 --save {mnt}/ck --save-every 2 {" ".join(mode)} >{out}/run.out 2>{out}/run.err
echo $? >{out}/run.rc
ls -A {mnt}/ck >{out}/ls
{cli_cmd} ckpt verify {mnt}/ck >{out}/verify.out 2>&1
echo $? >{out}/verify.rc
"""
    p = subprocess.run([*prefix, "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    err = (out / "run.err").read_text()
    assert (out / "run.rc").read_text().strip() == "2", err
    lines = [x for x in err.splitlines() if "the disk at" in x]
    assert len(lines) == 1, err
    assert f"error: the disk at {mnt}/ck is full after " in lines[0], err
    assert "bytes of step 4; the last complete checkpoint is step 2 (" in lines[0], err
    assert "ENOSPC" in lines[0] and "Traceback" not in err, err
    assert (out / "ls").read_text().split() == ["step-00000002"]
    verified = (out / "verify.out").read_text()
    assert (out / "verify.rc").read_text().strip() == "0", verified
    assert "ok: " in verified and "step 2:" in verified, verified
