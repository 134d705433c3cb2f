"""A counter-based random generator: the value at a flat index is a function of (key, index).

A rank can therefore draw any box of a tensor (its shard) without drawing the rest, and the
box's values equal the same positions of the whole tensor drawn at once, bit for bit, on any
layout. The stream is splitmix64's finaliser over `key + index * golden gamma` (int64 torch
arithmetic, wrapping as uint64 would), the top 53 bits make a uniform in (0, 1), and normals
come from the inverse normal CDF (Acklam's rational approximation, relative error < 1.2e-9).

Only IEEE basic operations (+, -, *, /, sqrt) and exact bit operations are used, one torch op
at a time: each is correctly rounded whether torch runs it vectorised or on a scalar tail and
on CPU or CUDA alike, so where an element falls in a chunk cannot change its value. (torch's
own log/cos take SIMD and scalar paths that can differ in the last bit, hence the own log.)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch

CHUNK = 1 << 15  # elements hashed at once: the working int64/float64 buffers stay in cache


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _i64(0x9E3779B97F4A7C15)  # splitmix64's increment
MIX1 = _i64(0xBF58476D1CE4E5B9)
MIX2 = _i64(0x94D049BB133111EB)


def key_of(seed: int, name: str) -> int:
    """The 64-bit stream key of a named tensor under `seed` (as an int64)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return _i64(int.from_bytes(digest, "little"))


def _chunks(shape: tuple[int, ...], box: tuple[slice, ...],
            device) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """(slices of the box's local tensor, GAMMA * global flat index of those elements) for
    pieces of at most CHUNK elements (or one row of the last dim), in row-major order."""
    if not shape:
        yield (), torch.zeros(1, dtype=torch.int64, device=device)
        return
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    # GAMMA * flat index = the sum over dims of GAMMA * index * stride (all wrapping mod 2^64)
    parts = [torch.arange(s.start, s.stop, dtype=torch.int64, device=device).mul_(_i64(st * GAMMA))
             for s, st in zip(box, strides, strict=True)]
    if all(len(p) for p in parts):
        yield from _pieces(parts, 0)


def _pieces(parts: list[torch.Tensor], d: int):
    """_chunks over dims d.. of the box: (slices of those dims, their summed parts)."""
    inner = math.prod(len(p) for p in parts[d + 1:])
    if inner > CHUNK:  # a slab of dim d is too big: one index of d at a time
        for i in range(len(parts[d])):
            for sl, flat in _pieces(parts, d + 1):
                yield (slice(i, i + 1), *sl), flat + parts[d][i]
        return
    rows = max(1, CHUNK // inner)
    rest = (slice(None),) * (len(parts) - d - 1)
    for a in range(0, len(parts[d]), rows):
        flat = parts[d][a:a + rows]
        for p in parts[d + 1:]:
            flat = (flat.unsqueeze(-1) + p).reshape(-1)
        yield (slice(a, a + len(flat) // inner), *rest), flat


def _uniform53(key: int, flat: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, from GAMMA * index."""
    x = flat + key
    t = torch.empty_like(x)
    for shift, mult in ((30, MIX1), (27, MIX2), (31, None)):
        # a logical right shift: torch's >> on int64 is arithmetic, so mask the sign copies
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(t)
        if mult is not None:
            x.mul_(mult)
    x.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    return x.to(torch.float64).add_(0.5).mul_(2.0 ** -53)


# Acklam's inverse normal CDF: a rational function of q = u - 1/2 in the middle, of
# sqrt(-2 log p) in the tails (p = min(u, 1 - u) < P_LOW)
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01, 1.0)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00, 1.0)
P_LOW = 0.02425
LN2 = 0.6931471805599453


def _horner(coeffs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    """coeffs[0] * x^(n-1) + ... + coeffs[-1], one multiply and one add per coefficient."""
    y = x * coeffs[0]
    for c in coeffs[1:-1]:
        y.add_(c).mul_(x)
    return y.add_(coeffs[-1])


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64 values, from basic operations only (error < 1e-15)."""
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1): exact
    low = m < 0.7071067811865476
    m = torch.where(low, m * 2, m)  # now in [1/sqrt 2, sqrt 2)
    e = e.to(torch.float64).sub_(low.to(torch.float64))
    s = (m - 1).div_(m + 1)  # log m = 2 atanh s, |s| < 0.172
    s2 = s * s
    series = _horner(tuple(1 / k for k in range(15, 0, -2)), s2)
    return series.mul_(s).mul_(2).add_(e.mul_(LN2))


def normal_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard normals, float64, as the inverse normal CDF of uniforms in (0, 1)."""
    q = u - 0.5
    r = q * q
    z = _horner(_A, r).mul_(q).div_(_horner(_B, r))
    tail = (q.abs() > 0.5 - P_LOW).nonzero().squeeze(1)
    if len(tail):
        ut = u[tail]
        t = log(torch.minimum(ut, 1 - ut)).mul_(-2).sqrt_()
        zt = _horner(_C, t).div_(_horner(_D, t))
        z[tail] = torch.where(ut < 0.5, zt, -zt)
    return z


def draw(kind: str, key: int, shape: tuple[int, ...], box: tuple[slice, ...], scale: float,
         dtype: torch.dtype, device=None) -> torch.Tensor:
    """The box `box` of a tensor of `shape` whose elements are normal with mean 0 and std
    `scale` (`kind` "normal") or uniform on (-scale, scale) ("uniform"), each a function of
    `key` and its flat index; computed in float64, returned as `dtype`. Time and memory are
    those of the box."""
    out = torch.empty(tuple(s.stop - s.start for s in box), dtype=dtype, device=device)
    for sl, flat in _chunks(shape, box, device):
        u = _uniform53(key, flat)
        v = normal_from_uniform(u) if kind == "normal" else u.mul_(2).sub_(1)
        out[sl] = v.mul_(scale).reshape(out[sl].shape)
    return out
