"""The training loop behind `soapstone run` and `soapstone golden`.

One step: every rank builds the same full batch (shard/data.py), runs its share of the forward,
backpropagates the loss, and the optimizer (shard/optim.py) syncs gradients and updates the
local shards. `Trainer.step(i)` returns the step's metrics; the global loss is gathered on
every rank (a collective: all ranks call it), so any rank may log it.

Given a StageGraph (a pipeline layout) instead of a Program, the model is a PipelineModel
(shard/pipeline.py): each step runs the schedule over every microbatch of the batch, and
build_optimizer per stage (via use_optimizer) reduces, sums tied weights over the pipe axis,
clips by the norm over every stage and updates. `task` is then required (built from the
single-rank Program: the batch is the same global batch).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator

import attrs
import torch

from soapstone.shard.data import SyntheticTask
from soapstone.shard.plan.program import Program
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.runtime import ShardedModel

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@attrs.define
class StepMetrics:
    """What one training step did (the fields of a --metrics JSON line, plus grad_norm)."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    max_rss_bytes: int
    grad_norm: float | None = None

    def to_json(self) -> dict:
        """The --metrics line: step, loss, step_time_s, tokens_per_s, max_rss_bytes."""
        return {"step": self.step, "loss": self.loss, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "max_rss_bytes": self.max_rss_bytes}


def max_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def make_optimizer(model: ShardedModel, name: str, lr: float, weight_decay: float = 0.0,
                   grad_clip: float | None = None, zero: int = 0, precision: str = "fp32"):
    """shard/optim.py's optimizer (gradient sync, ZeRO, clipping, bf16 compute with fp32
    master weights) for the model's shards."""
    from soapstone.shard.optim import build_optimizer

    return build_optimizer(model, name=name, lr=lr, weight_decay=weight_decay,
                           grad_clip=grad_clip, zero=zero, precision=precision)


class Trainer:
    """A sharded model (or pipeline), its optimizer and its data: `step(i)` trains on batch i."""

    def __init__(self, program: Program | StageGraph, mesh=None, *,
                 task: SyntheticTask | None = None, seed: int = 0, custom: dict | None = None,
                 precision: str = "fp32", optimizer: str = "adamw", lr: float = 1e-3,
                 weight_decay: float = 0.0, grad_clip: float | None = None, zero: int = 0,
                 trace: bool = False):
        self.program = program
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
        dtype = torch.float64 if precision == "fp64" else None
        mixed = precision if precision == "bf16" else None
        self.pipeline = None
        if isinstance(program, StageGraph):
            from soapstone.shard.pipeline import PipelineModel

            if task is None:
                raise ValueError("a pipeline Trainer needs the task (from the single-rank "
                                 "Program)")
            self.pipeline = self.model = PipelineModel(program, mesh, seed=seed, custom=custom,
                                                       dtype=dtype, trace=trace)
            self.model.use_optimizer(lambda m: make_optimizer(m, optimizer, lr, weight_decay,
                                                              grad_clip, zero, mixed))
            if mixed:  # boundary buffers follow the stages' compute dtype
                self.model.dtype = torch.bfloat16
            self.opt = None
            self.task = task
            return
        # bf16: the optimizer keeps fp32 masters and makes the model compute in bf16
        self.model = ShardedModel(program, mesh, seed=seed, custom=custom, dtype=dtype)
        self.opt = make_optimizer(self.model, optimizer, lr, weight_decay, grad_clip, zero,
                                  mixed)
        self.task = task or SyntheticTask(program, seed)
        loss = program.loss
        if loss is None:
            raise ValueError(f"model {program.model} marks no output as the loss")
        self.loss_name = loss.name

    def step(self, i: int) -> StepMetrics:
        """Forward, backward and optimizer step on batch `i`; the global loss and timings."""
        batch = self.task.batch(i)
        t0 = time.perf_counter()
        if self.pipeline is not None:
            for m in self.pipeline.models.values():
                m.ctx.rng_step = i
            loss = self.pipeline.train_step(batch)
            self.pipeline.step()
            norm = self.pipeline.grad_norm
        else:
            self.model.ctx.rng_step = i  # dropout masks: a function of (seed, step, value)
            out = self.model(batch)
            out[self.loss_name].backward()
            self.opt.step()
            self.opt.zero_grad()
            loss = self.model.loss_value(out)
            norm = getattr(self.opt, "grad_norm", None)
        dt = time.perf_counter() - t0
        return StepMetrics(i, loss, dt, self.task.tokens(i) / dt if dt > 0 else 0.0,
                           max_rss_bytes(), None if norm is None else float(norm))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as its full tensor, on every rank (collective)."""
        if self.pipeline is not None:
            with contextlib.ExitStack() as stack:
                for opt in self.pipeline.optimizers.values():
                    stack.enter_context(opt.gathered())
                return self.pipeline.full_state_dict()
        gathered = getattr(self.opt, "gathered", None)
        if gathered is None:
            return self.model.full_state_dict()
        with gathered():
            return self.model.full_state_dict()

    def run(self, steps: int, start: int = 0) -> Iterator[StepMetrics]:
        """Train `steps` steps, yielding each step's metrics."""
        for i in range(start, start + steps):
            yield self.step(i)


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal; on a pipe, a line
    every tenth of the run) showing the step, loss and tokens/s."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()

    def update(self, m: StepMetrics) -> None:
        """Show step `m` (on a pipe, only every tenth of the run and the last step)."""
        done = m.step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        fill = self.width * done // max(self.total, 1)
        bar = "#" * fill + "." * (self.width - fill)
        text = (f"[{bar}] {done}/{self.total}  loss {m.loss:.4f}  "
                f"{m.tokens_per_s:,.0f} tok/s  {time.perf_counter() - self.t0:.1f}s")
        self.stream.write(("\r" + text) if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

