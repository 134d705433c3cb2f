"""The training loop behind `soapstone run` and `soapstone golden`.

One step: every rank builds the same full batch (shard/data/tasks.py) and the executor
(shard/runtime/executor.py) runs its share: every microbatch's forward and backward by the layout's
schedule, then the optimizers (shard/train/optim.py) sync gradients, clip and update the local
shards. Every layout takes this one path; a layout without stages is a one-stage graph.
`Trainer.step(i)` returns the step's metrics; the global loss is gathered on every rank (a
collective: all ranks call it), so any rank may log it. A schedule (shard/train/lr_schedule.py) sets
each step's learning rate; `accumulate` k > 1 takes batches k*i .. k*i+k-1 into step i's one
update; `evaluate(n)` is the loss of n held-out batches (the task's `eval_batch`), forward only.
A non-finite loss or gradient norm updates nothing (shard/train/nonfinite.py): the trainer
stops with NonFinite, or under OnNonFinite.SKIP counts the step as skipped and goes on, at
most `max_skips` steps in a row.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Iterator

import attrs
import torch

from soapstone.comm.dtype_table import MIXED_PRECISIONS, PRECISIONS
from soapstone.comm.launch.supervisor import note_step
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.train.errors import SettingError
from soapstone.shard.train.lr_schedule import LRSchedule
from soapstone.shard.train.nonfinite import DEFAULT_MAX_SKIPS, NonFinite, OnNonFinite


@attrs.define
class StepMetrics:
    """What one training step did (the fields of a --metrics JSON line, plus grad_norm)."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    max_rss_bytes: int
    grad_norm: float | None = None
    lr: float | None = None
    skipped: bool = False  # non-finite: its update was dropped (OnNonFinite.SKIP)
    skipped_steps: int | None = None  # the run's skipped steps so far (under SKIP only)
    tflops_per_device: float | None = None  # model FLOPs (no recompute) per device and second
    mfu: float | None = None  # tflops_per_device over the device's peak (None: no peak known)

    def to_json(self) -> dict:
        """The --metrics line: step, loss (null when not finite: JSON has no NaN), lr,
        step_time_s, tokens_per_s, max_rss_bytes, tflops_per_device, mfu; under
        --on-nonfinite skip also skipped (this step's update dropped) and skipped_steps (so
        far)."""
        out = {"step": self.step, "loss": self.loss if math.isfinite(self.loss) else None,
               "lr": self.lr, "step_time_s": self.step_time_s,
               "tokens_per_s": self.tokens_per_s, "max_rss_bytes": self.max_rss_bytes,
               "tflops_per_device": self.tflops_per_device, "mfu": self.mfu}
        if self.skipped_steps is not None:
            out |= {"skipped": self.skipped, "skipped_steps": self.skipped_steps}
        return out


@attrs.frozen
class EvalMetrics:
    """An evaluation after training step `step`: the mean loss of `batches` held-out batches
    (and its perplexity, exp(loss), for a language model)."""

    step: int
    loss: float
    batches: int
    perplexity: float | None = None
    stopped: int = 0  # the signal that ended it before all its batches (0: it ran them all)

    def to_json(self) -> dict:
        """The --metrics line of an evaluation: step, eval_loss, eval_batches (+ perplexity)."""
        out = {"step": self.step, "eval_loss": self.loss, "eval_batches": self.batches}
        if self.perplexity is not None:
            out["eval_perplexity"] = self.perplexity
        return out


# how many eval batches between checks for a pending stop signal (each check is one tiny
# allreduce; a batch is one forward, so the stop waits at most this many forwards)
EVAL_STOP_EVERY = 4


def stop_deferred() -> bool:
    """Whether a SIGTERM/SIGINT only asks the run to stop (the watchdog defers it: run --save)
    rather than ending every rank at once; alike on every rank."""
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    return dog is not None and dog.deferring


def agreed_stop(mesh) -> int:
    """The stop signal any rank has received (0: none), the same on every rank: one max
    allreduce over the world (collective), so every rank stops at the same point."""
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    got = dog.stop_signal if dog is not None else 0
    if mesh is None or mesh.world.size == 1:
        return got
    t = torch.tensor([got], dtype=torch.float64)
    mesh.world.allreduce(t, op="max")
    return int(t[0])


def rank_memory(comm=None) -> tuple[int, str]:
    """(bytes, whose) one rank may hold: its GPU's memory when its communicator is on CUDA
    (over the ranks sharing it, under --comm mpi), else this host's physical memory over the
    ranks the launcher put on it."""
    from soapstone.shard.plan.analysis.fit import host_memory_per_rank

    if comm is not None and comm.device.type == "cuda":
        props = torch.cuda.get_device_properties(comm.device)
        share = comm.ranks_per_gpu  # --comm mpi: ranks sharing one GPU
        if share > 1:
            return props.total_memory // share, f"{props.name} shared by {share} ranks"
        return props.total_memory, props.name
    return host_memory_per_rank()


