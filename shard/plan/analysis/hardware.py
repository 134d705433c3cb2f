"""Hardware profiles: what one device holds and computes, and what its links move.

The presets live in profiles.json beside this module (its `_doc` says what each field means);
`soapstone bench calibrate -o FILE.json` writes one profile measured on this machine in the
same format. `load_profile(ref)` takes a preset's name or a file's path; a file holds one
profile object, or `{"profiles": [...]}` with exactly one. Every field is required but `fit`
(which constants were fitted to published runs, and the fit's error), `attention`
(attention's rate over the weight matmuls', by the keys a query attends), `memory_bound`
(the rate eager memory-bound ops reach, as the cost model counts their bytes) and
`ring_overlap` (the share of a collective matmul ring's traffic its matmuls hide): a missing
or malformed one is bad input (ProfileError, exit 2) naming the file and the field. No torch
here.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import attrs

from soapstone.comm.errors import UserError

PRESETS_FILE = "profiles.json"


class ProfileError(UserError, ValueError):
    """A hardware profile that is unknown, unreadable or missing a field."""


@attrs.frozen
class Link:
    """The alpha-beta model of one link class: a ring hop costs `latency_s`, and one device
    moves `bandwidth` bytes per second of bus traffic (nccl-tests busbw)."""

    bandwidth: float  # bytes/s
    latency_s: float

    def time(self, hops: int, nbytes: float) -> float:
        """Seconds for a collective of `hops` ring steps moving `nbytes` bus bytes."""
        return hops * self.latency_s + nbytes / self.bandwidth


@attrs.frozen
class Profile:
    """One device kind and its cluster (profiles.json's fields, in SI units)."""

    name: str
    description: str
    memory_bytes: int  # one device's memory
    usable_fraction: float  # the part a model may fill
    devices_per_node: int
    peak_flops: dict[str, float]  # compute dtype ("fp32", "bf16") -> FLOP/s
    matmul_efficiency: float
    memory_bandwidth: float  # bytes/s
    intra_node: Link
    inter_node: Link
    op_overhead_s: float = 0.0  # fixed cost of one op, forward and backward (launch, dispatch)
    source: str = ""  # where it was read from (a preset or a file)
    # which constants are a fit to published runs, on which rows, and the fit's spread
    # (profiles.json's _doc); {} where every constant is a physical figure
    fit: dict = attrs.field(factory=dict, eq=False)
    # attention's score and value matmuls' rate over the weight matmuls' (`matmul_flops`), by
    # the keys a query attends: ((keys, ratio), ...) ascending (profiles.json's `attention`);
    # () where the profile has no curve: attention runs at the weight matmuls' rate
    attention: tuple[tuple[int, float], ...] = ()
    attention_source: str = attrs.field(default="", eq=False)
    # the rate the memory-bound ops (elementwise, norms, rope, the loss) reach, forward and
    # backward, in the bytes the cost model counts for them (bytes/s; profiles.json's
    # `memory_bound`); 0 where not measured: they run at memory_bandwidth
    memory_bound_bandwidth: float = 0.0
    memory_bound_source: str = attrs.field(default="", eq=False)
    # the share of an `overlap tensor` ring's sends that its matmuls hide, of what they could
    # (the shorter of the two; profiles.json's `ring_overlap`): 1 where not given, the ideal
    ring_overlap: float = 1.0
    ring_overlap_source: str = attrs.field(default="", eq=False)

    @property
    def memory_bound_rate(self) -> float:
        """Bytes/s the cost model prices memory-bound ops' bytes at."""
        return self.memory_bound_bandwidth or self.memory_bandwidth

    @property
    def step_error(self) -> float:
        """The step-time model's measured error on this profile (its fit's `error`; 0 where
        nothing was fitted): predictions closer than this cannot be told apart."""
        return float(self.fit.get("error", 0.0))

    @property
    def usable_bytes(self) -> int:
        """Bytes a layout may hold per device."""
        return int(self.memory_bytes * self.usable_fraction)

    def matmul_flops(self, precision: str) -> float:
        """Achievable matmul FLOP/s in `precision`."""
        if precision not in self.peak_flops:
            raise ProfileError(f"profile {self.name} has no peak_tflops for {precision!r} "
                               f"(it has {', '.join(self.peak_flops)})")
        return self.peak_flops[precision] * self.matmul_efficiency

    def attention_ratio(self, keys: int) -> float:
        """Attention's rate over the weight matmuls' where each query attends up to `keys`
        keys: the profile's curve, linear in log2(keys) between its points and flat beyond
        its ends; 1 where it has none."""
        curve = self.attention
        if not curve:
            return 1.0
        if keys <= curve[0][0]:
            return curve[0][1]
        for (k0, r0), (k1, r1) in zip(curve, curve[1:], strict=False):
            if keys <= k1:
                t = math.log2(keys / k0) / math.log2(k1 / k0)
                return r0 + t * (r1 - r0)
        return curve[-1][1]

    def attention_flops(self, precision: str, keys: int) -> float:
        """Achievable FLOP/s of attention's matmuls in `precision` at `keys` keys attended."""
        return self.matmul_flops(precision) * self.attention_ratio(keys)

    def to_data(self) -> dict:
        """The profile in profiles.json's format."""
        return {
            "name": self.name, "description": self.description,
            "memory_gib": self.memory_bytes / 2**30, "usable_fraction": self.usable_fraction,
            "devices_per_node": self.devices_per_node,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "matmul_efficiency": self.matmul_efficiency,
            "memory_bandwidth_gbs": self.memory_bandwidth / 1e9,
            "intra_node": {"bandwidth_gbs": self.intra_node.bandwidth / 1e9,
                           "latency_us": self.intra_node.latency_s * 1e6},
            "inter_node": {"bandwidth_gbs": self.inter_node.bandwidth / 1e9,
                           "latency_us": self.inter_node.latency_s * 1e6},
            "op_overhead_us": self.op_overhead_s * 1e6,
        } | ({"attention": {"keys": [k for k, _ in self.attention],
                            "vs_matmul": [r for _, r in self.attention],
                            "source": self.attention_source}} if self.attention else {}) \
          | ({"memory_bound": {"gbs": self.memory_bound_bandwidth / 1e9,
                               "source": self.memory_bound_source}}
             if self.memory_bound_bandwidth else {}) \
          | ({"ring_overlap": {"fraction": self.ring_overlap,
                               "source": self.ring_overlap_source}}
             if self.ring_overlap != 1.0 or self.ring_overlap_source else {}) \
          | ({"fit": self.fit} if self.fit else {})


# every required field (nested ones as "a.b") -> what its value must be
FIELDS: dict[str, str] = {
    "name": "str", "description": "str", "memory_gib": "num", "usable_fraction": "fraction",
    "devices_per_node": "int", "peak_tflops": "dict", "matmul_efficiency": "fraction",
    "memory_bandwidth_gbs": "num",
    "intra_node.bandwidth_gbs": "num", "intra_node.latency_us": "num0",
    "inter_node.bandwidth_gbs": "num", "inter_node.latency_us": "num0",
    "op_overhead_us": "num0",
}


def _field(data: dict, path: str, where: str):
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ProfileError(f"{where}: missing field '{path}'")
        node = node[part]
    return node


def _check(value, kind: str, path: str, where: str):
    ok = {"str": isinstance(value, str),
          "int": isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          "dict": isinstance(value, dict) and bool(value),
          "fraction": _num(value) and 0 < value <= 1,
          "num": _num(value) and value > 0,
          "num0": _num(value) and value >= 0}[kind]
    if not ok:
        want = {"str": "a string", "int": "an integer >= 1", "dict": "a non-empty object",
                "fraction": "a number in (0, 1]", "num": "a positive number",
                "num0": "a number >= 0"}[kind]
        raise ProfileError(f"{where}: field '{path}' must be {want}, got {value!r}")
    return value


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def profile_from_data(data: dict, where: str) -> Profile:
    """A Profile from one profiles.json entry (ProfileError naming `where` and the field)."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
    v = {path: _check(_field(data, path, where), kind, path, where)
         for path, kind in FIELDS.items()}
    peaks = {}
    for k, tf in v["peak_tflops"].items():
        peaks[k] = _check(tf, "num", f"peak_tflops.{k}", where) * 1e12
    return Profile(
        name=v["name"], description=v["description"],
        memory_bytes=int(v["memory_gib"] * 2**30), usable_fraction=float(v["usable_fraction"]),
        devices_per_node=v["devices_per_node"], peak_flops=peaks,
        matmul_efficiency=float(v["matmul_efficiency"]),
        memory_bandwidth=v["memory_bandwidth_gbs"] * 1e9,
        intra_node=Link(v["intra_node.bandwidth_gbs"] * 1e9, v["intra_node.latency_us"] * 1e-6),
        inter_node=Link(v["inter_node.bandwidth_gbs"] * 1e9, v["inter_node.latency_us"] * 1e-6),
        op_overhead_s=v["op_overhead_us"] * 1e-6, source=where, fit=_fit(data, where),
        attention=_attention(data, where), attention_source=str(
            data.get("attention", {}).get("source", "")),
        memory_bound_bandwidth=_memory_bound(data, where) * 1e9,
        memory_bound_source=str(data.get("memory_bound", {}).get("source", "")),
        ring_overlap=_ring_overlap(data, where),
        ring_overlap_source=str(data.get("ring_overlap", {}).get("source", "")))


def _ring_overlap(data: dict, where: str) -> float:
    """The optional `ring_overlap`: an object whose `fraction` lies in [0, 1]; 1 if absent."""
    if "ring_overlap" not in data:
        return 1.0
    r = data["ring_overlap"]
    if not isinstance(r, dict) or "fraction" not in r or \
            not isinstance(r["fraction"], int | float) or isinstance(r["fraction"], bool) or \
            not 0.0 <= r["fraction"] <= 1.0:
        raise ProfileError(f"{where}: field 'ring_overlap' must be an object with a "
                           "'fraction' from 0 to 1 (the share of a ring's traffic its matmuls "
                           f"hide; 'source' optional), got {r!r}")
    return float(r["fraction"])


def _memory_bound(data: dict, where: str) -> float:
    """The optional `memory_bound` rate (GB/s): an object with a positive `gbs`; 0 if absent."""
    if "memory_bound" not in data:
        return 0.0
    m = data["memory_bound"]
    if not isinstance(m, dict) or "gbs" not in m:
        raise ProfileError(f"{where}: field 'memory_bound' must be an object with 'gbs' (the "
                           f"rate memory-bound ops reach, GB/s; 'source' optional), got {m!r}")
    return float(_check(m["gbs"], "num", "memory_bound.gbs", where))


def _attention(data: dict, where: str) -> tuple[tuple[int, float], ...]:
    """The optional `attention` curve: `keys` (ascending integers >= 1) and `vs_matmul`
    (positive ratios), one for one."""
    if "attention" not in data:
        return ()
    a = data["attention"]
    if not isinstance(a, dict) or not isinstance(a.get("keys"), list) or \
            not isinstance(a.get("vs_matmul"), list) or not a["keys"] or \
            len(a["keys"]) != len(a["vs_matmul"]):
        raise ProfileError(f"{where}: field 'attention' must be an object with lists 'keys' "
                           "and 'vs_matmul' of one length (keys attended, the rate over "
                           f"matmul_efficiency's), got {a!r}")
    keys = [_check(k, "int", "attention.keys", where) for k in a["keys"]]
    ratios = [_check(r, "num", "attention.vs_matmul", where) for r in a["vs_matmul"]]
    if any(k1 <= k0 for k0, k1 in zip(keys, keys[1:], strict=False)):
        raise ProfileError(f"{where}: field 'attention.keys' must ascend, got {keys}")
    top = 1 / float(data["matmul_efficiency"])  # beyond it attention would outrun the peak
    if any(r > top for r in ratios):
        raise ProfileError(f"{where}: field 'attention.vs_matmul' must stay at or below 1 / "
                           f"matmul_efficiency = {top:.3f} (the peak), got {ratios}")
    return tuple(zip(keys, (float(r) for r in ratios), strict=True))


def _fit(data: dict, where: str) -> dict:
    """The optional `fit` record: an object whose `error`, when given, is a fraction."""
    fit = data.get("fit", {})
    if not isinstance(fit, dict):
        raise ProfileError(f"{where}: field 'fit' must be an object, got {fit!r}")
    if "error" in fit:
        _check(fit["error"], "num0", "fit.error", where)
    return fit


def _profiles_in(data, where: str) -> list[Profile]:
    if isinstance(data, dict) and "profiles" in data:
        items = data["profiles"]
        if not isinstance(items, list):
            raise ProfileError(f"{where}: 'profiles' must be a list of profile objects")
        return [profile_from_data(p, f"{where} (profile {i})") for i, p in enumerate(items)]
    return [profile_from_data(data, where)]


def presets() -> dict[str, Profile]:
    """The named presets of profiles.json, by name."""
    text = resources.files("soapstone.shard.plan.analysis").joinpath(PRESETS_FILE).read_text()
    return {p.name: p for p in _profiles_in(json.loads(text), PRESETS_FILE)}


def load_profile(ref: str) -> Profile:
    """A preset by name, or the one profile in the JSON file at path `ref` (ProfileError)."""
    known = presets()
    if ref in known:
        return known[ref]
    path = Path(ref)
    if not path.is_file():
        raise ProfileError(f"unknown profile {ref!r}: neither a preset ({', '.join(known)}) "
                           "nor a file (`soapstone bench calibrate -o FILE.json` writes one)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{ref}: cannot read the profile: {e}") from None
    found = _profiles_in(data, ref)
    if len(found) != 1:
        raise ProfileError(f"{ref}: holds {len(found)} profiles; a profile file holds one")
    return found[0]


def save_profile(profile: Profile, path: str) -> None:
    """Write `profile` as a one-profile JSON file that `load_profile(path)` reads back."""
    Path(path).write_text(json.dumps(profile.to_data(), indent=2) + "\n")
