"""The checkpoint index: one JSON file that makes a directory of safetensors shards a checkpoint.

    DIR/step-00000003/rank00000.safetensors   each rank's own pieces (no pickle anywhere)
    DIR/step-00000003/rank00000.json          that rank's list of its pieces (its half of the index)
    DIR/step-00000003/index.json              written last, atomically: the checkpoint exists
                                              whole or not at all

index.json names, for every tensor (`param/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`,
`momentum_buffer/NAME`), its full shape, dtype, named dims and the layout it was saved from
(placement per mesh axis), and its pieces: which file, which key, and the box of the global
tensor the key holds. A reader needs no soapstone: open the files with any safetensors library
and place each piece at its offset. Also: model, layout, mesh, step, seed, the run's settings,
optimizer name and step count, and the data position. Pure Python (no torch).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from soapstone.comm.dtype_table import TABLE
from soapstone.comm.errors import UserError

FORMAT = "soapstone-checkpoint/1"
INDEX = "index.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
# dtype name (the index's, torch's) -> (safetensors dtype code, bytes per element)
DTYPES = {d.torch_name: (d.safetensors, d.nbytes) for d in TABLE if d.safetensors is not None}
OPTIMIZER_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit the run (exit 2)."""


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


def scan(root: str | Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints as (step, dir) by step, partial step dirs without an index)."""
    done, partial = [], []
    for p in sorted(Path(root).iterdir()):
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            if (p / INDEX).is_file():
                done.append((int(m.group(1)), p))
            else:
                partial.append(p)
    return sorted(done), partial


def find(path: str | Path) -> tuple[Path, list[Path]]:
    """The checkpoint `path` names: a step dir (holding index.json), or a --save DIR, whose
    latest complete checkpoint it is; with the partial saves that were passed over."""
    p = Path(path)
    if (p / INDEX).is_file():
        return p, []
    if not p.exists():
        raise CheckpointError(f"checkpoint {path}: no such directory; give the --save DIR of an "
                              "earlier run or one of its step-NNNNNNNN directories")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory (a checkpoint is a directory "
                              "with index.json; a single .safetensors file goes to --init)")
    done, partial = scan(p)
    if not done:
        what = (f"only partial saves without {INDEX} ("
                + ", ".join(q.name for q in partial) + ")") if partial else "nothing"
        raise CheckpointError(f"checkpoint {path}: no complete checkpoint in it ({what}); "
                              "give a directory an earlier `run --save` wrote")
    return done[-1][1], partial


def read(path: str | Path) -> dict:
    """A checkpoint's index, checked: format, fields, every listed file present at its size."""
    d = Path(path)
    f = d / INDEX
    try:
        index = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; {d} is not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); the index is damaged") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a soapstone checkpoint index (format "
                              f"{index.get('format') if isinstance(index, dict) else None!r}, "
                              f"want {FORMAT!r})")
    for key in ("model", "step", "seed", "tensors", "files", "optimizer", "settings"):
        if key not in index:
            raise CheckpointError(f"{f}: lacks the field {key!r}; the index is damaged")
    for name, meta in index["files"].items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the checkpoint lists it: {meta['bytes']} "
                                  "bytes); restore it or resume from another checkpoint")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, the index says {meta['bytes']} (a "
                                  "truncated or replaced file); restore it or resume from "
                                  "another checkpoint")
    return index


def merge(parts: list[dict], header: dict) -> dict:
    """The index from every rank's part (its pieces) and the run's header; checks that the
    pieces of each tensor tile it exactly (else a save bug, RuntimeError)."""
    tensors: dict[str, dict] = {}
    files = {}
    for part in parts:
        files[part["file"]] = {"rank": part["rank"], "bytes": part["bytes"]}
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
    return {"format": FORMAT, **header, "files": files, "tensors": dict(sorted(tensors.items()))}


def params(index: dict) -> dict[str, dict]:
    """The parameters of a checkpoint: name -> its tensor entry."""
    return {t["param"]: t for t in index["tensors"].values() if t["kind"] == "param"}


def graph_params(graph) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every parameter of a StageGraph's model: name -> (dims, global shape)."""
    return {p.name: (p.dims, p.shape) for s in graph.stages for p in s.program.params}


def check_model(index: dict, where: str, model: str, want: dict[str, tuple[tuple[str, ...],
                tuple[int, ...]]]) -> None:
    """CheckpointError unless the checkpoint holds exactly the parameters `want` (name ->
    (dims, shape)), listing every name missing, extra or shaped differently."""
    have = params(index)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ, sizes = [], {}
    for n in sorted(set(want) & set(have)):
        dims, shape = want[n]
        if tuple(have[n]["shape"]) != tuple(shape):
            differ.append(f"{n}: checkpoint {_dims(have[n]['dims'], have[n]['shape'])}, "
                          f"model {_dims(dims, shape)}")
            for d, a, b in zip(dims, have[n]["shape"], shape, strict=False):
                if a != b:
                    sizes[d] = (a, b)
    if not (missing or extra or differ):
        return
    lines = [f"checkpoint {where} (model {index['model']}) does not fit model {model}:"]
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


def _fmt_dims(index: dict) -> str:
    dims = index.get("settings", {}).get("dims") or {}
    return ", ".join(f"{k}={v}" for k, v in dims.items()) or "no dims"


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
