"""The typed checkpoint index: index.json checked field by field into frozen attrs classes.

    index = parse(json.loads(text), "ckpt/step-00000003/index.json")   # Index, or CheckpointError

Every field a reader uses is checked for presence, type and range, and the fields are checked
against each other: each piece names a listed file, lies inside its tensor, the pieces of a
tensor tile it exactly, each piece has one checksum per chunk of its bytes, each file is one
rank's, the optimizer state matches the optimizer, the data position agrees with the seed
and settings. A malformed index is a CheckpointError naming the field
(`tensors["param/w"].pieces[0].offset: missing`), never a KeyError later.
Pure Python (no torch).
"""

from __future__ import annotations

import math

import attrs

from soapstone.comm.dtype_table import TABLE
from soapstone.comm.errors import UserError
from soapstone.shard.checkpoint.boxes import Box

FORMAT = "soapstone-checkpoint/2"
# dtype name (the index's, torch's) -> (safetensors dtype code, bytes per element)
DTYPES = {d.torch_name: (d.safetensors, d.nbytes) for d in TABLE if d.safetensors is not None}
OPTIMIZER_KINDS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
KINDS = ("param", *(k for ks in OPTIMIZER_KINDS.values() for k in ks))


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit the run (exit 2)."""


@attrs.frozen
class Piece:
    """One saved box of a tensor: where it is (file, key) and the CRC-32 of each chunk."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    crc32: tuple[int, ...] | None  # None: a file soapstone did not write (no checksums)

    @property
    def box(self) -> Box:
        """The region of the global tensor it holds."""
        return Box(self.offset, self.shape)


@attrs.frozen
class Tensor:
    """A checkpoint tensor (`param/NAME`, `exp_avg/NAME`, ...): its global shape and pieces."""

    name: str
    kind: str
    param: str
    dtype: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    layout: dict[str, str]
    pieces: tuple[Piece, ...]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype][1]


@attrs.frozen
class File:
    """One rank's safetensors file: its size and the CRC-32 of its header."""

    name: str
    rank: int | None  # None: a file soapstone did not write
    bytes: int
    header_bytes: int | None = None
    header_crc32: int | None = None


@attrs.frozen
class Optimizer:
    """The optimizer the state was saved for and its update count."""

    name: str | None
    steps: int


@attrs.frozen
class Index:
    """A checked index.json; `raw` is the JSON as read (what `ckpt inspect --json` prints)."""

    model: str
    parallel: str | None
    zero: int
    mesh: dict[str, int]
    world_size: int
    step: int | None  # None: a file soapstone did not write
    seed: int
    settings: dict
    optimizer: Optimizer
    files: dict[str, File]
    tensors: dict[str, Tensor]
    chunk_bytes: int
    raw: dict = attrs.field(repr=False)


MISSING = object()