def max_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class Trainer:
    """An executor with its optimizers and its data: `step(i)` trains on batch i."""

    def __init__(self, graph: StageGraph, mesh=None, *, task: SyntheticTask, seed: int = 0,
                 custom: dict | None = None, precision: str = "fp32", optimizer: str = "adamw",
                 lr: float = 1e-3, weight_decay: float = 0.0, grad_clip: float | None = None,
                 trace: bool = False, check_memory: bool = True,
                 schedule: LRSchedule | None = None, accumulate: int = 1,
                 device: torch.device | str | None = None, flops_per_step: float | None = None,
                 peak_flops: float | None = None,
                 on_nonfinite: OnNonFinite = OnNonFinite.STOP,
                 max_skips: int = DEFAULT_MAX_SKIPS, draw: bool = True):
        if precision not in PRECISIONS and precision not in MIXED_PRECISIONS:
            raise SettingError(f"precision must be one of "
                               f"{', '.join((*PRECISIONS, *MIXED_PRECISIONS))}, not {precision!r}")
        if check_memory:  # before anything is allocated: DoesNotFit (a UserError)
            from soapstone.shard.plan.analysis.fit import check_fit
            from soapstone.shard.plan.analysis.precision import graph_as_run

            # what this precision keeps: bf16 activations beside fp32 masters
            check_fit(graph_as_run(graph, precision), optimizer,
                      *rank_memory(mesh.world if mesh is not None else None))
        self.graph = graph
        # fp64: the whole model in float64 (checks); bf16: bf16 compute over fp32 masters;
        # float8: bf16's, with the weight matmuls in float8 (shard/runtime/float8.py)
        base = MIXED_PRECISIONS.get(precision, precision)
        want = getattr(torch, PRECISIONS[base].torch_name)
        self.executor = Executor(
            graph, mesh, seed=seed, custom=custom,
            dtype=want if base == "fp64" else None,
            compute_dtype=want if base == "bf16" else None, trace=trace,
            device=device, draw=draw, float8=precision == "float8")
        self.executor.use_optimizer(name=optimizer, lr=lr, weight_decay=weight_decay,
                                    grad_clip=grad_clip)
        if accumulate < 1:
            raise SettingError(f"accumulate must be >= 1, got {accumulate}")
        self.schedule, self.accumulate, self.lr = schedule, accumulate, lr
        self.on_nonfinite, self.max_skips = on_nonfinite, max_skips
        self.skipped = self.skips_in_a_row = 0
        # MFU: a step's model FLOPs shared by every device, and one device's peak FLOP/s
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.world = mesh.world.size if mesh is not None else 1
        self.task = task
        if hasattr(task, "read_rows"):  # a loader that reads only this rank's rows
            task.read_rows(self.executor.input_rows())

    def step(self, i: int) -> StepMetrics:
        """Forward, backward and optimizer step on batch `i` (with accumulate k: batches
        k*i .. k*i+k-1, one update); the global loss, the rate and timings."""
        k = self.accumulate
        batch = self.task.batch(i) if k == 1 else [self.task.batch(k * i + j) for j in range(k)]
        lr = self.schedule.at(i) if self.schedule is not None else self.lr
        if self.schedule is not None:
            self.executor.set_lr(lr)
        t0 = time.perf_counter()
        skipped = False
        try:
            loss = self.executor.train_step(batch, step=i)
            self.skips_in_a_row = 0
        except NonFinite as e:  # every rank alike: the same branch everywhere
            if self.on_nonfinite is not OnNonFinite.SKIP:
                raise
            if self.skips_in_a_row >= self.max_skips:
                raise attrs.evolve(e, skips=self.skips_in_a_row,
                                   max_skips=self.max_skips) from None
            self.skips_in_a_row += 1
            self.skipped += 1
            loss, skipped = e.loss if e.loss is not None else math.nan, True
        dt = time.perf_counter() - t0
        norm = self.executor.grad_norm
        tokens = sum(self.task.tokens(k * i + j) for j in range(k))
        flops = (self.flops_per_step / self.world / dt
                 if self.flops_per_step is not None and dt > 0 else None)
        mfu = flops / self.peak_flops if flops is not None and self.peak_flops else None
        return StepMetrics(i, loss, dt, tokens / dt if dt > 0 else 0.0,
                           max_rss_bytes(), None if norm is None else float(norm), lr,
                           skipped, self.skipped if self.on_nonfinite is OnNonFinite.SKIP
                           else None, None if flops is None else flops / 1e12, mfu)

    def evaluate(self, batches: int, step: int = 0) -> EvalMetrics:
        """The mean loss of held-out batches 0..batches-1 (`task.eval_batch`), forward only,
        after training step `step`; perplexity for a language model (collective). A pending
        SIGTERM/SIGINT (the watchdog's deferred stop) ends it early, on every rank at the same
        batch: then `stopped` is the signal and the loss covers the batches done."""
        total, done, signum = 0.0, 0, 0
        watch = stop_deferred()
        for j in range(batches):
            if watch and j and j % EVAL_STOP_EVERY == 0:
                signum = agreed_stop(self.executor.mesh)
                if signum:
                    break
            total += self.executor.infer(self.task.eval_batch(j))[0]
            done += 1
        loss = total / done
        lm = getattr(self.task, "lm", None)
        return EvalMetrics(step, loss, done, math.exp(min(loss, 700.0)) if lm else None,
                           signum)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as its full tensor, on every rank (collective)."""
        return self.executor.full_state_dict()

    def run(self, steps: int, start: int = 0) -> Iterator[StepMetrics]:
        """Train `steps` steps, yielding each step's metrics."""
        for i in range(start, start + steps):
            note_step(i)  # a rank that leaves mid-run is named with its step (supervisor.py)
            yield self.step(i)

