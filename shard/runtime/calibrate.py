"""`[mpiexec -n N] soapstone bench calibrate -o PROFILE.json`: this machine as a hardware
profile (shard/plan/analysis/hardware.py's format), for `soapstone plan --profile PROFILE.json` and
`explain --profile`.

Every rank measures at once, as ranks of a run compute at once (the slowest rank's figure is
kept): matmul throughput per compute dtype (the best of a few square sizes, one thread per
rank as `run` sets it), memory bandwidth (a large copy: bytes read + written per second), and
the alpha-beta model of the world communicator's allreduce (least squares of time = 2(n-1)
hops x alpha + bus bytes / beta over sizes from 8 B to 16 MiB; MPI here, NCCL where the
communicator is). One host has one link class: both intra_node and inter_node get the
measured link (edit inter_node for a cluster). matmul_efficiency is 1: the peaks are what
matmuls achieve here. Memory per device: the host's memory over the ranks on it. The ops'
fixed cost: a model too small to compute (PROBE_SPEC) trained on each rank alone, its
forward-backward time over its op count. ring_overlap (`overlap tensor`'s rings): one
all-gather ring of fp32 chunks with a matmul per chunk (comm/collective_matmul.py), the
chunk's rows chosen from the measured link so that a send takes RING_SEND_S and the matmul's
output width so that it takes as long (else the shorter is lost in the longer's noise, or
both in a barrier's), timed against its matmuls alone and its sends alone, each less a bare
barrier's time (every kind starts with one): the share of the shorter the ring hid
(`hidden_share`).
"""

from __future__ import annotations

import socket
import statistics
import time

import torch

from soapstone.comm.accounting import bus_bytes
from soapstone.comm.dtype_table import PRECISIONS, RUN_PRECISIONS
from soapstone.shard.plan.analysis.fit import host_memory_per_rank
from soapstone.shard.plan.analysis.hardware import Link, Profile

# A model too small to compute anything: its step time is its ops' fixed cost (the command
# compiles it: shard does not read specs).
PROBE_SPEC = """
model probe {
  dim batch = 2, seq = 4, hidden = 8, heads = 2, ffn = 16, vocab = 16
  input tokens  : i64[batch, seq]
  input targets : i64[batch, seq]
  x = embedding(tokens, vocab -> hidden)
  repeat 2 as layer {
    x = x + attention(layernorm(x), heads = heads, causal = true)
    x = x + mlp(layernorm(x), ffn, activation = gelu)
  }
  logits = linear(layernorm(x), hidden -> vocab)
  output loss = cross_entropy(logits, targets)
}
"""
MATMUL_SIZES = (256, 512, 1024)
RING_WIDTH = 1024  # a ring chunk's width (fp32)
RING_SEND_S = 0.005  # how long a chunk's send is made to take
RING_ITERS = 25
LINK_SIZES = (8, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
# the compute dtypes a run's --precision offers, each measured
DTYPES = {p: getattr(torch, PRECISIONS[p].torch_name) for p in RUN_PRECISIONS}


def _time(fn, seconds: float = 0.3, least: int = 3, group_s: float = 0.02) -> float:
    """Seconds per call of fn (after a warm-up): calls are timed in groups of about `group_s`
    each, the median group's wall time over its calls. A single short call fits in one
    scheduler slice and reads a whole core even where ranks share cores; a group spans many
    slices and measures what a rank gets while the others run too."""
    fn()
    t0 = time.perf_counter()
    fn()
    per_group = max(1, int(group_s / max(time.perf_counter() - t0, 1e-9)))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(per_group):
            fn()
        times.append((time.perf_counter() - t0) / per_group)
        if len(times) >= 200:
            break
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype) -> float:
    """Best FLOP/s of an n x n matmul over MATMUL_SIZES."""
    best = 0.0
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        best = max(best, 2 * n**3 / _time(lambda a=a, b=b: torch.matmul(a, b)))
    return best


def memory_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes per second of a large copy (read + write)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src))


def op_overhead(graph) -> float:
    """Seconds per op (forward and backward) of the one-rank StageGraph `graph` of a model
    too small to compute: its forward-backward time over its op count (cost.program_work)."""
    from soapstone.shard.data.source import make_task
    from soapstone.shard.plan.analysis.cost import program_work
    from soapstone.shard.runtime.executor import Executor

    ex = Executor(graph, None, seed=0)
    batch = make_task(graph.program, 0).batch(0)
    return _time(lambda: ex.forward_backward(batch), seconds=1.0) / \
        program_work(graph.program).ops


