"""Asynchronous checkpoints: the stall training sees, soapstone (`run --async-save`) vs
torch.distributed.checkpoint.async_save (gloo), each against its own synchronous save.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/bench_async_save.py \
        [--rounds 7] [--steps 3]

The model of bench/bench_ckpt.py: the gpt example scaled to ~21M parameters, dp2, AdamW, fp32;
each checkpoint holds the fp32 masters and both moments (~252 MB, ~126 MB written per rank).
One episode = one save, then `--steps` training steps, then whatever is left of the save
(the run's next save point or its end). Per round every mode runs one episode, in an order that
rotates round by round; figures are medians over the rounds after a warm-up round (which
makes soapstone's staging buffer; DCP's default stager copies into new memory each time),
the slowest rank's each:
- stall: the time the training loop is blocked by the save: a synchronous save's call; an
  asynchronous one's start (staging copy, temp directory) plus, for soapstone, each step's
  poll, where the ranks agree on the write and on the publish (collectives on the main thread);
  for DCP, the async_save call;
- steps: the `--steps` training steps after the save (the background write shares the CPU);
- drain: waiting at the end of the episode for the save to be complete (soapstone: published;
  DCP: the future's result).
Modes:
  soapstone sync        save(): the whole write between two steps
  soapstone async       AsyncSaver: a thread writes (shard/checkpoint/async_save.py)
  soapstone async proc  the same staging, written by a child process from shared memory (a
                        prototype here, for the thread-or-process choice)
  DCP sync              dcp.save of the same tensors (each rank's own: the keys soapstone writes)
  DCP async thread      dcp.async_save, AsyncCheckpointerType.THREAD (its default)
  DCP async process     dcp.async_save, AsyncCheckpointerType.PROCESS
Both fsync (DCP's FileSystemWriter sync_files=True, its default). Each rank's DCP state dict
holds exactly the tensors the rank writes in soapstone's checkpoint (the same bytes per rank,
nothing for DCP to deduplicate).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.comm.bench.collectives import init_gloo
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.checkpoint.async_save import AsyncSaver, status
from soapstone.shard.checkpoint.save import plan_part, save
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DIMS = dict(hidden=512, heads=8, ffn=2048, vocab=8192, seq=64, batch=8)
LAYOUT = """
parallel bdp2 for gpt on mesh(data = 2) {
  sample batch -> data
}
"""
COMM = None  # MPI.COMM_WORLD, set by main(): a spawned writer (ours or DCP's) re-imports this
# module and must not start MPI in the job's environment


def slowest(seconds: float) -> float:
    """The slowest rank's figure."""
    from mpi4py import MPI

    return COMM.allreduce(seconds, op=MPI.MAX)


def clock(fn, *args, **kwargs):
    """(fn's value, its seconds on this rank)."""
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - t0


