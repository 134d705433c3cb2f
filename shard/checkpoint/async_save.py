"""Asynchronous checkpoints: a thread copies what the rank writes to host memory and writes it.

    saver = AsyncSaver(executor, "ckpt", keep=3)   # collective (once: the run's temp token)
    saver.start(step, seed, settings)       # no collective; returns at once
    ...                                     # training goes on while the files are written
    busy, failed = status(world, *saver.status())  # once per step, every rank (an allreduce)
    saver.poll(busy, failed)                # every rank: publishes when every writer is done
    saver.wait()                            # collective: the save in flight, published

One save of step S, on every rank:

1. start (the save point, main thread): the rank plans its part (save.plan_part: the same keys,
   order and header as a synchronous save, so the files are byte-identical), takes the
   index's header (the optimizer's update count moves on) and hands the rest to the saver's
   thread (one per rank, started with the saver: a queue put, no thread start). The thread
   copies each tensor into one host buffer (the staging copy), checks that every value of it
   is finite (a NaN or an infinity is NonFinite on every rank, exit 3, nothing written: what
   a synchronous save's refuse_nonfinite_state does), then makes the temp directory
   DIR/step-NNNNNNNN.tmp-TOKEN (TOKEN: drawn by rank 0 once per run, so every rank names it
   without a message) and writes the rank's safetensors file and its part of the index, each
   fsynced (save.write_planned, with its checksums). The copy runs beside the next step's
   forward and backward, which only read the masters and optimizer state: the first thing
   that writes them, the next optimizer update, waits at a fence (Optimizer.before_update)
   until the copy is made. The start and that wait, if any, are the stall training sees. From
   a GPU the copy is made at the save point instead, into pinned memory, and waited for there.
2. the first step after every rank's writer finished: if a rank failed (a full disk), the
   ranks agree (agree.py) on its message and every rank raises the same CheckpointError, rank 0
   having removed the partial save. Otherwise rank 0's thread merges index.json,
   fsyncs, publishes with one atomic rename (durable.publish) and prunes (save.prune).
3. the first step after that thread finished: the same for the publish's outcome; the
   checkpoint of step S is complete.

Why the collectives stay on the main thread: soapstone's communicators are used by one thread
at a time (an MPI communicator's operations are matched in the order they are called, and the
watchdog and flight recorder follow the main thread's ops), so a background thread running
agree()'s allgather beside a training allreduce on the same communicator could pair the wrong
operations across ranks. The threads touch files and memory only. What the ranks must agree
on, whether every writer is done and whether one failed, travels in the allreduce `run --save`
already makes after each step for signals (run_checkpoints.py: one tensor of three numbers),
so a save that succeeds adds no collective at all; a failure adds agree()'s two, to carry its
message.

Why a thread, not a process: the writing is file writes, fsyncs, CRC-32s (python-isal) and
tensor copies, all of which release the GIL, so a thread works beside training without holding
it for long, and it copies from the live buffers straight into its own. A process would need
the staging buffer in shared memory, a start (torch's import) per rank, a thread of the parent
to copy into it behind the same fence anyway, and cleanup when its rank dies; measured side by
side in bench/bench_async_save.py (BENCHMARKS.md): no better.

A save still in flight when the next one is due is waited for (never skipped): the next save
then starts from a published checkpoint, every due step gets its checkpoint, and the staging
buffer is free to be reused (one buffer per rank, the size of what the rank writes: explain's
`async staging` line). The run's end waits for the last save. A kill -9 at any point leaves the
save as a .tmp directory (the rename comes last), which readers pass over.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from pathlib import Path

import attrs
import torch

from soapstone.shard.checkpoint import durable, tensorfile
from soapstone.shard.checkpoint import index as ix
from soapstone.shard.checkpoint.agree import Verdict, agree, share
from soapstone.shard.checkpoint.save import (
    check_args,
    index_header,
    plan_part,
    prune,
    raise_agreed,
    write_index_from,
    write_planned,
)

ALIGN = 64  # each staged tensor starts on a cache line (and any dtype's alignment)
NONFINITE = "nonfinite|"  # a staged tensor held a NaN or an infinity: the parameter follows


@attrs.define
class Job:
    """The save in flight: its step, temp directory, index header, and the phase its thread
    is in ("write": every rank's file; "publish": rank 0's index, rename and pruning)."""

    step: int
    tmp: Path
    header: dict
    phase: str
    done: threading.Event | None = None  # set when this rank's work of the phase is done
    problem: str | None = None  # an OSError met by the thread, as durable.failure says it
    error: BaseException | None = None  # anything else: a bug, raised on the main thread
    tally: tensorfile.Tally = attrs.field(factory=tensorfile.Tally)
    staged: threading.Event = attrs.field(factory=threading.Event)  # the copy is made


class AsyncSaver:
    """Checkpoints of one executor under `root`, written beside training (see the module).
    Made on every rank together (collective)."""

    def __init__(self, executor, root: str | Path, keep: int | None = None):
        check_args(0, 0, {}, keep)
        self.executor, self.root, self.keep = executor, Path(root), keep
        mesh = executor.mesh
        self.world = mesh.world if mesh is not None else None
        self.rank = self.world.rank if self.world is not None else 0
        self.size = self.world.size if self.world is not None else 1
        # this run's temp directories are step-NNNNNNNN.tmp-TOKEN: every rank knows the name
        self.token = share(self.world, uuid.uuid4().hex[:8] if self.rank == 0 else "")
        self.staging: torch.Tensor | None = None  # one flat host buffer, reused
        self.job: Job | None = None
        self.fenced_s = 0.0  # seconds optimizer updates waited for a staging copy, in all
        self.worker = Worker(f"checkpoint-writer-rank-{self.rank}")
        for opt in executor.optimizers.values():
            opt.before_update.append(self.fence)

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and is not yet published (the same on every rank)."""
        return self.job is not None

    def status(self) -> tuple[bool, bool]:
        """(this rank's thread is still working, it finished and failed): differ by rank;
        `status()` over the world says whether the save can move on."""
        job = self.job
        if job is None or job.done is None:
            return False, False
        if not job.done.is_set():
            return True, False
        return False, job.problem is not None or job.error is not None

    def start(self, step: int, seed: int, settings: dict) -> None:
        """Start the checkpoint of `step`: plan it on this thread, copy and write it on
        another (no collective; a save in flight is waited for first, collectively: call
        wait() before, to learn what it published)."""
        check_args(step, seed, settings, self.keep)  # on every rank, before a collective
        step, seed = int(step), int(seed)  # numpy's integers are no JSON
        if self.job is not None:
            self.wait()
        tmp = self.root / f"{ix.step_dir(self.root, step).name}.tmp-{self.token}"
        part = plan_part(self.executor, step, self.rank, self.size)
        header = index_header(self.executor, step, seed, settings, self.size)
        staged, copies = self.place(part.tensors)
        job = self.job = Job(step, tmp, header, "write")
        if any(src.device.type == "cuda" for _, src in copies):
            copy_all(copies, cuda=True)  # on this thread's stream, before training goes on
            copies = []
        job.done = self._launch(job, copy_then_write, job, copies,
                                  attrs.evolve(part, tensors=staged), step, self.rank)

    def place(self, tensors: list[tuple[str, torch.Tensor]]):
        """Where each tensor's copy goes in the staging buffer (made, or grown, on first use;
        pinned when a tensor is on a GPU): ([(key, staged view)], [(staged view, tensor)])."""
        sizes = [t.numel() * t.element_size() for _, t in tensors]
        total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
        cuda = any(t.device.type == "cuda" for _, t in tensors)
        if self.staging is None or self.staging.numel() < total:
            self.staging = None  # the old buffer goes before the new one is made
            self.staging = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda)
        staged, copies, at = [], [], 0
        for (key, t), n in zip(tensors, sizes, strict=True):
            dst = self.staging[at:at + n].view(t.dtype).view(t.shape)
            staged.append((key, dst))
            copies.append((dst, t))
            at += -(-n // ALIGN) * ALIGN
        return staged, copies

    def fence(self) -> None:
        """Before an optimizer update: wait until the staging copy of the save in flight is
        made (the update would change what it copies)."""
        job = self.job
        if job is None or job.staged.is_set():
            return
        t0 = time.perf_counter()
        job.staged.wait()
        self.fenced_s += time.perf_counter() - t0

    def poll(self, busy: bool, failed: bool) -> Path | None:
        """Move the save in flight on when no rank's thread is busy (`busy`, `failed`: every
        rank's status() agreed, the same on every rank); the checkpoint's directory when this
        call published it. Collective only when a rank failed."""
        if self.job is None or busy:
            return None
        return self.advance(failed)

    def wait(self) -> Path | None:
        """Finish the save in flight (collective): its directory, or None when none was."""
        published = None
        while self.job is not None:
            published = self.advance(None) or published
        return published

    def advance(self, failed: bool | None) -> Path | None:
        """Join this rank's thread and go to the next phase; a failure on any rank is the same
        CheckpointError on every rank. `failed`: whether a rank failed, agreed (None: not
        known, agree on it here: a collective)."""
        job = self.job
        if job.done is not None:
            job.done.wait()
        if job.error is not None:  # not a disk's failure: a bug; this rank brings the job down
            raise job.error
        if failed is None or failed:
            verdict = agree(self.world, job.problem, job.tally.bytes)
        else:
            verdict = Verdict(None, None, 0)
        if verdict.problem is not None:
            self.job = None
            if verdict.problem.startswith(NONFINITE):
                raise_nonfinite(verdict, job, self.rank)
        raise_agreed(verdict, self.root, job.step, job.tmp, self.rank)
        if job.phase == "publish":
            self.job = None
            return ix.step_dir(self.root, job.step)
        job.phase, job.done = "publish", None
        if self.rank == 0:
            job.done = self._launch(job, publish, job.tmp, self.root, job.step, job.header,
                                      self.size, self.keep)
        return None

    def _launch(self, job: Job, work, *args) -> threading.Event:
        """Hand work(*args) to the worker thread; what it raises is kept on `job`; the event
        is set when it is done."""
        what = job.tmp / (ix.rank_file(self.rank) if job.phase == "write" else ix.INDEX)

        def run() -> None:
            try:
                work(*args)
            except OSError as e:
                job.problem = durable.failure(e, f"writing {what}")
            except BaseException as e:  # noqa: BLE001 (re-raised on the main thread)
                job.error = e

        return self.worker.submit(run)


class Worker:
    """One daemon thread that runs what it is handed, in order. Started with the saver, so a
    save point hands work over with a queue put and never waits for a new thread to be
    scheduled (which on a busy machine takes milliseconds)."""

    def __init__(self, name: str):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, work) -> threading.Event:
        """Run work() on the thread; the event is set when it returned."""
        done = threading.Event()
        self.queue.put((work, done))
        return done

    def loop(self) -> None:
        """The thread: each item in turn, for the life of the process."""
        while True:
            work, done = self.queue.get()
            try:
                work()
            finally:
                done.set()


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]], cuda: bool = False) -> None:
    """dst.copy_(src) for each pair (from a GPU: asynchronous copies, then waited for)."""
    for dst, src in copies:
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()


