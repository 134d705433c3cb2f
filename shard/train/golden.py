"""Golden runs: record a single-rank training run, check that a sharded layout reproduces it.

File format (`.npz`, written and read with allow_pickle=False, so loading runs no code):

    header            uint8[]  UTF-8 JSON: {"format": "soapstone-golden/1", "model", "spec",
                               "dims" (the --dim overrides), "steps", "seed", "optimizer", "lr",
                               "precision", "data", "params" (names, program order),
                               "samples" (flat indices sampled per param), "full": bool,
                               "torch" (version that recorded it)}
    loss              f64[steps]            the global loss of each step's forward
    digest/<param>    f64[steps, 3 + k]     after each step's update: sum, abs-sum, abs-max,
                                            then the values at the k sampled flat indices
    final/<param>     the full final tensor (only when the model has <= FULL_LIMIT elements)

A record is read whole and checked before a check trains (`check_record`: every header field's
type and range, every array present, finite and of its shape; `check_shapes`: against the
model's parameters): a damaged or inconsistent record is a GoldenError (exit 2) naming the file
and what is wrong, never a traceback or a FAIL; exit 1 is kept for a layout that does not
reproduce a sound record.

Tolerances (`Tolerance`): losses rtol 1e-5. Parameters are compared against their own scale:
|got - want| <= rtol * (|want| + scale) where scale is the tensor's abs-max (abs-sum for the
sum). That holds for SGD (the default optimizer of golden runs): an update is lr * gradient,
and the gradient differs between layouts only by summation order (~1e-7 relative). AdamW
divides each gradient by its own running magnitude, so an element whose gradient is near zero
turns that rounding into a visible change of its update (tests/shard/runtime/numerics_cases.py): for
AdamW records the parameter tolerance adds an absolute 1e-2 * lr per step, 1% of one update.
SGD records add fp32's epsilon * lr per step, one rounding of an update with a unit gradient:
a parameter whose exact gradient is zero (GPT-2's key bias: softmax ignores a shift shared by
every key) holds nothing but summation-order noise, which no relative tolerance of its own
scale can judge.
"""

from __future__ import annotations

import json
import math
import numbers
import zipfile
import zlib
from pathlib import Path

import attrs
import numpy as np
import torch

from soapstone.comm.dtype_table import MIXED_PRECISIONS, PRECISIONS
from soapstone.comm.errors import UserError
from soapstone.shard.train.optim import OPTIMIZERS

FORMAT = "soapstone-golden/1"
SAMPLES = 8
FULL_LIMIT = 1 << 20
# header keys the checker reads (the others are optional: "data", "dims", "full", ...)
REQUIRED = ("model", "steps", "seed", "optimizer", "lr", "precision", "params")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# (header key, its check, what it must be) for every key a check reads, where present
HEADER_FIELDS = (
    ("model", lambda v: isinstance(v, str) and v != "", "a model name"),
    ("steps", lambda v: _whole(v) and v >= 1, "a whole number of steps >= 1"),
    ("seed", _whole, "a whole number (the run's --seed)"),
    ("lr", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
     and 0 < v < math.inf, "a positive number (the run's --lr)"),
    ("params", lambda v: isinstance(v, list) and v and all(isinstance(n, str) for n in v)
     and len(set(v)) == len(v), "a list of distinct parameter names"),
    ("dims", lambda v: v is None or isinstance(v, dict) and all(
        isinstance(k, str) and _whole(n) and n >= 1 for k, n in v.items()),
     "an object of --dim sizes (name -> whole number >= 1)"),
    ("data", lambda v: v is None or isinstance(v, str), "null or the --data file"),
    ("full", lambda v: isinstance(v, bool), "true or false"),
)


class GoldenError(UserError, ValueError):
    """An unreadable or mismatched record file (bad input: exit 2)."""

@attrs.define
class Record:
    """A recorded run: its header and, per step, the loss and each parameter's digest."""

    header: dict
    loss: np.ndarray
    digests: dict[str, np.ndarray]
    final: dict[str, np.ndarray] = attrs.field(factory=dict)

    @property
    def steps(self) -> int:
        return int(self.header["steps"])


@attrs.define
class Tolerance:
    """rtol on losses and on parameters relative to their scale; atol added per step."""

    loss_rtol: float = 1e-5
    param_rtol: float = 1e-5
    param_atol_per_step: float = 0.0

    @classmethod
    def for_record(cls, header: dict) -> Tolerance:
        """The documented default: AdamW records allow 1% of an update (lr) per step, SGD
        records one fp32 rounding of a unit-gradient update (module doc)."""
        adamw = header.get("optimizer") == "adamw"
        per = 1e-2 if adamw else float(np.finfo(np.float32).eps)
        return cls(param_atol_per_step=per * float(header["lr"]))


