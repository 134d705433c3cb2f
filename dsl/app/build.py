"""Spec + flags -> model, layout and compiled plan: what every command that builds a model
shares (and tests and dsl/testing.py use without a command line).

`load_layout(args)` reads SPEC, --model, --parallel, --dim and --plugin; `build_program` also
checks the launch; `compile_layout` turns (model, layout) into the plan the runtime executes.
Every failure is a UserError (SpecError with FILE:LINE:COL, or BadInput naming the flag), raised
alike on every rank, so a bad input makes all ranks stop at once. Nothing at import time needs
torch: `check`, `show` and `explain` import this module on machines without it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from soapstone.dsl.lang.errors import BadInput, Diagnostic, SpecError


def parse_dims(items: list[str]) -> dict[str, int]:
    """`["seq=64", ...]` -> {"seq": 64}; SpecError on a malformed item or a size < 1."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name.isidentifier() or not value.lstrip("-").isdigit():
            raise SpecError([Diagnostic("--dim", 0, 0, f"--dim {item!r}: expected NAME=INTEGER",
                                        "e.g. --dim seq=256")])
        if int(value) < 1:
            raise SpecError([Diagnostic("--dim", 0, 0, f"--dim {name}={int(value)}: dim sizes "
                                        "are integers >= 1", f"e.g. --dim {name}=16")])
        dims[name] = int(value)
    return dims


def load_plugins(refs: list[str]) -> None:
    """Import each plugin; a failure is bad input (SpecError), not a traceback: at the
    plugin's line that raised it, when the plugin is a file."""
    import traceback

    from soapstone.dsl.layers.custom import LayerError, load_plugin

    for ref in refs:
        try:
            load_plugin(ref)
        except SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported
            what = str(e) if isinstance(e, LayerError) else f"{type(e).__name__}: {e}"
            mine = Path(ref).resolve()
            line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                         if Path(f.filename).resolve() == mine), 0)
            raise SpecError([Diagnostic(ref, line, 1 if line else 0,
                                        f"cannot load plugin: {what}")]) from None


def default_lr(optimizer: str) -> float:
    """The learning rate when --lr is not given: 1e-2 for adamw, 0.1 for sgd."""
    return 1e-2 if optimizer == "adamw" else 0.1


def world(device=None, comm: str = "auto"):
    """The world communicator (a singleton when launched without mpiexec): MPI, or NCCL when
    `device` is a CUDA device (from pick_device), or MPI through host memory for CUDA ranks
    sharing GPUs (--comm mpi)."""
    from soapstone.comm import init
    from soapstone.comm.launch.device import backend

    return init(backend("cpu" if device is None else device.type, comm))


def pick_device(choice: str = "cpu", comm: str = "auto"):
    """This rank's torch device for --device CHOICE (cpu, cuda, auto) and --comm (auto, nccl,
    mpi) (DeviceError, a UserError, on every rank alike when it cannot be used; collective
    when CUDA is asked for)."""
    from soapstone.comm.launch.device import pick

    return pick(choice, comm=comm)


def custom_layers() -> dict:
    """Every registered custom layer's function, by name (for the runtime)."""
    from soapstone.dsl.layers.custom import registered

    return {name: layer.fn for name, layer in registered().items()}


def compile_layout(model, par):
    """The layout's StageGraph (every layout: one without stages is one stage)."""
    from soapstone.dsl.compile.stages import lower_graph

    return lower_graph(model, par)


def single_program(model, graph):
    """The Program whose global input shapes the data task draws: the single-rank Program of
    the model (tied weights resolved); a one-stage graph's own when it runs whole batches."""
    if len(graph.stages) == 1 and graph.microbatches == 1:
        return graph.program
    from soapstone.dsl.compile.lower import lower

    return lower(model, None)


def load_layout(args: argparse.Namespace):
    """(model, parallel block or None) named by the flags (SpecError / BadInput)."""
    from soapstone.dsl.lang.spec import load

    dims = parse_dims(args.dim)
    load_plugins(args.plugin)
    spec = load(args.spec, dims=dims, filename=args.spec)
    par = spec.parallel(args.parallel) if args.parallel else None
    report_refusals(spec, args.parallel)
    model = spec.model(args.model if args.model else (par.model if par else None))
    if par is not None and par.model != model.name:
        raise BadInput(f"parallel block '{par.name}' is for model '{par.model}', "
                       f"not '{model.name}'")
    return model, par


def report_refusals(spec, named: str | None) -> None:
    """Without --parallel, one line on stderr per layout the --dim sizes left out (with a
    --parallel, only that layout matters: a refused one has raised its reasons)."""
    import sys

    if not named:
        for line in spec.refusals():
            print(line, file=sys.stderr)


def build_program(args: argparse.Namespace, world_size: int | None):
    """(model, parallel or None, StageGraph) for the flags; SpecError / BadInput when unusable.

    With world_size, also checks that the layout needs exactly that many ranks."""
    model, par = load_layout(args)
    need = par.world_size if par else 1
    if world_size is not None and world_size != need:
        what = f"layout '{par.name}' (mesh {' x '.join(f'{a}={s}' for a, s in par.mesh)})" \
            if par else f"model '{model.name}' without --parallel"
        raise BadInput(f"{what} needs {need} rank{'s' if need > 1 else ''}, but this run has "
                       f"{world_size}: launch it with `mpiexec -n {need} soapstone ...`")
    return model, par, compile_layout(model, par)


