"""`soapstone bench comm`: soapstone's collectives vs raw mpi4py (the floor) vs torch gloo.

Run under `mpiexec -n N`. For each op and size it times the three side by side in one job on
the same buffers (warmup, then the median over iterations of the slowest rank's time) and
prints nccl-tests style rows: size, time_us, algbw and busbw per implementation, plus the
ratios soapstone/mpi4py and gloo/soapstone. Like mpi4py's and gloo's loops, soapstone's
allgather / reduce_scatter / alltoall write into one preallocated buffer (`out=`); `--alloc`
times them allocating a new output per call instead. Sizes follow nccl-tests: the full buffer
(allreduce, broadcast, alltoall, reduce_scatter's input, allgather's output), fp32 elements.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
DEFAULT_SIZES = "8,64,512,4KiB,32KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '64KiB' -> 65536, '4MiB' -> 4194304 (K/M/G are binary)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 8, 64KiB, 4MiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _op_list(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    return ops


def _json_path(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} of {text!r} does not exist; "
                                         "create it or pick another path")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench arguments to `parser`."""
    parser.add_argument("name", choices=["comm"], help="which benchmark (comm: collectives)")
    parser.add_argument("--sizes", type=_size_list, default=_size_list(DEFAULT_SIZES),
                        help=f"comma-separated byte sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--ops", type=_op_list, default=list(OPS),
                        help=f"comma-separated ops (default {','.join(OPS)})")
    parser.add_argument("--iters", type=int, default=100,
                        help="timed iterations per op/size/impl (capped for big sizes)")
    parser.add_argument("--json", metavar="FILE", type=_json_path,
                        help="also write the rows as a JSON array")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    parser.add_argument("--alloc", action="store_true",
                        help="time soapstone's allgather/reduce_scatter/alltoall without out= "
                             "(a new output per call) instead of into a preallocated buffer")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_gloo(mpi):
    import warnings

    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor; the old names still work
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    port = mpi.bcast(_free_port() if mpi.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=mpi.Get_rank(), world_size=mpi.Get_size())
    return dist


def _impls(op, nbytes, world, mpi, dist, alloc=False):
    """{impl: zero-arg callable} for one op and size, all on the same buffers."""
    import torch
    from mpi4py import MPI

    n = world.size
    count = max(nbytes // 4, n)
    count -= count % n  # per-rank chunks must be equal
    x = torch.zeros(count)
    a = x.numpy()
    chunk = torch.zeros(count // n)
    c = chunk.numpy()
    out = torch.empty(count)
    o = out.numpy()
    full_out = {} if alloc else {"out": out}  # soapstone's out=, like mpi4py's reused buffer
    chunk_out = {} if alloc else {"out": chunk}
    if op == "allreduce":
        impls = {"soapstone": lambda: world.allreduce(x),
                 "mpi4py": lambda: mpi.Allreduce(MPI.IN_PLACE, a),
                 "gloo": lambda: dist.all_reduce(x)}
    elif op == "allgather":
        impls = {"soapstone": lambda: world.allgather(chunk, 0, **full_out),
                 "mpi4py": lambda: mpi.Allgather(c, o),
                 "gloo": lambda: dist.all_gather_into_tensor(out, chunk)}
    elif op == "reduce_scatter":
        impls = {"soapstone": lambda: world.reduce_scatter(x, 0, **chunk_out),
                 "mpi4py": lambda: mpi.Reduce_scatter_block(a, c),
                 "gloo": lambda: dist.reduce_scatter_tensor(chunk, x)}
    elif op == "broadcast":
        impls = {"soapstone": lambda: world.broadcast(x, 0),
                 "mpi4py": lambda: mpi.Bcast(a, 0),
                 "gloo": lambda: dist.broadcast(x, 0)}
    else:
        impls = {"soapstone": lambda: world.alltoall(x, 0, 0, **full_out),
                 "mpi4py": lambda: mpi.Alltoall(a, o),
                 "gloo": lambda: dist.all_to_all_single(out, x)}
    if dist is None:
        del impls["gloo"]
    return impls, count * 4


def _time(fn, iters: int, warmup: int, mpi) -> float | None:
    """Median seconds per call, the slowest rank's; None if the impl cannot do the op."""
    from mpi4py import MPI

    try:
        for _ in range(warmup):
            fn()
        ok = 1
    except RuntimeError:  # e.g. gloo without this collective: every rank fails alike
        ok = 0
    if not mpi.allreduce(ok, op=MPI.MIN):
        return None
    mpi.Barrier()
    times = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return mpi.allreduce(statistics.median(times), op=MPI.MAX)


def _fmt_row(op, nbytes, cells, ratios):
    text = f"{op:>14} {nbytes:>11}"
    for cell in cells:
        text += " |" + ("      n/a " * 3 if cell is None else
                        f"{cell['time_us']:>10.1f}{cell['algbw_GBps']:>9.3f}"
                        f"{cell['busbw_GBps']:>9.3f}")
    return text + " | " + "  ".join(f"{r:>8}" for r in ratios)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; rank 0 prints the table. Returns 0."""
    from mpi4py import MPI

    from .accounting import bus_bytes
    from .world import init

    world = init("mpi")
    mpi = MPI.COMM_WORLD
    n = world.size
    dist = None if args.no_gloo else _init_gloo(mpi)
    names = ["soapstone", "mpi4py"] + ([] if dist is None else ["gloo"])
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"# soapstone bench comm: {n} ranks, fp32, median of up to {args.iters} iterations "
        "(slowest rank); time_us, algbw/busbw in GB/s; soapstone "
        + ("allocates each output" if args.alloc else "writes into a preallocated out="))
    head = f"{'op':>14} {'bytes':>11}" + "".join(
        f" | {name + ' us':>10}{'algbw':>9}{'busbw':>9}" for name in names)
    say(head + " | soap/mpi  gloo/soap")
    rows = []
    for op in args.ops:
        for size in args.sizes:
            impls, nbytes = _impls(op, size, world, mpi, dist, args.alloc)
            iters = max(5, min(args.iters, (1 << 30) // max(nbytes, 1)))
            cells = []
            for name in names:
                sec = _time(impls[name], iters, max(2, iters // 10), mpi)
                if sec is None:
                    cells.append(None)
                    continue
                algbw = nbytes / sec / 1e9
                row = {"op": op, "bytes": nbytes, "impl": name, "time_us": sec * 1e6,
                       "algbw_GBps": algbw, "busbw_GBps": bus_bytes(op, nbytes, n) / sec / 1e9}
                rows.append(row)
                cells.append(row)
            soap, raw = cells[0], cells[1]
            gloo = cells[2] if len(cells) > 2 else None
            ratios = [f"{soap['time_us'] / raw['time_us']:.3f}"]
            ratios.append("n/a" if gloo is None else f"{gloo['time_us'] / soap['time_us']:.2f}")
            say(_fmt_row(op, nbytes, cells, ratios), flush=True)
    if args.json and world.rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if dist is not None:
        dist.destroy_process_group()
    return 0
