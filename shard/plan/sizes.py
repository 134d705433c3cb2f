"""The sizes soapstone computes with, and the arithmetic that keeps every size cheap.

`check`, `show`, `explain`, `plan` and the fit check answer in bounded time and memory for
any number in a spec or a flag: sizes enter arithmetic (products, closed forms), never a
loop over 1..n. What cannot be computed sensibly is refused (exit 2) at these bounds:

- a dim (and a microbatch count) at most MAX_DIM = 2**63 - 1: torch's sizes are int64;
- a mesh (and `plan --world`) at most MAX_RANKS = 2**31 - 1 ranks: MPI numbers ranks with C
  ints;
- a repeat block at most MAX_REPEAT instances: the IR unrolls every instance into its own
  ops, so a model's ops grow with it (a few hundred blocks is already a very deep model);
- the proof before launch (`check --verify`, `run`) derives every call of one step: at
  most PROOF_RANKS ranks (each call lists its communicator's) and PROOF_WORK calls (the
  ranks it derives x microbatches x the ops a rank runs per microbatch);
- `show` draws a schedule of at most DRAWN_MICROBATCHES microbatches (x virtual stages per
  rank), and otherwise says so beside its bubble.

Divisors come from the prime factorisation (trial division by the small primes, then
Pollard-Brent with a deterministic Miller-Rabin test): a prime of 2**61 - 1 is as quick as 12.
"""

from __future__ import annotations

import math

MAX_DIM = 2**63 - 1
MAX_RANKS = 2**31 - 1
MAX_REPEAT = 1024
PROOF_RANKS = 2**20
PROOF_WORK = 2**20  # ~ a few seconds of the prover
DRAWN_MICROBATCHES = 1024

_SMALL = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact below 3.3e24."""
    if n < 2:
        return False
    for p in _SMALL:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _SMALL:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_brent(n: int) -> int:
    """A non-trivial factor of the odd composite n."""
    for c in range(1, n):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ValueError(f"no factor of {n} found")  # unreachable for a composite n


def factorise(n: int) -> dict[int, int]:
    """n >= 1 as {prime: exponent}."""
    if n < 1 or n > MAX_DIM:
        raise ValueError(f"factorise({n}): only 1 .. 2**63 - 1")
    out: dict[int, int] = {}
    for p in _SMALL:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    todo = [n] if n > 1 else []
    while todo:
        m = todo.pop()
        if is_prime(m):
            out[m] = out.get(m, 0) + 1
        else:
            f = _pollard_brent(m)
            todo += [f, m // f]
    return dict(sorted(out.items()))


def divisors(n: int) -> list[int]:
    """Every divisor of n (1 <= n <= MAX_DIM), ascending (at most ~10^5 of them)."""
    out = [1]
    for p, e in factorise(n).items():
        out = [d * p**k for d in out for k in range(e + 1)]
    return sorted(out)


def nearest_divisor(n: int, near: int) -> int:
    """The divisor of n closest to `near` (the smaller on a tie)."""
    return min(divisors(n), key=lambda d: (abs(d - near), d))
