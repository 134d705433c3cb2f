"""Data parallel and ZeRO-3 vs PyTorch DDP and FSDP2 (gloo), side by side in one job.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_dp.py [--steps 30]
            [--device cpu|cuda] [--clock wall|cpu]

The gpt example scaled to ~21M parameters (hidden 512, ffn 2048, vocab 8192, 4 layers,
seq 64, global batch 4), AdamW, the same batches everywhere. Rows (rank 0 prints, medians
of --steps, at least 30, after 2 warm-up steps, the rows interleaved step by step through
comm/bench/harness.py, with the interquartile range and the load average):
  soapstone zero 0 (buckets overlapped with backward)     vs torch DDP (gloo, 25 MiB buckets)
  soapstone zero 0 with reduction only after backward     (the overlap's worth)
  soapstone zero 0 with MPI's allreduce                   (the shared-memory sum's worth:
                                                           SOAPSTONE_SHM_ALLREDUCE=0)
  soapstone zero 3                                        vs torch FSDP2 fully_shard (gloo)
  soapstone zero 3 with every reduce-scatter waited at the step (one in flight, each full
                                                           gradient buffer freed as backward
                                                           goes: what that costs)
torch's rows are run twice: as people run them (torch.optim.AdamW's default for-loop kernel,
DDP's defaults) and at their best: AdamW(fused=True), the kernel soapstone's flat AdamW calls,
and for DDP gradient_as_bucket_view=True (gradients live in the buckets: no copy in or out)
and static_graph=True. DDP rows clear gradients with zero_grad(set_to_none=True) (no memset).
Neither side clips, so neither computes a global gradient norm (soapstone: track_norm=False).
--clock cpu: each step's figure is the CPU time its process spent (time.process_time: every
thread, gloo's included; MPI's busy waits count too), the slowest rank's: on a machine loaded by
other jobs it moves far less than the wall clock.
Memory: bytes of parameters + gradients + optimizer state each rank holds after a step,
counted from the tensors (each storage once), for both frameworks; plus ru_maxrss.
--device cuda: both on NCCL, each rank on the GPU of its node-local rank (`start`, which
bench_tp and bench_pipe share), steps timed between torch.cuda.synchronize() calls. Not yet run
on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]

from soapstone import dsl  # noqa: E402
from soapstone.comm import Communicator, Mesh, init  # noqa: E402
from soapstone.comm.bench.collectives import init_gloo  # noqa: E402
from soapstone.comm.bench.harness import MIN_STEPS, interleave  # noqa: E402
from soapstone.dsl.compile.lower import lower  # noqa: E402
from soapstone.shard.runtime.memory import memory_report  # noqa: E402
from soapstone.shard.runtime.sharded_model import ShardedModel  # noqa: E402
from soapstone.shard.train.optim import build_optimizer  # noqa: E402
from soapstone.shard.train.reference_gpt import GPT  # noqa: E402

DDP_BEST = "torch DDP best: fused AdamW, bucket views"  # the row the DP goal is against
DIMS = dict(hidden=512, heads=8, ffn=2048, vocab=8192, seq=64, batch=4)
LAYERS = 4


class BenchDevice(NamedTuple):
    """Where a bench runs: soapstone's world communicator, torch.distributed, this rank's
    torch device."""

    world: Communicator
    dist: object
    device: torch.device

    def sync(self) -> None:
        """Wait for the GPU's queued work (nothing to wait for on the CPU): GPU calls return
        once enqueued, so a clock read without it times the launches, not the work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def label(self) -> str:
        """The device for headers and JSON: `cpu`, or e.g. `cuda:0 (NVIDIA H100 80GB HBM3)`."""
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return "cpu"


