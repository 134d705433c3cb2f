"""The token file loader against nanoGPT's get_batch, on the same .bin file.

- nanoGPT: train.py's get_batch as it stands (a new np.memmap per batch, a Python loop of
  slices, torch.stack of per-row int64 copies, x and y stacked apart);
- soapstone: TokenMemmap.batch (shard/data/token_memmap.py), one os.pread of every row's
  window (shard/data/token_reader.py), reading every row (one rank of one), and as one of 8
  data-parallel ranks reads it (its 1/8 of the rows).

Same uint16 file, same batch shape (batch x seq), offsets drawn per batch; the two loaders are
timed alternately in rounds, in one process, and the medians compared as ratios. The file is
written once (random ids); the page cache holds it after the first round, as it does during a
run whose data fits in memory.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_token_data.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def nanogpt_get_batch(path: str, batch_size: int, block_size: int):
    """nanoGPT train.py's get_batch (CPU branch), verbatim in behaviour."""
    import torch

    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                     for i in ix])
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000_000, help="ids in the file")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=50, help="batches per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.data.token_memmap import TokenMemmap

    tmp = Path(tempfile.mkdtemp())
    path = str(tmp / "train.bin")
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for at in range(0, args.tokens, 1 << 24):
            n = min(1 << 24, args.tokens - at)
            f.write(rng.integers(0, 50257, n, dtype=np.uint16).tobytes())
    dims = {"batch": args.batch, "seq": args.seq, "vocab": 65536}
    program = lower(dsl.load(ROOT / "examples/gpt.par", dims=dims).model(), None)
    whole = TokenMemmap(program, path, seed=0, val_fraction=0.01)
    share = TokenMemmap(program, path, seed=0, val_fraction=0.01)
    rows = list(range(args.batch // 8))
    share.read_rows({"tokens": rows, "targets": rows})

    ways = {
        "nanoGPT get_batch": lambda i: nanogpt_get_batch(path, args.batch, args.seq),
        "soapstone, all rows": whole.batch,
        "soapstone, 1 of 8 ranks": share.batch,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds + 1):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for i in range(args.batches):
                fn(r * args.batches + i)
            if r:  # round 0 warms the page cache and the allocator
                times[name].append((time.perf_counter() - t0) / args.batches)
    Path(path).unlink()
    tmp.rmdir()
    base = statistics.median(times["nanoGPT get_batch"])
    tokens = args.batch * args.seq
    print(f"{args.tokens:,} uint16 tokens ({args.tokens * 2 / 2**20:.0f} MiB), batch "
          f"{args.batch} x seq {args.seq}, {args.batches} batches x {args.rounds} rounds")
    print(f"{'loader':<26} {'ms/batch':>9} {'Mtok/s':>8} {'vs nanoGPT':>11}")
    out = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        out[name] = {"ms_per_batch": t * 1e3, "tokens_per_s": tokens / t, "ratio": t / base}
        print(f"{name:<26} {t * 1e3:>9.3f} {tokens / t / 1e6:>8.1f} {t / base:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
