"""`soapstone bench comm --backend nccl`: soapstone's NCCL communicator beside PyTorch's own
NCCL process group, in one job on the same CUDA buffers (the command: dsl/commands/bench.py).

GPU collectives return once enqueued, so a call is timed as nccl-tests times it: `iters`
calls back to back, then a stream synchronise, the elapsed time over `iters`; the slowest
rank's. Rows are those of comm/bench/collectives.py (op, bytes, impl, time_us, algbw_GBps,
busbw_GBps). Built without a GPU at hand: not yet run on one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

IMPLS = ("soapstone", "torch-nccl")


def init_torch_nccl(mpi, device):
    """torch.distributed on NCCL over the ranks of mpi4py communicator `mpi` (rank 0 picks a
    free local TCP port for the rendezvous and broadcasts it); the module. Collective."""
    import torch.distributed as dist

    from soapstone.comm.bench.collectives import free_port

    port = mpi.bcast(free_port() if mpi.Get_rank() == 0 else None, root=0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=mpi.Get_rank(), world_size=mpi.Get_size(), device_id=device)
    return dist


def implementations(op: str, nbytes: int, world, dist, device) -> tuple[dict, int]:
    """({impl: zero-arg callable}, bytes timed) for one op and size on CUDA buffers."""
    import torch

    from soapstone.comm.bench.collectives import soapstone_call

    n = world.size
    count = max(nbytes // 4, n)
    count -= count % n
    x = torch.zeros(count, device=device)
    chunk = torch.zeros(count // n, device=device)
    out = torch.empty(count, device=device)
    impls = {"soapstone": soapstone_call(op, world, x, chunk, {"out": out}, {"out": chunk})}
    if dist is not None:
        impls["torch-nccl"] = {
            "allreduce": lambda: dist.all_reduce(x),
            "allgather": lambda: dist.all_gather_into_tensor(out, chunk),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(chunk, x),
            "broadcast": lambda: dist.broadcast(x, 0),
            "alltoall": lambda: dist.all_to_all_single(out, x),
        }[op]
    return impls, count * 4


def time_enqueued(fn, iters: int, warmup: int, mpi) -> float:
    """Seconds per call of `fn` (GPU work): the slowest rank's mean over `iters` calls
    enqueued back to back and synchronised once."""
    import torch
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return mpi.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def measure(world, mpi, dist, device, ops, sizes,
            iters: int = 100) -> Iterator[tuple[str, int, list[dict | None]]]:
    """Time every op at every size: (op, bytes, cells), one cell per IMPLS entry (None for
    torch-nccl when `dist` is None). Collective over `world` and `mpi`."""
    from soapstone.comm.accounting import bus_bytes

    for op in ops:
        for size in sizes:
            impls, nbytes = implementations(op, size, world, dist, device)
            n_iters = max(5, min(iters, (1 << 32) // max(nbytes, 1)))
            cells: list[dict | None] = []
            for name in IMPLS:
                if name not in impls:
                    cells.append(None)
                    continue
                sec = time_enqueued(impls[name], n_iters, max(2, n_iters // 10), mpi)
                cells.append({"op": op, "bytes": nbytes, "impl": name, "time_us": sec * 1e6,
                              "algbw_GBps": nbytes / sec / 1e9,
                              "busbw_GBps": bus_bytes(op, nbytes, world.size) / sec / 1e9})
            yield op, nbytes, cells