@attrs.define
class Mismatch:
    """Where a run first left the record."""

    step: int
    tensor: str  # "loss" or a parameter name
    what: str  # "loss", "sum", "abs-sum", "abs-max", "sample i", "final"
    got: float
    want: float
    limit: float

    def __str__(self) -> str:
        where = "the loss" if self.tensor == "loss" else f"parameter {self.tensor} ({self.what})"
        return (f"step {self.step}: {where} = {self.got!r}, recorded {self.want!r} "
                f"(|diff| {abs(self.got - self.want):.3e} > {self.limit:.3e})")


def sample_indices(numel: int, k: int = SAMPLES) -> list[int]:
    """k flat indices spread evenly over a tensor (all of them when it is smaller)."""
    if numel <= k:
        return list(range(numel))
    return [int(round(i * (numel - 1) / (k - 1))) for i in range(k)]


def digest(t: torch.Tensor) -> np.ndarray:
    """sum, abs-sum, abs-max and the sampled values of a full tensor, in float64."""
    flat = t.detach().reshape(-1).double().cpu()  # a GPU run's tensors are read on the host
    idx = sample_indices(flat.numel())
    head = [float(flat.sum()), float(flat.abs().sum()), float(flat.abs().max())
            if flat.numel() else 0.0]
    return np.array(head + [float(flat[i]) for i in idx], dtype=np.float64)


class Recorder:
    """Collects a run step by step; `save(path)` writes the .npz."""

    def __init__(self, header: dict, params: list[str]):
        self.header = dict(header, format=FORMAT, params=list(params), torch=torch.__version__)
        self.loss: list[float] = []
        self.digests: dict[str, list[np.ndarray]] = {n: [] for n in params}
        self.final: dict[str, np.ndarray] = {}

    def add(self, loss: float, state: dict[str, torch.Tensor]) -> None:
        self.loss.append(float(loss))
        for name in self.digests:
            self.digests[name].append(digest(state[name]))

    def finish(self, state: dict[str, torch.Tensor]) -> Record:
        total = sum(t.numel() for t in state.values())
        self.header["steps"] = len(self.loss)
        self.header["full"] = total <= FULL_LIMIT
        final = {n: t.detach().float().cpu().numpy().copy() for n, t in state.items()} \
            if self.header["full"] else {}
        return Record(self.header, np.array(self.loss, dtype=np.float64),
                      {n: np.stack(d) for n, d in self.digests.items()}, final)