class Episode:
    """One save and the steps after it, timed (this rank's seconds; slowest() later)."""

    def __init__(self):
        self.stall = self.steps = self.drain = 0.0
        self.parts = [0.0, 0.0, 0.0]  # of the stall: the start, the polls, the fence waits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up)")
    ap.add_argument("--steps", type=int, default=3, help="training steps after each save")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    args = ap.parse_args()
    global COMM
    from mpi4py import MPI

    COMM = MPI.COMM_WORLD
    world = init("mpi")
    dist = init_gloo(COMM)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    rank = world.rank
    base = Path(COMM.bcast(args.dir or tempfile.mkdtemp(prefix="bench-async-")
                           if rank == 0 else None))
    spec_file = base / "bench_async.par"
    if rank == 0:
        spec_file.write_text(f'include "{ROOT / "examples/gpt.par"}"\n' + LAYOUT)
    COMM.Barrier()
    spec = dsl.load(spec_file, dims=DIMS)
    par = spec.parallel("bdp2")
    graph = lower_graph(spec.model("gpt"), par)
    full = lower_graph(spec.model("gpt"), None).program
    t = Trainer(graph, Mesh(world, **dict(par.mesh)), task=SyntheticTask(full, seed=0),
                lr=1e-3, check_memory=False)
    step = 0
    t.step(step)  # optimizer state exists
    step += 1
    # each rank's DCP state dict: the tensors it writes in soapstone's checkpoint (live views)
    state = dict(plan_part(t.executor, 0, rank, world.size).tensors)
    staged_bytes = slowest(sum(v.numel() * v.element_size() for v in state.values()))
    saver = AsyncSaver(t.executor, base / "soap-async", keep=1)
    proc = ProcessWriter(t.executor, base / "soap-proc")
    gloo = dist.new_group(backend="gloo")

    def train(ep: Episode, writer: AsyncSaver | None = None) -> None:
        nonlocal step
        for _ in range(args.steps):
            _, dt = clock(t.step, step)
            step += 1
            ep.steps += dt
            if writer is not None:  # what run's after_step does under --async-save: its
                # per-step allreduce (which a sync --save run makes too: untimed), then the
                # save's own agreement when every writer is done (timed: the save's)
                busy, failed = status(world, *writer.status())
                _, dt = clock(writer.poll, busy, failed)
                ep.stall += dt
                ep.parts[1] += dt

    def soap_sync(ep: Episode, r: int) -> None:
        _, ep.stall = clock(save, t.executor, base / "soap-sync", r, 0, {}, 1)
        train(ep)

    def soap_async(ep: Episode, r: int) -> None:
        fenced = saver.fenced_s
        _, ep.stall = clock(saver.start, r, 0, {})
        ep.parts[0] = ep.stall
        train(ep, saver)
        _, ep.drain = clock(saver.wait)
        ep.parts[2] = saver.fenced_s - fenced  # updates that waited for the staging copy
        ep.stall += ep.parts[2]

    def soap_proc(ep: Episode, r: int) -> None:
        fenced = proc.fenced_s
        _, ep.stall = clock(proc.start, r)
        ep.parts[0] = ep.stall
        train(ep, proc)
        _, ep.drain = clock(proc.wait)
        ep.parts[2] = proc.fenced_s - fenced
        ep.stall += ep.parts[2]

    def dcp_sync(ep: Episode, r: int) -> None:
        _, ep.stall = clock(dcp.save, state, checkpoint_id=str(base / f"dcp-sync-{r}"),
                            process_group=gloo)
        train(ep)
        cleanup(base / f"dcp-sync-{r}")

    def dcp_async(kind):
        def run(ep: Episode, r: int) -> None:
            d = base / f"dcp-{kind.value}-{r}"
            fut, ep.stall = clock(dcp.async_save, state, checkpoint_id=str(d),
                                  process_group=gloo, async_checkpointer_type=kind)
            train(ep)
            _, ep.drain = clock(fut.result)
            cleanup(d)
        return run

    modes = {"soapstone sync": soap_sync, "soapstone async": soap_async,
             "soapstone async proc": soap_proc, "DCP sync": dcp_sync,
             "DCP async thread": dcp_async(AsyncCheckpointerType.THREAD),
             "DCP async process": dcp_async(AsyncCheckpointerType.PROCESS)}
    if args.modes:
        modes = {k: v for k, v in modes.items() if k in args.modes.split(",")}
    names = list(modes)
    got: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            COMM.Barrier()
            ep = Episode()
            modes[name](ep, r + 1)
            row = (slowest(ep.stall), slowest(ep.steps), slowest(ep.drain),
                   *(slowest(x) for x in ep.parts))
            if r:  # round 0 warms up
                got[name].append(row)
    load.append(os.getloadavg()[0])
    proc.close()
    if rank == 0:
        report(got, staged_bytes, args, load)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


def cleanup(d: Path) -> None:
    """Rank 0 removes a DCP checkpoint once every rank is done with it."""
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)
    COMM.Barrier()


