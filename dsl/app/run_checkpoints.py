"""`run`'s checkpoint flags: --save/--save-every/--keep, --resume, --init, save on a signal.

    plan = checkpoint_plan(args, graph)         # every rank, before launch (UserError)
    start = begin(trainer, plan, args, rank)    # resume or --init; the first step to train
    for m in trainer.run(args.steps - start, start):
        if after_step(trainer, plan, args, m.step, rank): break   # saved; stopped by a signal

--resume DIR takes the latest complete checkpoint in DIR (or DIR is one step-NNNNNNNN dir) and
continues at its step with its seed (data and dropout follow from seed and step); --steps is
the total. With --save, SIGTERM/SIGINT no longer end the ranks at once: every rank finishes the
step it is in, they agree (one allreduce per step), save, and exit 128+signal; a second signal
ends them at once.
"""

from __future__ import annotations

import argparse
import signal
import sys

import attrs

from soapstone.dsl.app.build import default_lr
from soapstone.dsl.lang.errors import BadInput


@attrs.frozen
class CheckpointPlan:
    """What the checkpoint flags ask for, checked."""

    save: str | None = None
    every: int | None = None
    keep: int | None = None
    resume: str | None = None  # the step dir to resume from
    start: int = 0
    skipped: tuple[tuple[str, str], ...] = ()  # step directories passed over, and why
    init: str | None = None
    saved: tuple[tuple[str, object], ...] = ()  # the resumed checkpoint's run settings


def checkpoint_plan(args: argparse.Namespace, graph, model=None) -> CheckpointPlan:
    """Check the checkpoint flags against the model of `graph` before launch (the same
    verdict on every rank; no tensor data read); with --resume, args.seed becomes the
    checkpoint's."""
    save, every, keep = args.save, args.save_every, args.keep
    if (every is not None or keep is not None) and not save:
        raise BadInput("--save-every/--keep need --save DIR")
    for flag, value in (("--save-every", every), ("--keep", keep)):
        if value is not None and value < 1:
            raise BadInput(f"{flag} {value}: give at least 1")
    if save:
        check_save_dir(save)
    if args.resume and args.init:
        raise BadInput("--resume and --init together: --resume restores the weights and the "
                       "optimizer; --init only the weights of a fresh run; give one")
    if args.init:
        from soapstone.dsl.app.init_weights import check_init

        check_init(args.init, graph, model)
    if not args.resume:
        return CheckpointPlan(save, every, keep, init=args.init)
    from soapstone.shard.checkpoint.load import open_resume

    d, index, skipped = open_resume(args.resume, graph, args.optimizer)
    if index.step >= args.steps:
        raise BadInput(f"--resume {args.resume}: the checkpoint is at step {index.step}, "
                       f"--steps {args.steps} is the total; give more steps")
    args.seed = index.seed
    return CheckpointPlan(save, every, keep, str(d), index.step,
                          tuple((str(p), why) for p, why in skipped),
                          saved=tuple(sorted(index.settings.items())))


# settings a resumed run may change on purpose (each change is noted); the model's dims and
# the optimizer are checked before launch, the layout may change freely
CHANGEABLE = ("lr", "weight_decay", "grad_clip", "precision", "accumulate", "data",
              "lr_schedule", "warmup", "min_lr")


def check_save_dir(path: str) -> None:
    """--save DIR must be a directory this process can create and write (BadInput)."""
    import os
    from pathlib import Path

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadInput(f"--save {path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--save {path}: cannot create it ({e.strerror})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise BadInput(f"--save {path}: not writable; give a directory you can write")


def settings(args: argparse.Namespace, graph) -> dict:
    """The run's settings as the index records them."""
    dims = dict(graph.stages[0].program.dims)
    return {"spec": args.spec, "parallel": args.parallel, "dims": dims,
            "optimizer": args.optimizer,
            "lr": args.lr if args.lr is not None else default_lr(args.optimizer),
            "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip, "precision": args.precision, "steps": args.steps,
            "accumulate": getattr(args, "accumulate", 1), "data": args.data,
            "lr_schedule": getattr(args, "lr_schedule", None),
            "warmup": getattr(args, "warmup", None), "min_lr": getattr(args, "min_lr", None)}


def begin(trainer, plan: CheckpointPlan, args: argparse.Namespace, rank: int) -> int:
    """Resume or load --init into the trainer's executor (collective); the first step."""
    ex = trainer.executor
    if plan.resume:
        from soapstone.shard.checkpoint import resume

        resume(ex, plan.resume)
        if rank == 0:
            for p, why in plan.skipped:
                print(f"checkpoint: ignoring {p}: {why}", file=sys.stderr, flush=True)
            print(f"checkpoint: resumed from {plan.resume} at step {plan.start}, seed "
                  f"{args.seed}", file=sys.stderr, flush=True)
            now = settings(args, trainer.graph)
            for key, was in plan.saved:
                if key in CHANGEABLE and key in now and now[key] != was:
                    print(f"checkpoint: note: {key} is {now[key]!r} now, {was!r} when saved",
                          file=sys.stderr, flush=True)
    elif plan.init:
        from soapstone.dsl.app.init_weights import load_init

        what = load_init(ex, plan.init)
        if rank == 0:
            print(f"init: {what}", file=sys.stderr, flush=True)
    if plan.save:
        _defer_signals()
    return plan.start


def after_step(trainer, plan: CheckpointPlan, args: argparse.Namespace, step: int,
               rank: int) -> int | None:
    """Save when due (every K steps, the last step, or a signal every rank agreed on);
    the signal number when the run must stop now (collective)."""
    if not plan.save:
        return None
    done = step + 1
    signum = _agreed_signal(trainer.executor)
    due = done == args.steps or (plan.every and done % plan.every == 0) or signum
    if due:
        from soapstone.shard.checkpoint import save

        d = save(trainer.executor, plan.save, done, args.seed,
                 settings(args, trainer.graph), plan.keep)
        if rank == 0:
            why = f" (stopping: {signal.Signals(signum).name})" if signum else ""
            print(f"checkpoint: saved step {done} to {d}{why}", file=sys.stderr, flush=True)
    return signum or None


def _defer_signals() -> None:
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    if dog is not None:
        dog.defer_signals()


def _agreed_signal(executor) -> int:
    """The signal any rank has received (0: none); an allreduce over the world, so every
    rank stops after the same step."""
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    got = dog.stop_signal if dog is not None else 0
    mesh = executor.mesh
    if mesh is None or mesh.world.size == 1:
        return got
    import torch

    t = torch.tensor([got], dtype=torch.float64)
    mesh.world.allreduce(t, op="max")
    return int(t)
