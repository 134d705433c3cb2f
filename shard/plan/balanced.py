"""Load-balanced (zigzag) sequence splits: `attribute seq -> cp balanced`.

A causal mask lets query i see keys 0..i, so with contiguous slices the last rank of a
context-parallel axis has cp times the first one's work. Cut the sequence into 2n chunks
instead and give rank r chunks r and 2n-1-r (Megatron's and torchtitan's load-balanced
context parallelism): every rank holds as many early as late positions, the same number of
visible (query, key) pairs. A balanced split is a permutation of the dim followed by the
usual contiguous split: the concatenation of the ranks' pieces in rank order is `zigzag`.
Pure Python (the compiler, `show` and the cost model read it without torch).
"""

from __future__ import annotations


def chunks_of(rank: int, parts: int) -> tuple[int, int]:
    """The two chunks (of 2 x parts) rank `rank` of a balanced split holds, in its order."""
    return rank, 2 * parts - 1 - rank


def local_positions(size: int, parts: int, rank: int) -> list[int]:
    """The global positions a rank holds along a dim of `size` split balanced over `parts`."""
    c = size // (2 * parts)
    return [i for k in chunks_of(rank, parts) for i in range(k * c, (k + 1) * c)]


def rank_runs(size: int, parts: int, rank: int, balanced: bool) -> list[tuple[int, int, int]]:
    """The runs of consecutive positions rank `rank` holds along a dim of `size` split over
    `parts`, each (first index in the piece, first position, length): its two zigzag chunks
    where balanced (kept apart even where they meet, on the middle rank, so that each attends
    its own key prefix), else one contiguous slice."""
    if balanced:
        c = size // (2 * parts)
        return [(i * c, k * c, c) for i, k in enumerate(chunks_of(rank, parts))]
    n = size // parts
    return [(0, rank * n, n)]


def piece_runs(runs: list[tuple[int, int, int]], start: int,
               n: int) -> list[tuple[int, int, int]]:
    """The runs (as `rank_runs` gives them) of the contiguous piece [start, start + n) of a
    rank's local order, indices counted from the piece's start: sequence parallel inside a
    balanced split cuts the rank's concatenated zigzag chunks over a second axis."""
    out = []
    for at, first, length in runs:
        lo, hi = max(at, start), min(at + length, start + n)
        if lo < hi:
            out.append((lo - start, first + lo - at, hi - lo))
    return out


def nested_runs(size: int, parts: int, rank: int, balanced: bool, piece: int,
                pieces: int) -> list[tuple[int, int, int]]:
    """`rank_runs` of a dim split over `parts` and then, inside each rank's local order, over
    `pieces` more (this rank holding piece `piece` of them)."""
    n = size // parts // pieces
    return piece_runs(rank_runs(size, parts, rank, balanced), piece * n, n)


def zigzag(size: int, parts: int) -> list[int]:
    """The global positions in the order the ranks' pieces concatenate (rank 0's first)."""
    return [i for r in range(parts) for i in local_positions(size, parts, r)]


def unzigzag(size: int, parts: int) -> list[int]:
    """The inverse of `zigzag`: where global position i sits in the concatenated pieces."""
    order = zigzag(size, parts)
    out = [0] * size
    for at, pos in enumerate(order):
        out[pos] = at
    return out


def causal_prefix_work(held: list[tuple[int, int, int]], keys: int) -> float:
    """The share of a (queries x keys) score square computed when each run of consecutive
    query positions (`held`: runs as `rank_runs` gives them) attends only the key prefix it can
    see under a causal mask (0..its last position): sum of length x prefix over the
    queries x keys."""
    shares = prefix_shares(held, keys)
    return sum(share for _, share in shares) if shares else 1.0


def prefix_shares(held: list[tuple[int, int, int]], keys: int) -> list[tuple[int, float]]:
    """Each run of `held` as (the key prefix it attends, its share of the queries x keys
    square): `causal_prefix_work` run by run; [] for no queries or keys."""
    queries = sum(n for _, _, n in held)
    if not queries or not keys:
        return []
    return [(min(first + n, keys), n * min(first + n, keys) / (queries * keys))
            for _, first, n in held]


def own_axes(program) -> dict[str, str]:
    """Each balanced dim of a Program with its own axis: the first in mesh order any value
    splits it over. A second axis (sequence parallel inside context parallel) cuts and
    gathers the pieces in the order they lie, with no permutation: the checker orders them."""
    order = [a for a, _ in program.mesh]
    found = {d: {a for v in program.values for a in v.layout.dim_axes(d)}
             for d in program.balanced}
    return {d: min(axes, key=order.index) for d, axes in found.items() if axes}