def copy_then_write(job: Job, copies, part, step: int, rank: int) -> None:
    """The writer thread: the staging copy (then the fence lets updates through), the temp
    directory (every rank makes it; it may exist), the files."""
    try:
        hold = os.environ.get("SOAPSTONE_CKPT_TEST_SLOW_STAGE", "")
        if hold and int(hold.split(":")[0]) == step:  # a test: the copy outlasts a step
            time.sleep(float(hold.split(":")[1]))
        copy_all(copies)
    finally:
        job.staged.set()  # also after a failure: the fence must not wait forever
    bad = next((key for key, t in part.tensors if not finite(t)), None)
    if bad is not None:  # nothing could resume from it: not written (as save() refuses it)
        job.problem = f"{NONFINITE}{bad.split('#')[0].split('/', 1)[1]}"
        return
    job.tmp.mkdir(parents=True, exist_ok=True)
    write_planned(part, job.tmp, step, rank, job.tally)


def finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite: a NaN or an infinity makes the sum non-finite, so
    a finite sum (one pass, no mask allocated) settles it; only a sum that overflowed or met
    one is checked element by element."""
    if not t.is_floating_point() or not t.numel():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def raise_nonfinite(verdict: Verdict, job: Job, rank: int) -> None:
    """A rank staged a NaN or an infinity: NonFinite on every rank (run exits 3), as a
    synchronous save refuses such a state; rank 0 first removes what other ranks wrote."""
    import shutil

    from soapstone.shard.train.nonfinite import NonFinite

    if rank == 0:
        shutil.rmtree(job.tmp, ignore_errors=True)
    where = (verdict.problem[len(NONFINITE):], verdict.rank or 0)
    raise NonFinite(job.step, None, None, where, what="parameter or optimizer state")


def publish(tmp: Path, root: Path, step: int, header: dict, size: int,
            keep: int | None) -> None:
    """Rank 0's part after every rank wrote: the index, the atomic rename, the pruning."""
    write_index_from(tmp, header, size)
    durable.publish(tmp, ix.step_dir(root, step))
    prune(root, keep, step)


def status(world, busy: bool, failed: bool) -> tuple[bool, bool]:
    """(any rank's writer busy, any rank's failed): one allreduce over `world` (None: this
    rank's own). run's per-step allreduce carries the same two flags."""
    if world is None or world.size == 1:
        return busy, failed
    t = torch.tensor([float(busy), float(failed)], dtype=torch.float64)
    world.allreduce(t, op="max")
    return bool(t[0]), bool(t[1])