def check_memory(model, graph, comm, optimizer: str, spec: str,
                 precision: str = "fp32") -> None:
    """The fit check before anything is allocated (shard/plan/analysis/fit.py): DoesNotFit (exit 2)
    with the numbers and a layout `soapstone plan` finds for this many ranks, when the
    layout's estimate (what `precision` keeps) exceeds what a rank has. Alike on every rank
    (the estimate is the busiest rank's; the memory is the host's MemTotal over the ranks on
    it, or the GPU's)."""
    from soapstone.shard.plan.analysis.fit import DoesNotFit, check_fit
    from soapstone.shard.plan.analysis.precision import graph_as_run
    from soapstone.shard.train.trainer import rank_memory

    available, where = rank_memory(comm)
    try:
        check_fit(graph_as_run(graph, precision), optimizer, available, where)
    except DoesNotFit as e:
        hint = plan_hint(model, comm.size, available, optimizer, spec, precision)
        raise DoesNotFit(f"{e}\nhint: {hint}") from None


def plan_hint(model, world: int, available: int, optimizer: str, spec: str,
              precision: str = "fp32") -> str:
    """What `soapstone plan` suggests for `world` ranks of `available` bytes each, in
    `precision`."""
    import attrs

    from soapstone.dsl.search.plan_search import Planner, search
    from soapstone.dsl.search.space import PlanError
    from soapstone.shard.plan.analysis.hardware import presets
    from soapstone.shard.plan.units import format_bytes

    base = presets()["cpu-2core"]
    prof = attrs.evolve(base, name="this machine", memory_bytes=available, usable_fraction=0.9,
                        devices_per_node=max(world, 1))
    ranks = f"{world} rank{'s' if world > 1 else ''} of {format_bytes(available)}"
    try:
        plan = search(Planner(model, prof, optimizer=optimizer, precision=precision), world)
    except PlanError as e:
        why = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        return (f"no layout of {model.name} fits {ranks} ({why}): launch more ranks or use "
                f"smaller dims (`soapstone plan {spec} --world N --profile NAME|FILE` "
                "searches)")
    best = plan.best
    block = "\n".join("  " + line for line in plan.source().splitlines())
    return (f"`soapstone plan` finds for {ranks}: {best.candidate.label}, "
            f"{format_bytes(best.memory)} per rank:\n{block}")


def check_train_flags(args: argparse.Namespace) -> None:
    """Numbers that cannot work (BadInput)."""
    if args.steps < 1:
        raise BadInput(f"--steps {args.steps}: give at least 1")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise BadInput(f"--lr {args.lr}: the learning rate must be a positive number")
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        raise BadInput(f"--grad-clip {args.grad_clip}: must be a positive number")
    wd = getattr(args, "weight_decay", 0.0)
    if not (math.isfinite(wd) and wd >= 0):
        raise BadInput(f"--weight-decay {wd}: give a number >= 0 (0: none)")
    skips = getattr(args, "max_skips", None)
    if skips is not None and getattr(args, "on_nonfinite", "stop") != "skip":
        raise BadInput(f"--max-skips {skips}: only with --on-nonfinite skip")
    if skips is not None and skips < 0:
        raise BadInput(f"--max-skips {skips}: give 0 or more skipped steps in a row")


def lr_schedule(args: argparse.Namespace, lr: float):
    """The LRSchedule the flags ask for (--lr-schedule, --warmup, --min-lr); BadInput when
    the numbers cannot work. Also checks --accumulate, --eval-every and --eval-steps."""
    from soapstone.shard.train.lr_schedule import LRSchedule

    min_lr = args.min_lr if args.min_lr is not None else lr / 10
    if not 0 <= args.warmup <= args.steps:
        raise BadInput(f"--warmup {args.warmup}: give 0 to --steps ({args.steps}) steps")
    if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise BadInput(f"--min-lr {min_lr:g}: the floor must be between 0 and the learning "
                       f"rate {lr:g}")
    for flag, value, least in (("--accumulate", args.accumulate, 1),
                               ("--eval-every", args.eval_every, 0),
                               ("--eval-steps", args.eval_steps, 1)):
        if value < least:
            raise BadInput(f"{flag} {value}: give at least {least}")
    if getattr(args, "val_data", None) and args.eval_every == 0:  # read by nothing: say so
        raise BadInput(f"--val-data {args.val_data}: nothing evaluates without --eval-every K; "
                       "add it, or leave --val-data out")
    return LRSchedule(lr, args.steps, args.warmup, args.lr_schedule, min_lr)


def check_trace_flag(path: str, par) -> None:
    """--trace needs a pipeline layout (BadInput); its path is one of the outputs rank 0
    checks (dsl/app/outputs.py, run's check_outputs)."""
    if par is None or not par.operator:
        raise BadInput(f"--trace {path}: only pipeline layouts (an operator statement) have "
                       "a schedule timeline to trace")
