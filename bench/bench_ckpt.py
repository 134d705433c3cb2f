"""Checkpoint save and load throughput: soapstone vs torch.distributed.checkpoint (gloo), and
what checksums cost.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_ckpt.py [--rounds 3]
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_ckpt.py --checksums

The gpt example scaled to ~21M parameters (hidden 512, ffn 2048, vocab 8192, 4 layers, as
bench_dp.py), AdamW after one step, fp32: each checkpoint holds the fp32 master weights and
both moments (12 bytes per parameter, ~252 MB). Side by side, interleaved round by round, into
the same directory (--dir, default a temp dir under /tmp):
  soapstone dp2 (ZeRO-0: every tensor replicated; each rank writes its share of the
  replicated parameters)        vs  DCP's dcp.save of the same tensors (a state dict of plain
                                    tensors, which DCP deduplicates across ranks and spreads)
  load of each into the same layout (soapstone resume / dcp.load in place)
  soapstone dp2 ZeRO-1 save/load (optimizer state sharded), and a reshard load: a tp2
  checkpoint loaded into dp2 (no DCP row: its plain-tensor state dict has no layout).
Times are the slowest rank's, medians over rounds; MB/s per rank = checkpoint MB / ranks /
time. Both fsync what they write (DCP's FileSystemWriter sync_files=True, its default).
Loads read files just written, so from the page cache, for both.

--checksums: soapstone dp2 save and load with the CRC-32 of every 1 MiB chunk taken by zlib,
by python-isal (when installed: the same values, ISA-L's code) and not at all (the function
swapped for one returning 0 on both sides: what the rest of save and load cost), side by side,
interleaved round by round (default 7 rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from mpi4py import MPI

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.comm.bench.collectives import init_gloo
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.checkpoint import checksum, resume, save
from soapstone.shard.checkpoint.holdings import holdings
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DIMS = dict(hidden=512, heads=8, ffn=2048, vocab=8192, seq=64, batch=8)
LAYOUTS = """
parallel bdp2 for gpt on mesh(data = 2) {
  sample batch -> data
}
parallel bdp2z1 for gpt on mesh(data = 2) {
  sample batch -> data
  zero 1
}
"""


def timed(fn, *args, **kwargs) -> float:
    """Seconds of fn(*args, **kwargs) on the slowest rank."""
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--checksums", action="store_true",
                    help="only the checksum comparison: zlib, isal, none")
    args = ap.parse_args()
    if args.checksums and args.rounds == 3:
        args.rounds = 7
    world = init("mpi")
    dist = init_gloo(MPI.COMM_WORLD)
    import torch.distributed.checkpoint as dcp

    rank = world.rank
    base = Path(MPI.COMM_WORLD.bcast(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
                                     if rank == 0 else None))
    spec_file = base / "bench_ckpt.par"
    if rank == 0:
        spec_file.write_text(f'include "{ROOT / "examples/gpt.par"}"\n' + LAYOUTS)
    MPI.COMM_WORLD.Barrier()
    spec = dsl.load(spec_file, dims=DIMS)

    def trainer(layout: str) -> Trainer:
        par = spec.parallel(layout)
        graph = lower_graph(spec.model("gpt"), par)
        full = lower_graph(spec.model("gpt"), None).program
        t = Trainer(graph, Mesh(world, **dict(par.mesh)), task=SyntheticTask(full, seed=0),
                    lr=1e-3, check_memory=False)
        t.step(0)  # optimizer state exists
        return t

    rows: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    def add(name: str, seconds: float, d: Path) -> None:
        rows.setdefault(name, []).append(seconds)
        sizes[name] = MPI.COMM_WORLD.bcast(dir_bytes(d) if rank == 0 else None)

    t = trainer("bdp2")
    if args.checksums:
        checksum_rounds(t, base, args.rounds, add)
        report(rows, sizes, world.size, args.rounds, base, t)
        if rank == 0 and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()
        return
    state = {f"{k}/{h.name}": v.view(h.shape) for h in holdings(t.executor)
             for k, v in h.views.items()}  # every rank holds every tensor whole (ZeRO-0)
    for r in range(args.rounds):
        s, d = base / f"soap-{r}", base / f"dcp-{r}"
        add("save  soapstone dp2", timed(save, t.executor, s, 1, 0, {}), s)
        add("save  DCP dp2 (gloo)", timed(dcp.save, state, checkpoint_id=str(d)), d)
        add("load  soapstone dp2", timed(resume, t.executor, s), s)
        add("load  DCP dp2 (gloo)", timed(dcp.load, state, checkpoint_id=str(d)), d)
        if rank == 0:
            shutil.rmtree(s)
            shutil.rmtree(d)
        MPI.COMM_WORLD.Barrier()
    z = trainer("bdp2z1")
    tp = trainer("tp2")
    for r in range(args.rounds):
        s, p = base / f"z1-{r}", base / f"tp-{r}"
        add("save  soapstone dp2 ZeRO-1", timed(save, z.executor, s, 1, 0, {}), s)
        add("load  soapstone dp2 ZeRO-1", timed(resume, z.executor, s), s)
        save(tp.executor, p, 1, 0, {})
        add("load  soapstone tp2 -> dp2 ZeRO-1 (reshard)", timed(resume, z.executor, p), p)
        if rank == 0:
            shutil.rmtree(s)
            shutil.rmtree(p)
        MPI.COMM_WORLD.Barrier()
    speed = report(rows, sizes, world.size, args.rounds, base, z)
    if rank == 0:
        for op in ("save", "load"):
            a, b = speed[f"{op}  soapstone dp2"], speed[f"{op}  DCP dp2 (gloo)"]
            print(f"{op}: soapstone / DCP = {a / b:.2f}x")
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


def engines() -> dict:
    """The CRC-32 functions to compare: zlib's, python-isal's if installed, and none."""
    import zlib

    out = {"zlib": zlib.crc32}
    try:
        from isal.isal_zlib import crc32

        out["isal"] = crc32
    except ImportError:
        pass
    out["none"] = lambda data: 0  # noqa: ARG005 (both sides agree: nothing is checked)
    return out


def checksum_rounds(t: Trainer, base: Path, rounds: int, add) -> None:
    """Save and load under each CRC-32 engine in turn, round by round."""
    kept = checksum.crc32
    try:
        for r in range(rounds):
            for name, fn in engines().items():
                checksum.crc32 = fn
                d = base / f"crc-{name}-{r}"
                add(f"save  soapstone dp2, checksums {name}", timed(save, t.executor, d, 1, 0,
                                                                   {}), d)
                add(f"load  soapstone dp2, checksums {name}", timed(resume, t.executor, d), d)
                if MPI.COMM_WORLD.Get_rank() == 0:
                    shutil.rmtree(d)
                MPI.COMM_WORLD.Barrier()
    finally:
        checksum.crc32 = kept


def report(rows: dict, sizes: dict, n: int, rounds: int, base: Path, t: Trainer) -> dict:
    """Print each row's median (rank 0); MB/s per rank by row."""
    speed = {}
    for name, ts in rows.items():
        speed[name] = sizes[name] / 1e6 / n / statistics.median(ts)
    if MPI.COMM_WORLD.Get_rank() == 0:
        params = sum(p.numel() for p in t.executor.parameters()) * n // 2  # dp: whole per rank
        print(f"gpt {DIMS}, {params / 1e6:.1f}M params, {n} ranks, {rounds} rounds, dir {base}")
        print(f"{'':46} {'MB':>8} {'s':>8} {'MB/s/rank':>10}")
        for name, ts in rows.items():
            print(f"{name:46} {sizes[name] / 1e6:8.1f} {statistics.median(ts):8.3f} "
                  f"{speed[name]:10.1f}")
    return speed


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
