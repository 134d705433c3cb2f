"""The damaged-checkpoint corpus: each entry damages a copy of a real checkpoint in one way
and states how every command that meets it must end
(tests/shard/checkpoint/test_checkpoint_damage.py runs them through `soapstone run --resume/--init`
and `soapstone ckpt verify|inspect`; the rank cases of tests/shard/checkpoint/ckpt_cases.py under
mpiexec).

An entry's `apply(d)` damages the step directory `d` (the only one of its --save DIR) in
place and returns the message fragment every failing command must print, exit 2 (computed from
the files where it names a place, e.g. the key and tensor a flipped byte falls in).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import attrs

FILE0, FILE1 = "rank00000.safetensors", "rank00001.safetensors"


@attrs.frozen
class Damage:
    """One way a checkpoint breaks, and what it must produce."""

    name: str
    apply: Callable[[Path], str]
    init: bool = True  # run --init meets it (it reads the parameters only)
    verify: bool = True  # ckpt verify fails (else: the checkpoint is whole)
    data: bool = False  # only tensor bytes are damaged (ckpt inspect reads none: it passes)


def header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def key_at(path: Path, offset: int) -> str:
    """The key whose bytes hold file offset `offset`."""
    h, start = header(path)
    for key, e in h.items():
        if key != "__metadata__" and start + e["data_offsets"][0] <= offset < \
                start + e["data_offsets"][1]:
            return key
    raise ValueError(f"{path}: offset {offset} is in no tensor")


def piece_middle(path: Path, prefix: str) -> tuple[int, str]:
    """The file offset of the middle byte of the largest piece whose key starts with `prefix`
    ("param/", ...), and its key."""
    h, start = header(path)
    keys = [k for k in h if k.startswith(prefix)]
    key = max(keys, key=lambda k: h[k]["data_offsets"][1] - h[k]["data_offsets"][0])
    a, b = h[key]["data_offsets"]
    return start + (a + b) // 2, key


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int) -> None:
    """Invert every bit of one byte."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def where(key: str, step: int) -> str:
    """The fragment naming a piece that fails its checksum: key, tensor, step."""
    return f"{key} ({key.split('#')[0]}, step {step}): bytes"