class Fields:
    """Reads typed fields out of JSON, raising CheckpointError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, problem: str):
        """CheckpointError: `FILE: PATH: PROBLEM; the index is damaged`."""
        return CheckpointError(f"{self.where}: {path}: {problem}; the index is damaged: restore "
                             "it from a copy or resume from another checkpoint")

    def get(self, obj: dict, key: str, path: str, check, *args, default=MISSING):
        """obj[key] checked by `check(value, path, *args)`; missing is an error unless a
        default is given."""
        sub = f"{path}.{key}" if path else key
        if key not in obj:
            if default is not MISSING:
                return default
            raise self.fail(sub, "missing")
        return check(obj[key], sub, *args)

    def bad(self, value, path: str, want: str):
        """The error for `value` at `path` not being `want`."""
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                type(None): "null", int: "a number", float: "a number"}.get(type(value), "")
        return self.fail(path, f"{shown} is {kind}, want {want}" if kind else
                         f"{shown}, want {want}")

    def whole(self, v, path: str, least: int | None = 0) -> int:
        """A whole number >= least (booleans are not numbers here)."""
        if type(v) is not int or (least is not None and v < least):
            raise self.bad(v, path, "a whole number" + (f" >= {least}" if least is not None
                                                         else ""))
        return v

    def text(self, v, path: str, choices=None) -> str:
        """A string (one of `choices`)."""
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self.bad(v, path, "one of " + ", ".join(map(repr, choices))
                           if choices else "a string")
        return v

    def maybe_text(self, v, path: str, choices=None) -> str | None:
        """A string or null."""
        return None if v is None else self.text(v, path, choices)

    def obj(self, v, path: str, what: str = "an object") -> dict:
        """A JSON object."""
        if not isinstance(v, dict):
            raise self.bad(v, path, what)
        return v

    def items(self, v, path: str, what: str) -> list:
        """A non-empty list."""
        if not isinstance(v, list) or not v:
            raise self.bad(v, path, what)
        return v

    def names(self, v, path: str, n: int) -> tuple[str, ...]:
        """A list of `n` strings."""
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, str) for x in v):
            raise self.bad(v, path, f"a list of {n} dim names")
        return tuple(v)

    def ints(self, v, path: str, n: int | None = None, least: int | None = 0) -> tuple[int, ...]:
        """A list of `n` whole numbers."""
        if not isinstance(v, list) or (n is not None and len(v) != n):
            raise self.bad(v, path, f"a list of {n} whole numbers" if n is not None
                           else "a list of whole numbers")
        return tuple(self.whole(x, f"{path}[{i}]", least) for i, x in enumerate(v))


def parse(data, where: str) -> Index:
    """The Index of a checkpoint's parsed index.json (`where` names it in errors)."""
    f = Fields(where)
    data = f.obj(data, "(top level)", "an object (the index)")
    fmt = data.get("format")
    if fmt != FORMAT:
        if isinstance(fmt, str) and fmt.startswith("soapstone-checkpoint/"):
            raise CheckpointError(
                f"{where}: format {fmt!r}, this soapstone reads {FORMAT!r} (checkpoints with "
                "checksums); load it with the soapstone that wrote it, `soapstone ckpt export` "
                "its weights and start from them with `run --init FILE.safetensors`")
        raise f.fail("format", f"{fmt!r}, want {FORMAT!r}: not a soapstone checkpoint index")
    world = f.get(data, "world_size", "", f.whole, 1)
    chunk = f.get(data, "chunk_bytes", "", f.whole, 1)
    opt = f.get(data, "optimizer", "", f.obj)
    optimizer = Optimizer(f.get(opt, "name", "optimizer", f.maybe_text, tuple(OPTIMIZER_KINDS)),
                          f.get(opt, "steps", "optimizer", f.whole))
    mesh = f.get(data, "mesh", "", f.obj)
    files = parse_files(f, f.get(data, "files", "", f.obj, "an object (file name -> entry)"),
                        world)
    tensors_raw = f.get(data, "tensors", "", f.obj, "an object (tensor name -> entry)")
    tensors = {name: parse_tensor(f, name, t, files, chunk) for name, t in tensors_raw.items()}
    check_kinds(f, tensors, optimizer.name)
    settings = f.get(data, "settings", "", f.obj)
    if "dims" in settings:
        f.obj(settings["dims"], "settings.dims")
    index = Index(
        model=f.get(data, "model", "", f.text),
        parallel=f.get(data, "parallel", "", f.maybe_text, default=None),
        zero=f.get(data, "zero", "", f.whole, default=0),
        mesh={a: f.whole(n, f"mesh.{a}", 1) for a, n in mesh.items()},
        world_size=world, step=f.get(data, "step", "", f.whole),
        seed=f.get(data, "seed", "", f.whole, None), settings=settings,
        optimizer=optimizer, files=files, tensors=tensors, chunk_bytes=chunk, raw=data)
    check_data(f, f.get(data, "data", "", f.obj), index.seed, settings)
    return index


def check_data(f: Fields, data: dict, seed: int, settings: dict) -> None:
    """The data position (`data`: next_batch, seed, source) is well typed and agrees with
    the seed and settings it was saved with (save.index_header writes them all at once)."""
    f.get(data, "next_batch", "data", f.whole)
    data_seed = f.get(data, "seed", "data", f.whole, None)
    source = f.get(data, "source", "data", f.text)
    # next_batch is not held to step x accumulate here: an edited step has its own, sharper
    # checks (the directory's name, every rank file's header) that this would pre-empt
    if data_seed != seed:
        raise f.fail("data.seed", f"{data_seed}, but seed is {seed}")
    want = settings.get("data") or "synthetic"
    if isinstance(want, str) and source != want:
        raise f.fail("data.source", f"{source!r}, but the run read {want!r} (settings.data)")


def parse_files(f: Fields, files: dict, world: int) -> dict[str, File]:
    """The files entries: one per rank 0..world-1, each with its size and header checksum."""
    if not files:
        raise f.fail("files", "empty (every rank writes a file)")
    out, ranks = {}, {}
    for name, e in files.items():
        path = f"files[{name!r}]"
        e = f.obj(e, path)
        rank = f.get(e, "rank", path, f.whole)
        if rank >= world:
            raise f.fail(f"{path}.rank", f"{rank}, but world_size is {world}")
        if rank in ranks:
            raise f.fail(f"{path}.rank", f"{rank}, also the rank of {ranks[rank]!r}")
        ranks[rank] = name
        out[name] = File(name, rank, f.get(e, "bytes", path, f.whole),
                         f.get(e, "header_bytes", path, f.whole, 8),
                         f.get(e, "header_crc32", path, f.whole))
    if len(out) != world:  # ranks are distinct and below world: some are missing
        missing = [r for r in range(len(out) + 1) if r not in ranks]
        raise f.fail("files", f"lists {len(out)} files for world_size {world} (no file of "
                     f"rank {missing[0]}, ...)")
    return out