def start(device: str) -> BenchDevice:
    """soapstone and torch.distributed for --device: MPI and gloo on the CPU; NCCL for both on
    cuda (collective). A cuda this machine cannot run ends every rank with exit 2 and one line
    naming the fix, before any NCCL call (the check `soapstone run --device cuda` makes)."""
    mpi = MPI.COMM_WORLD
    if device == "cpu":
        world = init("mpi")
        return BenchDevice(world, init_gloo(mpi), torch.device("cpu"))
    from soapstone.comm.bench.nccl import init_torch_nccl
    from soapstone.comm.launch.device import DeviceError, pick
    from soapstone.dsl.commands import fail

    try:
        dev = pick("cuda")  # every rank reaches the same verdict, so none waits for another
    except DeviceError as e:
        raise SystemExit(fail(e, mpi.Get_rank())) from None
    world = init("nccl")
    return BenchDevice(world, init_torch_nccl(mpi, dev), dev)


def batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, DIMS["vocab"], (DIMS["batch"], DIMS["seq"]), generator=g),
             torch.randint(0, DIMS["vocab"], (DIMS["batch"], DIMS["seq"]), generator=g))
            for _ in range(n)]


def tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def torch_bytes(model, opt) -> int:
    ps = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
             and v.dim() > 0]
    return tensor_bytes(ps) + tensor_bytes(p.grad for p in ps) + tensor_bytes(state)


def soapstone_model(zero, overlap=True, world=None, device=None):
    """(train step on a batch, model, optimizer) of soapstone's data-parallel gpt on the mesh
    data=2 over `world` (default: init's world communicator), on `device` (default cpu)."""
    spec = dsl.load(ROOT / "examples/gpt.par", dims=DIMS, check=False)
    par = spec.parallel("dp2")
    w = init("mpi") if world is None else world
    m = ShardedModel(lower(spec.model(), par), Mesh(w, data=2), seed=0, device=device)
    # no clipping and nothing logs the norm: soapstone skips it, as DDP computes none
    opt = build_optimizer(m, "adamw", lr=1e-4, zero=zero, overlap=overlap, track_norm=False)

    def step(b):
        out = m({"tokens": b[0], "targets": b[1]})
        out["loss"].backward()
        opt.step()
        opt.zero_grad()

    return step, m, opt


def soapstone_row(zero, bench, overlap=True, shared=True, wait_at_step=False):
    """(train step, bytes held after a step) of soapstone's data parallel at `zero`; shared:
    stage 0's buckets in node-shared memory where the ranks share a node (comm/backends/shm.py),
    else reduced by MPI's allreduce; wait_at_step: ZeRO-2/3's reduce-scatters all waited at the
    step, none during backward."""
    old = os.environ.get("SOAPSTONE_SHM_ALLREDUCE")
    os.environ["SOAPSTONE_SHM_ALLREDUCE"] = "1" if shared else "0"  # read as buckets are made
    step, m, opt = soapstone_model(zero, overlap, bench.world, bench.device)
    if wait_at_step:
        opt.reducer.reductions_in_flight = None
    if old is None:
        os.environ.pop("SOAPSTONE_SHM_ALLREDUCE")
    else:
        os.environ["SOAPSTONE_SHM_ALLREDUCE"] = old
    return step, lambda: memory_report(m, opt)["total"]


def torch_model(device="cpu"):
    torch.manual_seed(0)  # drawn on the CPU, so every device starts from the same weights
    return GPT(DIMS["vocab"], DIMS["hidden"], DIMS["heads"], DIMS["ffn"], LAYERS).to(device)


def local(b):
    r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    return b[0].chunk(n)[r], b[1].chunk(n)[r]


def ddp_row(bench, fused=False):
    """(train step, bytes held) of torch DDP (25 MiB buckets); fused: its best settings too
    (gradients as bucket views, static graph)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = bench.device
    ids = [dev.index] if dev.type == "cuda" else None
    best = dict(gradient_as_bucket_view=True, static_graph=True) if fused else {}
    return torch_row(DDP(torch_model(dev), device_ids=ids, bucket_cap_mb=25, **best), fused,
                     set_to_none=True)


def fsdp_row(bench, fused=False):
    """(train step, bytes held) of torch FSDP2, every block and the model fully_shard-ed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(bench.device.type, (MPI.COMM_WORLD.size,))
    model = torch_model(bench.device)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch_row(model, fused)


