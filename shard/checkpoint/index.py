"""The checkpoint index: one JSON file that makes a directory of safetensors shards a checkpoint.

    DIR/step-00000003/rank00000.safetensors   each rank's own pieces (no pickle anywhere)
    DIR/step-00000003/index.json              the whole index, with every piece's checksums

A save writes all of it into DIR/step-00000003.tmp-XXXXXXXX and renames that into place: a
step-NNNNNNNN directory is a complete checkpoint or absent (save.py). index.json names, for
every tensor (`param/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`, `momentum_buffer/NAME`), its
full shape, dtype, named dims and the layout it was saved from (placement per mesh axis), and
its pieces: which file, which key, the box of the global tensor the key holds and the CRC-32
of each 1 MiB chunk of its bytes (checksum.py); for each file its size and its header's CRC-32.
A reader needs no soapstone: open the files with any safetensors library, check the bytes with
zlib.crc32 and place each piece at its offset. Also: model, layout, mesh, step, seed, the run's
settings, optimizer name and step count, and the data position. schema.py checks it field by
field. Pure Python (no torch).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from soapstone.shard.checkpoint.schema import (  # noqa: F401  (re-exported)
    DTYPES,
    FORMAT,
    OPTIMIZER_KINDS,
    CheckpointError,
    Index,
    Tensor,
    parse,
)

INDEX = "index.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
# what a save in progress (tmp), a replaced checkpoint being swapped out (old) or a pruned
# one being deleted (del: renamed before its files go, save.drop) is called
UNFINISHED = re.compile(r"^step-(\d+)\.(tmp|old|del)-\w+$")


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps lives under `root`."""
    return Path(root) / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """The safetensors file of one rank."""
    return f"rank{rank:05d}.safetensors"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temp file, fsync it, rename it over `path`, fsync the directory: a
    reader sees the old file, the new one, or none, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan(root: str | Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """(complete checkpoints as (step, dir) by step, the step directories passed over with
    why: unfinished saves, replaced checkpoints set aside, directories without an index)."""
    done, skipped = [], []
    for p in sorted(Path(root).iterdir()):
        m, u = STEP_DIR.match(p.name), UNFINISHED.match(p.name)
        if not p.is_dir() or not (m or u):
            continue
        if m and (p / INDEX).is_file():
            done.append((int(m.group(1)), p))
        elif m:
            skipped.append((p, f"no {INDEX}: a save that did not finish"))
        elif u.group(2) == "tmp":
            skipped.append((p, f"an unfinished save of step {int(u.group(1))}: it was never "
                               "renamed into place"))
        elif u.group(2) == "del":
            skipped.append((p, f"a pruned checkpoint of step {int(u.group(1))} whose deletion "
                               "was cut short: the next save removes it"))
        else:
            skipped.append((p, f"an earlier save of step {int(u.group(1))} set aside while a "
                               "new one replaced it"))
    return sorted(done), skipped


def find(path: str | Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The checkpoints `path` names, newest first: a step dir (holding index.json) alone, or
    the complete checkpoints of a --save DIR; with the directories passed over and why."""
    p = Path(path)
    u = UNFINISHED.match(p.name)
    if u:
        raise CheckpointError(f"checkpoint {path}: an unfinished, replaced or pruned save (its "
                              f"name ends .{u.group(2)}-...); give its --save DIR, whose "
                              "complete checkpoints are step-NNNNNNNN")
    if (p / INDEX).is_file():
        return [p], []
    if not p.exists():
        raise CheckpointError(f"checkpoint {path}: no such directory; give the --save DIR of an "
                              "earlier run or one of its step-NNNNNNNN directories")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory (a checkpoint is a directory "
                              "with index.json; a single .safetensors file goes to --init)")
    done, skipped = scan(p)
    if not done:
        what = ("only unfinished saves (" + ", ".join(q.name for q, _ in skipped) + ")"
                if skipped else "nothing")
        raise CheckpointError(f"checkpoint {path}: no complete checkpoint in it ({what}); "
                              "give a directory an earlier `run --save` wrote")
    return [d for _, d in reversed(done)], skipped


def read(path: str | Path) -> Index:
    """A checkpoint's index, checked: every field (schema.py), the step against the directory's
    name, every listed file present at its size."""
    d = Path(path)
    f = d / INDEX
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; {d} is not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); the index is damaged") from None
    index = parse(data, str(f))
    m = STEP_DIR.match(d.name)
    if m and int(m.group(1)) != index.step:
        raise CheckpointError(f"{f}: step: {index.step}, but the directory is {d.name}; the "
                              "index was edited or moved: restore it or resume from another "
                              "checkpoint")
    for name, meta in index.files.items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (step {index.step}'s index lists it: "
                                  f"{meta.bytes} bytes); restore it or resume from another "
                                  "checkpoint")
    return index


def merge(parts: list[dict], header: dict) -> dict:
    """The index from every rank's part (its pieces) and the run's header; checks that the
    pieces of each tensor tile it exactly (else a save bug, RuntimeError)."""
    tensors: dict[str, dict] = {}
    files = {}
    for part in parts:
        files[part["file"]] = {k: part[k] for k in ("rank", "bytes", "header_bytes",
                                                     "header_crc32")}
        for name, t in part["tensors"].items():
            have = tensors.setdefault(name, {k: v for k, v in t.items() if k != "pieces"}
                                      | {"pieces": []})
            have["pieces"] += t["pieces"]
    for name, t in tensors.items():
        total = sum(_prod(p["shape"]) for p in t["pieces"])
        if total != _prod(t["shape"]):
            raise RuntimeError(f"checkpoint save: the pieces of {name} hold {total} elements, "
                               f"the tensor has {_prod(t['shape'])}")
        t["pieces"].sort(key=lambda p: p["offset"])
    return {"format": FORMAT, **header, "files": files,
            "tensors": dict(sorted(tensors.items()))}


def params(index: Index) -> dict[str, Tensor]:
    """The parameters of a checkpoint: name -> its tensor entry."""
    return {t.param: t for t in index.tensors.values() if t.kind == "param"}


def graph_params(graph) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every parameter of a StageGraph's model: name -> (dims, global shape)."""
    return {p.name: (p.dims, p.shape) for s in graph.stages for p in s.program.params}


def check_model(index: Index, where: str, model: str, want: dict[str, tuple[tuple[str, ...],
                tuple[int, ...]]]) -> None:
    """CheckpointError unless the checkpoint holds exactly the parameters `want` (name ->
    (dims, shape)), listing every name missing, extra or shaped differently."""
    have = params(index)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ, sizes = [], {}
    for n in sorted(set(want) & set(have)):
        dims, shape = want[n]
        if have[n].shape != tuple(shape):
            differ.append(f"{n}: checkpoint {_dims(have[n].dims, have[n].shape)}, "
                          f"model {_dims(dims, shape)}")
            for d, a, b in zip(dims, have[n].shape, shape, strict=False):
                if a != b:
                    sizes[d] = (a, b)
    if not (missing or extra or differ):
        return
    lines = [f"checkpoint {where} (model {index.model}) does not fit model {model}:"]
    if missing:
        lines.append(f"  not in the checkpoint ({len(missing)}): " + _some(missing))
    if extra:
        lines.append(f"  not in the model ({len(extra)}): " + _some(extra))
    if sizes:
        lines.append("  dims that differ: " + ", ".join(
            f"{d} (checkpoint {a}, model {b})" for d, (a, b) in sorted(sizes.items())))
    lines += ["  " + d for d in differ[:6]]
    if len(differ) > 6:
        lines.append(f"  ... and {len(differ) - 6} more tensors shaped differently")
    lines.append("hint: resume with the spec and --dim values the checkpoint was saved with "
                 f"(it records: {_fmt_dims(index)})")
    raise CheckpointError("\n".join(lines))


def _some(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)"
                                      if len(names) > most else "")


def _dims(dims, shape) -> str:
    return "[" + ", ".join(f"{d}={s}" for d, s in zip(dims, shape, strict=True)) + "]"


def _fmt_dims(index: Index) -> str:
    dims = index.settings.get("dims") or {}
    return ", ".join(f"{k}={v}" for k, v in dims.items()) or "no dims"


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