def parse_tensor(f: Fields, name: str, t, files: dict[str, File], chunk: int) -> Tensor:
    """One tensors entry, its pieces checked against the files and each other."""
    path = f"tensors[{name!r}]"
    t = f.obj(t, path)
    kind = f.get(t, "kind", path, f.text, KINDS)
    param = f.get(t, "param", path, f.text)
    if name != f"{kind}/{param}":
        raise f.fail(path, f"kind {kind!r} and param {param!r} do not make its name")
    dtype = f.get(t, "dtype", path, f.text, tuple(DTYPES))
    shape = f.get(t, "shape", path, f.ints)
    dims = f.get(t, "dims", path, f.names, len(shape))
    layout = f.get(t, "layout", path, f.obj, default={})
    raw = f.get(t, "pieces", path, f.items, "a non-empty list of pieces")
    itemsize = DTYPES[dtype][1]
    pieces = []
    for i, p in enumerate(raw):
        where = f"{path}.pieces[{i}]"
        p = f.obj(p, where)
        file = f.get(p, "file", where, f.text)
        if file not in files:
            raise f.fail(f"{where}.file", f"{file!r}, which files does not list")
        piece = Piece(file, f.get(p, "key", where, f.text),
                      f.get(p, "offset", where, f.ints, len(shape)),
                      f.get(p, "shape", where, f.ints, len(shape)),
                      f.get(p, "crc32", where, f.ints))
        for d, (o, n, full) in enumerate(zip(piece.offset, piece.shape, shape, strict=True)):
            if o + n > full:
                raise f.fail(f"{where}.offset", f"{list(piece.offset)} with shape "
                             f"{list(piece.shape)} reaches past the tensor's {list(shape)} "
                             f"(dim {d})")
        want = -(-math.prod(piece.shape) * itemsize // chunk)
        if len(piece.crc32) != want:
            raise f.fail(f"{where}.crc32", f"{len(piece.crc32)} checksums, its "
                         f"{math.prod(piece.shape) * itemsize} bytes have {want} chunks")
        pieces.append(piece)
    check_tiling(f, path, shape, pieces)
    return Tensor(name, kind, param, dtype, shape, dims, layout, tuple(pieces))


def check_tiling(f: Fields, path: str, shape: tuple[int, ...], pieces: list[Piece]) -> None:
    """The pieces cover the tensor once: no two overlap and their elements add up to it (each
    lies inside it, checked before)."""
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].offset)
    for a, i in enumerate(order):
        bi = pieces[i].box
        for j in order[a + 1:]:
            bj = pieces[j].box
            if bi.offset and bj.offset[0] >= bi.offset[0] + bi.shape[0]:
                break  # sorted by the first dim: no later piece starts inside this one
            if bi.numel and bj.numel and bi.intersect(bj) is not None:
                lo, hi = sorted((i, j))
                raise f.fail(f"{path}.pieces[{hi}].offset",
                             f"{list(pieces[hi].offset)}: the piece overlaps pieces[{lo}] "
                             f"(offset {list(pieces[lo].offset)}, shape "
                             f"{list(pieces[lo].shape)})")
    total = sum(math.prod(p.shape) for p in pieces)
    if total != math.prod(shape):
        raise f.fail(f"{path}.pieces", f"hold {total} elements of the {math.prod(shape)} of "
                     f"shape {list(shape)}")


def check_kinds(f: Fields, tensors: dict[str, Tensor], optimizer: str | None) -> None:
    """Every parameter has the state its optimizer keeps, and nothing else is saved."""
    kinds = ("param", *OPTIMIZER_KINDS.get(optimizer, ()))
    params = {t.param for t in tensors.values() if t.kind == "param"}
    for name, t in tensors.items():
        if t.kind not in kinds:
            raise f.fail(f"tensors[{name!r}]", f"state of kind {t.kind!r}, but optimizer.name "
                         f"is {optimizer!r}")
        if t.param not in params:
            raise f.fail("tensors", f"{name!r} without its parameter 'param/{t.param}'")
    for p in sorted(params):
        for k in kinds:
            if f"{k}/{p}" not in tensors:
                raise f.fail("tensors", f"lacks {k + '/' + p!r} (optimizer {optimizer}); "
                             "an entry was deleted")