def edit_index(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """A damage that edits index.json's JSON."""
    def apply(d: Path) -> None:
        index = json.loads((d / "index.json").read_text())
        change(index)
        (d / "index.json").write_text(json.dumps(index))
    return apply


def index_damage(name: str, change: Callable[[dict], None], fragment: str,
                 data: bool = False) -> Damage:
    """An entry whose damage is an edit of index.json, with a fixed fragment."""
    edit = edit_index(change)

    def apply(d: Path) -> str:
        edit(d)
        return fragment
    return Damage(name, apply, data=data)


def flip_mid(kind: str) -> Callable[[Path], str]:
    """Flip the middle byte of the largest piece of `kind` in rank 0's file."""
    def apply(d: Path) -> str:
        at, key = piece_middle(d / FILE0, kind + "/")
        flip(d / FILE0, at)
        return where(key, step_of(d))
    return apply


def ff_tail(d: Path) -> str:
    """0xFF over the last 16 bytes of rank 0's file."""
    p = d / FILE0
    size = p.stat().st_size
    write_at(p, size - 16, b"\xff" * 16)
    return where(key_at(p, size - 1), step_of(d))


def truncate(d: Path) -> str:
    """Rank 0's file cut to 3/4 of its bytes."""
    p = d / FILE0
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size * 3 // 4)
    return f"{size * 3 // 4} bytes, the index says {size} (a truncated or replaced file)"


def header_edit(d: Path) -> str:
    """One character of the JSON header changed, the JSON still valid."""
    p = d / FILE0
    raw = p.read_bytes()
    at = raw.index(b"soapstone-checkpoint/2")
    write_at(p, at + len(b"soapstone-checkpoint/"), b"7")
    return "its header"


def step_of(d: Path) -> int:
    """The step a step directory's index says."""
    return json.loads((d / "index.json").read_text())["step"]


def first_piece(index: dict, tensor: str = "param/linear0.weight") -> dict:
    """The first piece of a tensor in an index's JSON."""
    return index["tensors"][tensor]["pieces"][0]


def crc_edit(index: dict) -> None:
    """The checksum of a piece edited."""
    p = first_piece(index)
    p["crc32"][0] ^= 1


def step_and_dir(d: Path) -> str:
    """The step edited and the directory renamed to match: only the rank file's header tells
    the truth."""
    step = step_of(d)
    edit_index(lambda i: i.update(step=step + 2))(d)
    d.rename(d.with_name(f"step-{step + 2:08d}"))
    return f"its header says step {step}, the index says step {step + 2}"


def missing(name: str) -> Callable[[Path], str]:
    """A rank file deleted."""
    def apply(d: Path) -> str:
        (d / name).unlink()
        return f"{name}: missing"
    return apply


def copied_from(other: Path, what: str | None = None) -> Callable[[Path], str]:
    """Rank 0's file (`what`), or the whole checkpoint, replaced by another model's."""
    def apply(d: Path) -> str:
        if what is None:
            shutil.rmtree(d)
            shutil.copytree(other, d)
            return "does not fit model gpt"
        shutil.copy(other / what, d / what)
        return "its header says model ops, the index says model gpt"
    return apply


def not_json(d: Path) -> str:
    """index.json cut mid-way."""
    (d / "index.json").write_text('{"format": "so')
    return "index.json: unreadable"


def corpus(other: Path) -> list[Damage]:
    """The corpus on a one-rank checkpoint of examples/gpt.par at step 2 (AdamW); `other` is a
    checkpoint of another model (tests/specs/ops_layouts.par's ops) at step 2."""
    return [
        Damage("flip-mid-param", flip_mid("param"), data=True),
        Damage("flip-mid-moment", flip_mid("exp_avg"), init=False, data=True),
        Damage("ff-last-16-bytes", ff_tail, init=False, data=True),
        index_damage("checksum-edited", crc_edit, where("param/linear0.weight#0", 2),
                     data=True),
        Damage("truncated", truncate),
        Damage("header-edited", header_edit),
        Damage("rank-file-missing", missing(FILE0)),
        Damage("other-models-rank-file", copied_from(other, FILE0)),
        Damage("other-models-checkpoint", copied_from(other), verify=False),
        index_damage("offset-deleted", lambda i: first_piece(i).pop("offset"),
                     "tensors['param/linear0.weight'].pieces[0].offset: missing"),
        index_damage("step-as-string", lambda i: i.update(step="2"),
                     "step: '2' is a string, want a whole number >= 0"),
        index_damage("tensors-as-list", lambda i: i.update(tensors=list(i["tensors"])),
                     "is a list, want an object (tensor name -> entry)"),
        index_damage("files-emptied", lambda i: i.update(files={}), "files: empty"),
        index_damage("unknown-file", lambda i: first_piece(i).update(file="rank00009.st"),
                     "pieces[0].file: 'rank00009.st', which files does not list"),
        index_damage("shifted-offset", lambda i: first_piece(i).update(offset=[1, 0]),
                     "pieces[0].offset: [1, 0] with shape"),
        index_damage("negative-optimizer-steps", lambda i: i["optimizer"].update(steps=-1),
                     "optimizer.steps: -1 is a number, want a whole number >= 0"),
        index_damage("optimizer-steps-edited", lambda i: i["optimizer"].update(steps=5),
                     "its header says optimizer_steps 2, the index says optimizer.steps 5"),
        index_damage("step-edited", lambda i: i.update(step=4),
                     "step: 4, but the directory is step-00000002"),
        Damage("step-edited-dir-renamed", step_and_dir),
        # the data position: never read back (step and seed place the data), still checked
        index_damage("data-source-a-number", lambda i: i["data"].update(source=5),
                     "data.source: 5 is a number, want a string"),
        index_damage("data-next-batch-a-string", lambda i: i["data"].update(next_batch="x"),
                     "data.next_batch: 'x' is a string, want a whole number >= 0"),
        index_damage("data-next-batch-negative", lambda i: i["data"].update(next_batch=-5),
                     "data.next_batch: -5 is a number, want a whole number >= 0"),
        index_damage("data-seed-edited", lambda i: i["data"].update(seed=5),
                     "data.seed: 5, but seed is 0"),
        index_damage("moment-deleted", lambda i: i["tensors"].pop("exp_avg/linear0.bias"),
                     "lacks 'exp_avg/linear0.bias' (optimizer adamw)"),
        index_damage("old-format", lambda i: i.update(format="soapstone-checkpoint/1"),
                     "format 'soapstone-checkpoint/1', this soapstone reads"),
        Damage("index-not-json", not_json),
    ]


def swap_rank_files(d: Path) -> str:
    """rank00000 <-> rank00001."""
    tmp = d / "swap"
    (d / FILE0).rename(tmp)
    (d / FILE1).rename(d / FILE0)
    tmp.rename(d / FILE1)
    return f"{FILE0} (step {step_of(d)}): its header says rank 1, the index says rank 0"


def flip_rank1_split(d: Path) -> str:
    """Flip a byte of a piece in rank 1's file that only rank 1 reads under the layout it was
    saved in (a parameter split over the model axis)."""
    index = json.loads((d / "index.json").read_text())
    h, start = header(d / FILE1)
    key = next(p["key"] for t in index["tensors"].values() if t["kind"] == "param"
               and any(v.startswith("split") for v in t["layout"].values())
               for p in t["pieces"] if p["file"] == FILE1)
    a, b = h[key]["data_offsets"]
    flip(d / FILE1, start + (a + b) // 2)
    return f"rank 1: {d / FILE1}: " + where(key, index["step"])


# entries for a 2-rank checkpoint (tp2), under mpiexec: (name, damage)
RANK_CASES = [
    ("swapped-rank-files", swap_rank_files),
    ("rank-1-file-missing", missing(FILE1)),
    ("flip-read-by-rank-1-only", flip_rank1_split),
]
