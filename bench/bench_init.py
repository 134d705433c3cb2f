"""Sharded initialisation: one tensor-parallel rank's parameters, drawn directly (soapstone
now: shard/runtime/init/param_init.py) beside drawn whole and sliced (soapstone before: each full
parameter from torch's generator, then this rank's slice copied out).

The model is bench/init_1b.par (1.11e9 parameters); a rank's share under `tp8` is 1.41e8
(heads, ffn and vocab split; norms, biases after a row-parallel product and the position table
replicated). Each measurement runs in a fresh process, old and new alternating: the time to
build every local parameter of rank 0 (process CPU time and wall), and the peak resident
memory above what the process held before (its parameters included). Every rank of a tp
layout draws the same amount, so rank 0 stands for all. `--layouts tp8 tp2` also draws tp2's
share (4x tp8's) with the new code, to show the time follows the shard.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_init.py [--repeat 2] [--layouts tp8]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "bench/init_1b.par")


def _box(p, coord: int) -> tuple[slice, ...]:
    """Rank `coord`'s slice of parameter `p` along its split dims (one mesh axis)."""
    out = []
    for dim, local in zip(p.dims, p.local_shape, strict=True):
        at = coord * local if p.layout.split_axis(dim) is not None else 0
        out.append(slice(at, at + local))
    return tuple(out)


def _old(p, seed: int, box):
    """The code this replaces: the whole parameter from torch's generator, then the slice."""
    import torch

    from soapstone.shard.runtime.init.param_init import TORCH_DTYPES

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{p.name}".encode()))
    dtype = TORCH_DTYPES[p.dtype]
    if p.init in ("zeros", "ones"):
        full = (torch.zeros if p.init == "zeros" else torch.ones)(p.shape, dtype=dtype)
    else:
        kind, _, arg = p.init.partition("(")
        scale = float(arg.rstrip(")"))
        full = (torch.randn(p.shape, generator=g) * scale if kind == "normal" else
                (torch.rand(p.shape, generator=g) * 2 - 1) * scale).to(dtype)
    return full[box].contiguous()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(kind: str, layout: str) -> dict:
    """Build rank 0's parameters of `layout` in this process; time and memory as a dict."""
    import torch

    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.runtime.init.param_init import init_shard

    torch.set_num_threads(1)
    spec = dsl.load(SPEC)
    program = lower(spec.model(), spec.parallel(layout))
    base = _rss_kb()
    draw = _old if kind == "old" else init_shard
    c0, w0 = time.process_time(), time.perf_counter()
    params = [draw(p, 0, _box(p, 0)) for p in program.params]
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's high mark
    local = sum(t.numel() for t in params)
    return {"kind": kind, "layout": layout, "cpu_s": cpu, "wall_s": wall, "local": local,
            "total": sum(math.prod(p.shape) for p in program.params),
            "peak_above_base_mb": (peak - base) / 1024, "params_mb": local * 4 / 2 ** 20}


def main() -> int:
    """Alternate old and new in fresh processes; print each run and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=["tp8"])
    ap.add_argument("--json", help="write the runs here")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "LAYOUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    runs = []
    jobs = [("old", "tp8"), ("new", "tp8")] + [("new", lay) for lay in args.layouts
                                               if lay != "tp8"]
    for _ in range(args.repeat):
        for kind, layout in jobs:
            out = subprocess.run([sys.executable, __file__, "--child", kind, layout],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out)
            runs.append(r)
            print(f"{kind} {layout}: local {r['local'] / 1e6:.0f}M of {r['total'] / 1e6:.0f}M "
                  f"params, cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, peak "
                  f"{r['peak_above_base_mb']:.0f} MB above base ({r['params_mb']:.0f} MB of "
                  "parameters)", flush=True)

    def best(kind, layout, key):
        return min(r[key] for r in runs if r["kind"] == kind and r["layout"] == layout)

    for key in ("cpu_s", "wall_s", "peak_above_base_mb"):
        print(f"new/old tp8 {key}: {best('new', 'tp8', key) / best('old', 'tp8', key):.2f}")
    for lay in args.layouts:
        if lay != "tp8":
            cpu = best("new", lay, "cpu_s") / best("new", "tp8", "cpu_s")
            shard = best("new", lay, "local") / best("new", "tp8", "local")
            print(f"new {lay}/tp8 cpu_s: {cpu:.2f} (shard ratio {shard:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