def torch_row(model, fused, set_to_none=False):
    """(train step, bytes held) of a torch-parallelised model under AdamW. set_to_none: drop
    the gradients after each step (DDP: faster; FSDP2 keeps them, as the equal-memory
    comparison with ZeRO-3's persistent gradient shards was measured)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=fused)
    last = []

    def step(b):
        model(*local(b)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        last[:] = [b]

    def held() -> int:
        # one more backward (collective: every rank, every row in order), so that gradients
        # dropped by set_to_none are there to count, as soapstone's buffers are
        model(*local(last[0])).backward()
        n = torch_bytes(model, opt)
        opt.zero_grad(set_to_none=set_to_none)
        return n

    return step, held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=MIN_STEPS,
                    help=f"timed steps per row after 2 warm-up (default and least {MIN_STEPS})")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (MPI vs gloo) or cuda (a GPU per rank, NCCL on both sides)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time steps by the wall clock or by the process's CPU time")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bench = start(args.device)
    # on the device before timing, as a training loop's prefetch would have them
    data = [(a.to(bench.device), b.to(bench.device)) for a, b in batches(args.steps + 2)]
    rows = {  # name -> (step on a batch, bytes held); every model lives through the run
        "soapstone zero 0": soapstone_row(0, bench),
        "torch DDP": ddp_row(bench),
        # soapstone's flat AdamW runs torch's fused kernel; torch can too, so show both
        DDP_BEST: ddp_row(bench, fused=True),
        "soapstone zero 0, reduce after backward": soapstone_row(0, bench, overlap=False),
        "soapstone zero 0, MPI allreduce": soapstone_row(0, bench, shared=False),
        "soapstone zero 3": soapstone_row(3, bench),
        "soapstone zero 3, waits at the step": soapstone_row(3, bench, wait_at_step=True),
        "torch FSDP2": fsdp_row(bench),
        "torch FSDP2, AdamW(fused=True)": fsdp_row(bench, fused=True),
    }
    counters = dict.fromkeys(rows, 0)

    def stepper(name):
        def run():
            rows[name][0](data[counters[name]])  # every row sees batch i at its step i
            counters[name] += 1
        return run

    session = interleave({k: stepper(k) for k in rows}, args.steps, warmup=2,
                         comm=MPI.COMM_WORLD, sync=bench.sync,
                         clock=time.process_time if args.clock == "cpu" else time.perf_counter)
    held = {k: held_bytes() for k, (_, held_bytes) in rows.items()}
    rss = MPI.COMM_WORLD.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, MPI.MAX)
    if MPI.COMM_WORLD.rank == 0:
        n = sum(p.numel() for p in torch_model().parameters())
        on = f" on {bench.label} (NCCL)" if bench.device.type == "cuda" else ""
        print(f"gpt {n / 1e6:.1f}M params, {MPI.COMM_WORLD.size} ranks{on}, AdamW, "
              f"{args.steps} steps each, interleaved, {args.clock} clock; {session.load_text()}")
        print(f"{'config':42s} {'step (median, IQR)':>32s} {'MiB/rank (p+g+opt)':>20s}")
        for k, t in session.timings.items():
            print(f"{k:42s} {t.text():>32s} {held[k] / 2**20:20.1f}")
        ratios = [session.compare("soapstone zero 0", "torch DDP"),
                  session.compare("soapstone zero 0", DDP_BEST),
                  session.compare("soapstone zero 3", "torch FSDP2"),
                  session.compare("soapstone zero 3", "torch FSDP2, AdamW(fused=True)"),
                  session.compare("soapstone zero 0", "soapstone zero 0, reduce after backward"),
                  session.compare("soapstone zero 0", "soapstone zero 0, MPI allreduce"),
                  session.compare("soapstone zero 3", "soapstone zero 3, waits at the step")]
        for r in ratios:
            print(f"throughput {r.text()}")
        print(f"max RSS {rss / 1024:.0f} MiB")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "device": bench.label, "clock": args.clock,
                "rows": {k: session.timings[k].to_json() | {
                    "bytes": held[k]} for k in rows},
                "ratios": [r.to_json() for r in ratios]} | session.to_json(), indent=1))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