def report(got: dict, staged: int, args, load: list[float]) -> None:
    """The table: per mode the medians (and min-max) of stall, steps and drain, and the stall
    as a share of the same implementation's synchronous save."""
    med = {n: [statistics.median(x[i] for x in rows) for i in range(6)]
           for n, rows in got.items()}
    print(f"gpt {DIMS}, dp2, {args.rounds} rounds (+1 warm-up), {args.steps} steps after each "
          f"save, {staged / 1e6:.1f} MB written per rank (most), load average "
          f"{load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':22} {'stall s':>8} {'(min-max)':>15} {'steps s':>8} {'drain s':>8} "
          f"{'stall/sync':>10}  stall: start / agree / fence ms")
    for n, rows in got.items():
        sync = med.get("soapstone sync" if n.startswith("soapstone") else "DCP sync")
        share = f"{med[n][0] / sync[0]:10.3f}" if sync else f"{'':>10}"
        lo, hi = min(x[0] for x in rows), max(x[0] for x in rows)
        parts = (" / ".join(f"{x * 1e3:.1f}" for x in med[n][3:])
                 if n.startswith("soapstone async") else "")
        print(f"{n:22} {med[n][0]:8.4f} {f'({lo:.4f}-{hi:.4f})':>15} {med[n][1]:8.3f} "
              f"{med[n][2]:8.3f} {share}  {parts}")


class ProcessWriter(AsyncSaver):
    """The process variant (bench only): AsyncSaver's staging (the copy deferred to a thread
    behind the same optimizer fence) into a buffer in shared memory, from which a child process
    (spawned once per rank) writes the files; the thread only hands the part over and waits
    for the child's answer. Agreement and publish as in AsyncSaver, on the main thread."""

    def __init__(self, executor, root: Path):
        import torch.multiprocessing as mp

        super().__init__(executor, root, keep=1)
        ctx = mp.get_context("spawn")
        self.jobs, self.done = ctx.Queue(), ctx.Queue()
        self.child = ctx.Process(target=child_main, args=(self.jobs, self.done), daemon=True)
        self.child.start()

    def start(self, step: int, seed: int = 0, settings: dict | None = None) -> None:
        """As AsyncSaver.start; the writing goes to the child."""
        import attrs

        from soapstone.shard.checkpoint.async_save import Job
        from soapstone.shard.checkpoint.index import step_dir
        from soapstone.shard.checkpoint.save import index_header

        if self.job is not None:
            self.wait()
        tmp = self.root / f"{step_dir(self.root, step).name}.tmp-{self.token}"
        part = plan_part(self.executor, step, self.rank, self.size)
        header = index_header(self.executor, step, seed, settings or {}, self.size)
        fresh = self.staging is None
        staged, copies = self.place(part.tensors)
        if fresh:  # the buffer moves to shared memory once, and the child maps it
            self.staging.share_memory_()
            staged, copies = self.place(part.tensors)
            self.jobs.put(("buffer", self.staging))
        base = self.staging.data_ptr()
        layout = [(k, v.data_ptr() - base, v.dtype, tuple(v.shape)) for k, v in staged]
        job = self.job = Job(step, tmp, header, "write")
        message = ("write", attrs.evolve(part, tensors=[]), layout, tmp, step, self.rank)
        job.done = self._launch(job, self.hand_over, job, copies, message)

    def hand_over(self, job, copies, message) -> None:
        """The parent's thread: the staging copy, then the child writes; its answer."""
        from soapstone.shard.checkpoint.async_save import copy_all

        try:
            copy_all(copies)
        finally:
            job.staged.set()
        job.tmp.mkdir(parents=True, exist_ok=True)
        self.jobs.put(message)
        job.problem, job.tally.bytes = self.done.get()

    def close(self) -> None:
        """Stop the child."""
        self.jobs.put(None)
        self.child.join(timeout=30)


def child_main(jobs, done) -> None:
    """The writer process: waits for the shared buffer, then writes each part it is sent."""
    from soapstone.shard.checkpoint import durable, tensorfile
    from soapstone.shard.checkpoint.save import write_planned

    buf = None
    while (msg := jobs.get()) is not None:
        if msg[0] == "buffer":
            buf = msg[1]
            continue
        _, part, layout, tmp, step, rank = msg
        tensors = [(k, buf[at:at + dtype.itemsize * _numel(shape)].view(dtype).view(shape))
                   for k, at, dtype, shape in layout]
        import attrs

        tally = tensorfile.Tally()
        try:
            write_planned(attrs.evolve(part, tensors=tensors), tmp, step, rank, tally)
            done.put((None, tally.bytes))
        except OSError as e:
            done.put((durable.failure(e, f"writing {tmp}"), tally.bytes))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
