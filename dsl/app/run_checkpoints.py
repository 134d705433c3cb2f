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

--async-save writes each checkpoint beside training (shard/checkpoint/async_save.py): the save
point only copies the rank's tensors to host memory; the same per-step allreduce also says
whether every rank's writer is done, and the step after that publishes. A save due while one
is in flight waits for it (never skips); the last step's save and a signal's are waited for
before the run ends.
"""

from __future__ import annotations

import argparse
import signal
import sys

import attrs

from soapstone.dsl.app.build import default_lr
from soapstone.dsl.app.outputs import check_dir
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
    seed_given: int | None = None  # --seed as given, which the checkpoint's seed replaced
    async_save: bool = False
    background: Background = attrs.field(factory=lambda: Background(), eq=False)


@attrs.define
class Background:
    """The run's AsyncSaver under --async-save (made by begin(), when the executor exists)."""

    saver: object | None = None


def checkpoint_plan(args: argparse.Namespace, graph, model=None) -> CheckpointPlan:
    """Check the checkpoint flags against the model of `graph` before launch (the same
    verdict on every rank; no tensor data read); with --resume, args.seed becomes the
    checkpoint's."""
    save, every, keep = args.save, args.save_every, args.keep
    background = getattr(args, "async_save", False)
    if (every is not None or keep is not None) and not save:
        raise BadInput("--save-every/--keep need --save DIR")
    if background and not save:
        raise BadInput("--async-save needs --save DIR: it writes the checkpoints --save asks "
                       "for beside training")
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
        return CheckpointPlan(save, every, keep, init=args.init, async_save=background)
    from soapstone.shard.checkpoint.load import open_resume

    d, index, skipped = open_resume(args.resume, graph, args.optimizer)
    if index.step >= args.steps:
        raise BadInput(f"--resume {args.resume}: the checkpoint is at step {index.step}, "
                       f"--steps {args.steps} is the total; give more steps")
    given, args.seed = args.seed, index.seed
    return CheckpointPlan(save, every, keep, str(d), index.step,
                          tuple((str(p), why) for p, why in skipped),
                          saved=tuple(sorted(index.settings.items())),
                          seed_given=given, async_save=background)


# settings a resumed run may change on purpose (each change is noted); the model's dims and
# the optimizer are checked before launch, the layout may change freely
CHANGEABLE = ("lr", "weight_decay", "grad_clip", "precision", "accumulate", "data",
              "lr_schedule", "warmup", "min_lr")


def check_save_dir(path: str) -> None:
    """--save DIR must be a directory this process can create and write (BadInput)."""
    check_dir(path, "--save")


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
            if plan.seed_given is not None and plan.seed_given != args.seed:
                # unlike the settings above, the new value is not used: data and dropout
                # are functions of (seed, step), so only the saved seed continues the run
                print(f"checkpoint: note: seed is {plan.seed_given} now, {args.seed} when saved; "
                      f"the run continues with the saved seed {args.seed}",
                      file=sys.stderr, flush=True)
    elif plan.init:
        from soapstone.dsl.app.init_weights import load_init

        what = load_init(ex, plan.init)
        if rank == 0:
            print(f"init: {what}", file=sys.stderr, flush=True)
    if plan.save:
        _defer_signals()
    if plan.async_save:
        from soapstone.shard.checkpoint.async_save import AsyncSaver

        plan.background.saver = AsyncSaver(ex, plan.save, plan.keep)
    return plan.start


def after_step(trainer, plan: CheckpointPlan, args: argparse.Namespace, step: int,
               rank: int) -> int | None:
    """Save when due (every K steps, the last step, or a signal every rank agreed on);
    the signal number when the run must stop now (collective). Under --async-save, also move
    the save in flight on (published once every rank's writer is done)."""
    if not plan.save:
        return None
    done = step + 1
    saver = plan.background.saver
    signum, busy, failed = _agreed_signal(trainer.executor,
                                          *(saver.status() if saver else (False, False)))
    if saver is not None:
        _saved(saver.poll(busy, failed), rank)
    due = done == args.steps or (plan.every and done % plan.every == 0) or signum
    if not due:
        return signum or None
    why = f" (stopping: {signal.Signals(signum).name})" if signum else ""
    if saver is None:
        from soapstone.shard.checkpoint import save

        d = save(trainer.executor, plan.save, done, args.seed,
                 settings(args, trainer.graph), plan.keep)
        _saved(d, rank, why)
        return signum or None
    if saver.in_flight and rank == 0:
        print(f"checkpoint: step {done} is due while step {saver.job.step} is still being "
              "written; waiting for it (--async-save waits, it never skips a save)",
              file=sys.stderr, flush=True)
    _saved(saver.wait(), rank)
    saver.start(done, args.seed, settings(args, trainer.graph))
    if done == args.steps or signum:  # the run ends: it waits for its last save
        _saved(saver.wait(), rank, why)
    return signum or None


def _saved(d, rank: int, why: str = "") -> None:
    """Rank 0's line for a published checkpoint (None: nothing was published)."""
    if d is not None and rank == 0:
        print(f"checkpoint: saved step {int(d.name[5:])} to {d}{why}", file=sys.stderr,
              flush=True)


def _defer_signals() -> None:
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    if dog is not None:
        dog.defer_signals()


def _agreed_signal(executor, busy: bool = False,
                   failed: bool = False) -> tuple[int, bool, bool]:
    """(the signal any rank has received, 0: none; whether any rank's checkpoint writer is
    busy; whether any rank's finished writer failed): one allreduce over the world, so every
    rank stops after the same step and moves an asynchronous save on at the same step."""
    from soapstone.comm.observe import watchdog

    dog = watchdog.get()
    got = dog.stop_signal if dog is not None else 0
    mesh = executor.mesh
    if mesh is None or mesh.world.size == 1:
        return got, busy, failed
    import torch

    t = torch.tensor([got, float(busy), float(failed)], dtype=torch.float64)
    mesh.world.allreduce(t, op="max")
    return int(t[0]), bool(t[1]), bool(t[2])
