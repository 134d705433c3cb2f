"""The collectives benchmark behind `soapstone bench comm` (the command: dsl/commands/bench.py).

For each op and size it times soapstone, raw mpi4py (the floor) and torch gloo side by side in
one job on the same buffers (warmup, then the median over iterations of the slowest rank's
time) and reports nccl-tests style figures: time, algbw and busbw per implementation. Like
mpi4py's and gloo's loops, soapstone's allgather / reduce_scatter / alltoall write into one
preallocated buffer (`out=`); alloc=True times them allocating a new output per call instead.
Sizes follow nccl-tests: the full buffer (allreduce, broadcast, alltoall, reduce_scatter's
input, allgather's output), fp32 elements. Importing this module imports neither torch nor MPI.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

from soapstone.comm.op_table import BENCHED_OPS

OPS = BENCHED_OPS  # what this benchmark times, in its default order


def free_port() -> int:
    """A free local TCP port (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(mpi):
    """Start torch.distributed on gloo over the ranks of the mpi4py communicator `mpi` (rank 0
    picks a free local TCP port and broadcasts it); returns the torch.distributed module.
    Collective: every rank of `mpi` calls it. For benchmarks against PyTorch's own collectives."""
    import warnings

    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor; the old names still work
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    port = mpi.bcast(free_port() if mpi.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=mpi.Get_rank(), world_size=mpi.Get_size())
    return dist


def soapstone_call(op, comm, x, chunk, full_out, chunk_out):
    """soapstone's call of `op` on communicator `comm` (the buffers of `implementations`)."""
    if op == "allreduce":
        return lambda: comm.allreduce(x)
    if op == "allgather":
        return lambda: comm.allgather(chunk, 0, **full_out)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, 0, **chunk_out)
    if op == "broadcast":
        return lambda: comm.broadcast(x, 0)
    return lambda: comm.alltoall(x, 0, 0, **full_out)


def implementations(op, nbytes, world, mpi, dist, alloc=False, bare=None):
    """({impl: zero-arg callable}, bytes timed) for one op and size, on the same buffers.
    `bare`: a communicator over the same ranks whose ops are not recorded (the watchdog still
    watches it, from stack samples: no per-op work), timed as "no-recorder" beside soapstone."""
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
    impls = {"soapstone": soapstone_call(op, world, x, chunk, full_out, chunk_out)}
    if bare is not None:
        impls["no-recorder"] = soapstone_call(op, bare, x, chunk, full_out, chunk_out)
    if op == "allreduce":
        impls |= {"mpi4py": lambda: mpi.Allreduce(MPI.IN_PLACE, a),
                  "gloo": lambda: dist.all_reduce(x)}
    elif op == "allgather":
        impls |= {"mpi4py": lambda: mpi.Allgather(c, o),
                  "gloo": lambda: dist.all_gather_into_tensor(out, chunk)}
    elif op == "reduce_scatter":
        impls |= {"mpi4py": lambda: mpi.Reduce_scatter_block(a, c),
                  "gloo": lambda: dist.reduce_scatter_tensor(chunk, x)}
    elif op == "broadcast":
        impls |= {"mpi4py": lambda: mpi.Bcast(a, 0),
                  "gloo": lambda: dist.broadcast(x, 0)}
    else:
        impls |= {"mpi4py": lambda: mpi.Alltoall(a, o),
                  "gloo": lambda: dist.all_to_all_single(out, x)}
    if dist is None:
        del impls["gloo"]
    return impls, count * 4


def time_calls(fns: dict, iters: int, warmup: int, mpi, rounds: int = 1) -> dict:
    """{name: median seconds per call, the slowest rank's, or None if the impl cannot do the
    op}. rounds > 1 interleaves the impls (iters/rounds calls of each in turn, `rounds` times),
    so that a slow phase of a loaded machine hits all of them alike; the order rotates each
    round, and each turn starts with one untimed call, so that no impl is always the one
    that runs first after the barrier or after another impl's calls."""
    from mpi4py import MPI

    usable = []
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            ok = 1
        except RuntimeError:  # e.g. gloo without this collective: every rank fails alike
            ok = 0
        if mpi.allreduce(ok, op=MPI.MIN):
            usable.append(name)
    times: dict[str, list[float]] = {name: [] for name in usable}
    clock = time.perf_counter
    per_round = max(1, iters // rounds)
    for r in range(rounds):
        first = r % max(1, len(usable))
        for name in usable[first:] + usable[:first]:
            fn, out = fns[name], times[name]
            mpi.Barrier()
            if rounds > 1:
                fn()
            for _ in range(per_round):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return {name: (mpi.allreduce(statistics.median(times[name]), op=MPI.MAX)
                   if name in times else None) for name in fns}


def measure(world, mpi, dist, ops, sizes, iters: int = 100, alloc: bool = False,
            bare=None, rounds: int = 1) -> Iterator[tuple[str, int, list[dict | None]]]:
    """Time every op at every size: yields (op, bytes, cells), one cell per implementation
    (soapstone, then no-recorder if `bare` is given, mpi4py, then gloo unless `dist` is None):
    a row dict (op, bytes, impl, time_us, algbw_GBps, busbw_GBps), or None where the
    implementation lacks the op. `rounds`: see time_calls.
    Collective: every rank of `world` (and `mpi`, its mpi4py communicator) iterates it."""
    from soapstone.comm.accounting import bus_bytes

    n = world.size
    names = ["soapstone"] + ([] if bare is None else ["no-recorder"]) + ["mpi4py"]
    names += [] if dist is None else ["gloo"]
    for op in ops:
        for size in sizes:
            impls, nbytes = implementations(op, size, world, mpi, dist, alloc, bare)
            n_iters = max(5, min(iters, (1 << 30) // max(nbytes, 1)))
            secs = time_calls({k: impls[k] for k in names}, n_iters, max(2, n_iters // 10), mpi,
                              rounds)
            cells: list[dict | None] = []
            for name in names:
                sec = secs[name]
                if sec is None:
                    cells.append(None)
                    continue
                cells.append({"op": op, "bytes": nbytes, "impl": name, "time_us": sec * 1e6,
                              "algbw_GBps": nbytes / sec / 1e9,
                              "busbw_GBps": bus_bytes(op, nbytes, n) / sec / 1e9})
            yield op, nbytes, cells