def link(world) -> Link:
    """The alpha-beta fit of `world`'s allreduce (every rank calls it)."""
    n = world.size
    hops = 2 * (n - 1)
    rows = []
    for size in LINK_SIZES:
        x = torch.ones(max(1, size // 4))
        iters = 50 if size <= 1 << 18 else 10  # the same count on every rank: collectives
        world.allreduce(x)
        times = []
        for _ in range(iters):
            world.barrier()
            t0 = time.perf_counter()
            world.allreduce(x)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        t = world.allreduce(torch.tensor([t], dtype=torch.float64), op="max").item()
        rows.append((hops, bus_bytes("allreduce", x.numel() * 4, n), t))
    # least squares of t = hops * alpha + bus * (1 / beta), both >= 0
    sxx = sum(h * h for h, _, _ in rows)
    sxy = sum(h * b for h, b, _ in rows)
    syy = sum(b * b for _, b, _ in rows)
    sxt = sum(h * t for h, _, t in rows)
    syt = sum(b * t for _, b, t in rows)
    det = sxx * syy - sxy * sxy
    alpha = max((sxt * syy - syt * sxy) / det, 0.0)
    inv_beta = max((sxx * syt - sxy * sxt) / det, 1e-12)
    return Link(1 / inv_beta, alpha)


def ring_shape(flops: float, bandwidth: float) -> tuple[int, int]:
    """(rows, matmul output width) of a ring chunk RING_WIDTH wide whose send (4 x rows x
    width bytes) takes RING_SEND_S at `bandwidth` (rows in [64, 16384]) and whose matmul
    (2 x rows x width x out FLOPs) as long at `flops`: out = 2 x flops / bandwidth, in
    [16, 16384]."""
    rows = round(RING_SEND_S * bandwidth / (4 * RING_WIDTH))
    return (int(min(16384, max(64, rows))), int(min(16384, max(16, round(2 * flops / bandwidth)))))


def hidden_share(matmuls: float, sends: float, ring: float) -> float:
    """The share of the shorter of `matmuls` and `sends` (seconds, each alone) that the ring
    running both (`ring`) hid: (matmuls + sends - ring) / min(matmuls, sends), held to
    [0, 1] (a shared machine's noise can put a sample outside)."""
    shorter = min(matmuls, sends)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (matmuls + sends - ring) / shorter))


def ring_overlap(world, rows: int, out: int) -> float:
    """The share of the shorter of a ring's sends and its matmuls that the ring hides here,
    for chunks of `rows` whose matmul is `out` wide (module doc; every rank calls it; each
    kind timed as the slowest rank took it)."""
    from soapstone.comm.collective_matmul import ring_all_gather

    x, w = torch.randn(rows, RING_WIDTH), torch.randn(RING_WIDTH, out)
    n = world.size

    def ring(apply: bool, send: bool):
        def use(c, chunk):
            if apply:
                torch.matmul(chunk, w)

        def run():
            world.barrier()
            if send:
                ring_all_gather(world, x, use)
            else:
                for c in range(n):
                    use(c, x)
        return run

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # a fixed count (every rank makes the same calls), the four kinds (a bare barrier, the
    # matmuls, the sends, the ring) interleaved so that a busy moment of a shared machine
    # falls on all of them alike
    kinds = [ring(a, s) for a, s in ((False, False), (True, False), (False, True), (True, True))]
    for fn in kinds:
        fn()  # warm-up
    samples = [[timed(fn) for fn in kinds] for _ in range(RING_ITERS)]
    mine = torch.tensor([statistics.median(col) for col in zip(*samples, strict=True)],
                        dtype=torch.float64)
    bare, mm, sends, both = world.allreduce(mine, op="max").tolist()
    return hidden_share(mm - bare, sends - bare, both - bare)


def calibrate(world, probe=None) -> Profile:
    """This machine's profile, measured by every rank of `world` (collective); `probe`: the
    one-rank StageGraph of PROBE_SPEC, for the ops' fixed cost (0 without)."""
    torch.set_num_threads(1)
    world.barrier()
    overhead = torch.tensor([op_overhead(probe) if probe is not None else 0.0],
                            dtype=torch.float64)
    if world.size > 1:
        overhead = world.allreduce(overhead, op="max")
    peaks = {}
    for name, dtype in DTYPES.items():
        world.barrier()  # every rank measures at once, sharing the cores as training does
        mine = torch.tensor([matmul_flops(dtype)], dtype=torch.float64)
        peaks[name] = world.allreduce(mine, op="min").item() if world.size > 1 else mine.item()
    world.barrier()
    bw = torch.tensor([memory_bandwidth()], dtype=torch.float64)
    bw = world.allreduce(bw, op="min").item() if world.size > 1 else bw.item()
    measured = link(world) if world.size > 1 else Link(1e12, 0.0)
    rows, out = ring_shape(peaks["fp32"], measured.bandwidth)
    overlap = ring_overlap(world, rows, out) if world.size > 1 else 1.0
    memory, _ = host_memory_per_rank(world.size)
    host = socket.gethostname()
    return Profile(
        name=f"calibrated-{host}",
        description=f"{host} measured by `soapstone bench calibrate` on {world.size} ranks "
                    f"({time.strftime('%Y-%m-%d')}): one rank per device, one thread each",
        memory_bytes=memory, usable_fraction=0.9, devices_per_node=world.size,
        peak_flops=peaks, matmul_efficiency=1.0, memory_bandwidth=bw,
        intra_node=measured, inter_node=measured, op_overhead_s=overhead.item(),
        ring_overlap=round(overlap, 2), ring_overlap_source=(
            f"measured: `soapstone bench calibrate`, one ring of {rows} x {RING_WIDTH} fp32 "
            f"chunks, a matmul to {out} wide each"
            if world.size > 1 else ""))