def save(record: Record, path: str | Path) -> None:
    """Write a record (.npz, no pickles)."""
    arrays = {"header": np.frombuffer(json.dumps(record.header, indent=1).encode(), np.uint8),
              "loss": record.loss}
    arrays.update({f"digest/{n}": d for n, d in record.digests.items()})
    arrays.update({f"final/{n}": t for n, t in record.final.items()})
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load(path: str | Path) -> Record:
    """Read a record and check it whole (`check_record`); GoldenError when the file is
    missing, not a soapstone record, or damaged."""
    p = Path(path)
    if not p.is_file():
        raise GoldenError(f"{path}: no such golden record")
    try:
        z = np.load(p, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise GoldenError(f"{path}: one array (.npy), not a soapstone golden record (.npz "
                              "written by `soapstone golden record`)")
        with z:  # every member read now: a damaged one fails its CRC-32 here, not mid-check
            arrays = {name: z[name] for name in z.files}
    except GoldenError:
        raise
    # zipfile also raises NotImplementedError (a compression method or version a flipped
    # byte names) and RuntimeError (a flag bit that says encrypted)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError) as e:
        why = f"{type(e).__name__}: {e}"
        try:
            with open(p, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"  # what every .npz starts with
        except OSError:
            zipped = False
        if not zipped:
            raise GoldenError(f"{path}: not a soapstone golden record ({why})") from None
        if not zipfile.is_zipfile(p):  # the zip's directory is at the end: gone when cut
            why = "cut short: its zip directory is missing"
        raise GoldenError(f"{path}: a damaged record ({why}); {rerecord(path)}") from None
    return check_record(arrays, path)


def rerecord(path, header: dict | None = None) -> str:
    """The fix for a damaged record: record it again (naming its spec when the header does)."""
    spec = (header or {}).get("spec")
    return (f"re-record it with `soapstone golden record "
            f"{spec if isinstance(spec, str) else 'SPEC'} -o {path}`")


def check_record(arrays: dict[str, np.ndarray], path) -> Record:
    """The Record of a record file's arrays, every header field and array checked against
    the format (module doc) and each other; GoldenError naming the field or array."""
    raw = arrays.get("header")
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise GoldenError(f"{path}: not a soapstone golden record (no JSON header)")
    try:
        header = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenError(f"{path}: its header is not JSON ({e}); {rerecord(path)}") from None
    if not isinstance(header, dict):
        raise GoldenError(f"{path}: its header is not a JSON object; {rerecord(path)}")

    def bad(what: str) -> GoldenError:
        return GoldenError(f"{path}: {what}; {rerecord(path, header)}")

    if header.get("format") != FORMAT:
        raise GoldenError(f"{path}: format {header.get('format')!r}, expected {FORMAT}")
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise bad(f"header lacks {', '.join(map(repr, missing))}")
    for key, known in (("optimizer", OPTIMIZERS),
                       ("precision", (*PRECISIONS, *MIXED_PRECISIONS))):
        if header[key] not in known:
            raise bad(f"header {key} {header[key]!r} is none of {', '.join(known)}")
    for key, ok, want in HEADER_FIELDS:
        if key in header and not ok(header[key]):
            raise bad(f"header {key} {header[key]!r}: want {want}")
    steps, names = header["steps"], header["params"]
    full = header.get("full", False)
    expected = {"header", "loss", *(f"digest/{n}" for n in names),
                *(f"final/{n}" for n in names if full)}
    lacking, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if lacking:
        raise bad(f"no array {lacking[0]}, which its header's params (and full) ask for")
    if extra:
        raise bad(f"array {extra[0]}, which its header's params (and full) do not name")
    loss = arrays["loss"]
    if loss.shape != (steps,):
        raise bad(f"header says {steps} steps, but the loss array has shape {loss.shape}")
    for name, a in arrays.items():
        if name == "header":
            continue
        if not np.issubdtype(a.dtype, np.floating):
            raise bad(f"{name} holds {a.dtype} values, not floating point")
        if not np.isfinite(a).all():  # a run that met a NaN stops (exit 3) and records nothing
            raise bad(f"{name} holds a value that is not finite")
    for n in names:
        d = arrays[f"digest/{n}"]
        if d.ndim != 2 or d.shape[0] != steps or not 4 <= d.shape[1] <= 3 + SAMPLES:
            raise bad(f"digest/{n} has shape {d.shape}, expected {steps} rows of sum, abs-sum, "
                      f"abs-max and 1 to {SAMPLES} sampled values")
    return Record(header, loss, {n: arrays[f"digest/{n}"] for n in names},
                  {n: arrays[f"final/{n}"] for n in names} if full else {})


def check_shapes(record: Record, shapes: dict[str, tuple[int, ...]], path) -> None:
    """The record fits the model whose parameters have these (global) shapes: each digest
    samples as many values as the parameter has samples, each final tensor has its shape;
    GoldenError naming the tensor (a record of another model, or edited)."""
    for name, shape in shapes.items():
        numel = math.prod(shape)
        cols = 3 + len(sample_indices(numel))
        d = record.digests[name]
        if d.shape[1] != cols:
            raise GoldenError(f"{path}: digest/{name} has {d.shape[1]} columns, but the model's "
                              f"{name} ({numel} elements) has {cols}: sum, abs-sum, abs-max and "
                              f"{cols - 3} sampled values; {rerecord(path, record.header)}")
        final = record.final.get(name)
        if final is not None and tuple(final.shape) != tuple(shape):
            raise GoldenError(f"{path}: final/{name} has shape {list(final.shape)}, but the "
                              f"model's {name} is {list(shape)}; {rerecord(path, record.header)}")


def compare_step(record: Record, step: int, loss: float, state: dict[str, torch.Tensor],
                 tol: Tolerance) -> Mismatch | None:
    """The first difference at `step` (loss first, then parameters in program order)."""
    want = float(record.loss[step])
    limit = tol.loss_rtol * abs(want)
    if not abs(loss - want) <= limit:
        return Mismatch(step, "loss", "loss", float(loss), want, limit)
    atol = tol.param_atol_per_step * (step + 1)
    names = ["sum", "abs-sum", "abs-max"]
    for name in record.header["params"]:
        want_d, got_d = record.digests[name][step], digest(state[name])
        scale = want_d[2]
        for i, (g, w) in enumerate(zip(got_d, want_d, strict=True)):
            ref = want_d[1] if i == 0 else scale  # the sum cancels: judge it by the abs-sum
            n = atol * (state[name].numel() if i in (0, 1) else 1)
            lim = tol.param_rtol * (abs(w) + ref) + n
            if not abs(g - w) <= lim:
                what = names[i] if i < 3 else f"value at flat index " \
                    f"{sample_indices(state[name].numel())[i - 3]}"
                return Mismatch(step, name, what, float(g), float(w), lim)
    return None


def compare_final(record: Record, state: dict[str, torch.Tensor],
                  tol: Tolerance) -> Mismatch | None:
    """Every element of every final parameter (records of small models only)."""
    step = record.steps - 1
    atol = tol.param_atol_per_step * record.steps
    for name, want in record.final.items():
        got = state[name].detach().double().cpu()
        w = torch.from_numpy(want).double()
        if got.shape != w.shape:
            return Mismatch(step, name, f"shape {list(got.shape)} vs {list(w.shape)}",
                            0.0, 0.0, 0.0)
        lim = tol.param_rtol * (w.abs() + w.abs().max()) + atol
        bad = (got - w).abs() > lim
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0])
            return Mismatch(step, name, f"final, flat index {i}", float(got.reshape(-1)[i]),
                            float(w.reshape(-1)[i]), float(lim.reshape(-1)[i]))
    return None
