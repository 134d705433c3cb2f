"""Nothing silently wrong: a non-finite loss or gradient norm never becomes an update.

The executor checks every step's loss and global gradient norm before the optimizers update
(Executor.step). Both are already the same on every rank: the loss is reduced over the data
and pipe axes, and the norm sums each bucket's squares over the axes it is split on, then
over the pipe axis, so a NaN or an infinity on any rank reaches every rank (NaN and inf
survive any order of summation; a replica's gradient comes out of the same allreduce on
each replica). Every rank therefore decides alike, without a collective of its own.

A non-finite step drops the update (the gradients are cleared, the optimizer's state and
step count are untouched: what torch's GradScaler does) and raises NonFinite on every rank,
after one collective that finds the first parameter, in the model's order, whose reduced
gradient holds the NaN or inf, and on which rank. The Trainer then stops (the default:
`run` exits EXIT_NONFINITE, 3) or, with OnNonFinite.SKIP, goes on with the next batch, at
most `max_skips` steps in a row. Saving is guarded too: `refuse_nonfinite_state` (called by
the checkpoint writer before anything is written) reduces a finiteness flag over the world,
since there each rank checks only the state it holds.
"""

from __future__ import annotations

import enum
import math

import attrs
import torch

EXIT_NONFINITE = 3  # `run`'s exit code when it stops on a non-finite step (2 is bad input)
DEFAULT_MAX_SKIPS = 10


class OnNonFinite(enum.Enum):
    """What a training run does with a non-finite step (`run --on-nonfinite`)."""

    STOP = "stop"
    SKIP = "skip"


@attrs.frozen
class NonFinite(Exception):
    """A step whose loss or gradient norm is NaN or infinite; raised on every rank alike.
    step: 0-based; where: (parameter, world rank) of the first non-finite gradient or state,
    None when every element is finite (only the loss, or a norm that overflowed)."""

    step: int
    loss: float | None
    grad_norm: float | None
    where: tuple[str, int] | None = None
    what: str = "gradient"  # or "parameter or optimizer state" (a save refused)
    skips: int = 0  # the steps skipped in a row before this one (OnNonFinite.SKIP)
    max_skips: int | None = None

    def __str__(self) -> str:
        return self.message()

    def message(self) -> str:
        """One paragraph: which step, what was not finite, where, what happens, the fix."""
        if self.what != "gradient":
            place = f": {self.where[0]} on rank {self.where[1]}" if self.where else ""
            return (f"after step {self.step}: a non-finite {self.what}{place}; the "
                    "checkpoint is not written (nothing could resume from it)")
        found = []
        if self.loss is not None and not math.isfinite(self.loss):
            found.append(f"the loss is {self.loss}")
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            found.append(f"the gradient norm is {self.grad_norm}")
        first = (f" (first non-finite gradient: {self.where[0]}, on rank {self.where[1]})"
                 if self.where else
                 " (every gradient element is finite: their norm overflowed)"
                 if self.grad_norm is not None and not math.isfinite(self.grad_norm) else "")
        head = f"step {self.step + 1}: {' and '.join(found) or 'non-finite'}{first}"
        if self.max_skips is not None:
            return (f"{head}: {self.skips + 1} non-finite steps in a row, more than "
                    f"--max-skips {self.max_skips}; the update was not applied and the run "
                    "stops")
        return (f"{head}: the update was not applied and the run stops (--on-nonfinite stop); "
                "lower --lr, clip with --grad-clip, or skip such steps with --on-nonfinite "
                "skip")

    def format(self) -> str:
        """The text a command prints (no traceback)."""
        return f"error: {self.message()}"


def check_step(executor, loss: float | None, step: int | None) -> None:
    """Before the update: NonFinite (every rank alike, the gradients cleared) when the loss
    or executor.grad_norm is not finite. Collective only then (every rank reaches it)."""
    norm = executor.grad_norm
    if (norm is None or math.isfinite(norm)) and (loss is None or math.isfinite(loss)):
        return
    bad = set()
    for opt in executor.optimizers.values():
        reducer = opt.reducer
        bad.update(reducer.nonfinite_slots([s.grad for s in reducer.segments()]))
    where = first_over_world(executor, bad)
    for opt in executor.optimizers.values():
        opt.zero_grad()
    raise NonFinite(step or 0, loss, norm, where)


def refuse_nonfinite_state(executor, step: int) -> None:
    """Before a checkpoint is written: NonFinite on every rank when any rank holds a NaN or an
    infinity in a parameter, a master value or optimizer state (a world reduction: here the
    ranks' verdicts could differ)."""
    bad = set()
    for opt in executor.optimizers.values():
        reducer = opt.reducer
        segments = reducer.segments()
        bad.update(reducer.nonfinite_slots([s.master for s in segments]))
        for key in sorted({k for st in opt.state for k in st}):
            bad.update(reducer.nonfinite_slots([st.get(key) for st in opt.state]))
    for _, name, p in executor.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
            bad.add(name)
    where = first_over_world(executor, bad)
    if where is not None:
        raise NonFinite(step, None, None, where, what="parameter or optimizer state")


def first_over_world(executor, local: set[str]) -> tuple[str, int] | None:
    """The first of the names `local` holds on any rank, in the model's parameter order (a
    name outside it after them all), and the lowest rank holding it; None when no rank holds
    any (collective over the world when there is one)."""
    order = list(dict.fromkeys(p.name for s in executor.graph.stages for p in s.program.params))
    mesh = executor.mesh
    rank, size = (mesh.world.rank, mesh.world.size) if mesh is not None else (0, 1)
    index = min((order.index(n) if n in order else len(order) for n in local),
                default=len(order) + 1)
    code = torch.tensor([float(index * size + rank)], dtype=torch.float64,
                        device=executor.device)
    if mesh is not None:
        mesh.world.allreduce(code, op="min")
    index, holder = divmod(int(code.item()), size)
    if index > len(order):
        return None
    return (order[index] if index < len(order) else "a tensor outside the model's", holder)
