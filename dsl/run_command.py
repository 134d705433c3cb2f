"""`[mpiexec -n N] soapstone run SPEC [--parallel P] [--steps K] ...`: train a spec's model.

Every rank parses the spec, lowers the chosen layout and checks the launch (N must equal the
layout's world size) on its own; all ranks reach the same verdict, so a bad input makes every
rank exit 2 at once (rank 0 prints the error) instead of leaving some waiting in a collective.
Rank 0 draws the progress bar and writes --metrics; other ranks print only when failing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .check_command import add_spec_options, load_plugins, parse_dims
from .errors import SpecError


class BadInput(Exception):
    """A flag, file or launch that cannot work: one line for the user, exit 2."""


def add_model_options(parser: argparse.ArgumentParser, parallel_required: bool = False) -> None:
    """SPEC, --model, --parallel, --dim, --plugin: which program to build."""
    parser.add_argument("spec", metavar="SPEC", help="the .par file")
    parser.add_argument("--parallel", required=parallel_required,
                        help="the parallel block (layout) to run; default: one rank")
    parser.add_argument("--model", help="which model (default: the only one, or --parallel's)")
    add_spec_options(parser)


def add_train_options(parser: argparse.ArgumentParser, steps: int, optimizer: str,
                      lr: float | None) -> None:
    """--steps, --seed, --optimizer, --lr, --weight-decay, --grad-clip, --precision, --data."""
    parser.add_argument("--steps", type=int, default=steps, help=f"steps (default {steps})")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default=optimizer,
                        help=f"default {optimizer}")
    parser.add_argument("--lr", type=float, default=lr,
                        help="learning rate (default 1e-2 for adamw, 0.1 for sgd)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="default 0")
    parser.add_argument("--grad-clip", type=float, default=None, metavar="C",
                        help="clip the global gradient norm to C")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="parameter and activation dtype (default fp32)")
    parser.add_argument("--data", metavar="FILE",
                        help="token data: a .npy of integer ids, or any file read as bytes "
                             "(default: the built-in synthetic task)")


def default_lr(optimizer: str) -> float:
    return 1e-2 if optimizer == "adamw" else 0.1


def world():
    """The world communicator (MPI; a singleton when launched without mpiexec)."""
    from soapstone.comm import init

    return init("mpi")


def custom_layers() -> dict:
    """Every registered custom layer's function, by name (for ShardedModel)."""
    from .custom import registered

    return {name: layer.fn for name, layer in registered().items()}


def compile_layout(model, par):
    """The layout's StageGraph (every layout: one without stages is one stage)."""
    from .stages import lower_graph

    return lower_graph(model, par)


def single_program(model, graph):
    """The Program whose global input shapes the data task draws: the single-rank Program of
    the model (tied weights resolved); a one-stage graph's own when it runs whole batches."""
    if len(graph.stages) == 1 and graph.microbatches == 1:
        return graph.program
    from .lower import lower

    return lower(model, None)


def load_layout(args: argparse.Namespace):
    """(model, parallel block or None) named by the flags (SpecError / BadInput)."""
    from .spec import load

    dims = parse_dims(args.dim)
    load_plugins(args.plugin)
    spec = load(args.spec, dims=dims, filename=args.spec)
    par = spec.parallel(args.parallel) if args.parallel else None
    model = spec.model(args.model if args.model else (par.model if par else None))
    if par is not None and par.model != model.name:
        raise BadInput(f"parallel block '{par.name}' is for model '{par.model}', "
                       f"not '{model.name}'")
    return model, par


def build_program(args: argparse.Namespace, world_size: int | None):
    """(model, parallel or None, Program or StageGraph) for the flags; SpecError / BadInput
    when unusable.

    With world_size, also checks that the layout needs exactly that many ranks."""
    model, par = load_layout(args)
    need = par.world_size if par else 1
    if world_size is not None and world_size != need:
        what = f"layout '{par.name}' (mesh {' x '.join(f'{a}={s}' for a, s in par.mesh)})" \
            if par else f"model '{model.name}' without --parallel"
        raise BadInput(f"{what} needs {need} rank{'s' if need > 1 else ''}, but this run has "
                       f"{world_size}: launch it with `mpiexec -n {need} soapstone ...`")
    return model, par, compile_layout(model, par)


def check_train_flags(args: argparse.Namespace) -> None:
    """Numbers that cannot work (BadInput)."""
    if args.steps < 1:
        raise BadInput(f"--steps {args.steps}: give at least 1")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise BadInput(f"--lr {args.lr}: the learning rate must be a positive number")
    if args.grad_clip is not None and not args.grad_clip > 0:
        raise BadInput(f"--grad-clip {args.grad_clip}: must be positive")
    metrics = getattr(args, "metrics", None)
    if metrics and not Path(metrics).resolve().parent.is_dir():
        raise BadInput(f"--metrics {metrics}: the directory {Path(metrics).parent} "
                       "does not exist")


def check_trace_flag(path: str, par) -> None:
    """--trace needs a pipeline layout and a writable directory (BadInput)."""
    if par is None or not par.operator:
        raise BadInput(f"--trace {path}: only pipeline layouts (an operator statement) have "
                       "a schedule timeline to trace")
    if not Path(path).resolve().parent.is_dir():
        raise BadInput(f"--trace {path}: the directory {Path(path).parent} does not exist")


def report(rank: int, message: str) -> int:
    """Print a bad-input error on rank 0 (every rank returns 2)."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    return 2


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    add_train_options(parser, steps=100, optimizer="adamw", lr=None)
    parser.add_argument("--metrics", metavar="F.jsonl",
                        help="write one JSON line per step (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--trace", metavar="FILE",
                        help="pipeline layouts: write the last step's timeline as a Chrome "
                             "trace (and FILE with .png if matplotlib is installed) and print "
                             "the measured bubble next to the schedule's theoretical one")


def main(args: argparse.Namespace) -> int:
    from soapstone.shard.data import DataError, make_task

    comm = world()
    rank = comm.rank
    try:
        check_train_flags(args)
        model, par, program = build_program(args, comm.size)
        if getattr(args, "trace", None):
            check_trace_flag(args.trace, par)
        task = make_task(single_program(model, program), args.seed, args.data)
    except SpecError as e:
        return report(rank, e.format())
    except (BadInput, DataError) as e:
        return report(rank, f"error: {e}")
    return train(args, comm, par, program, task)


def train(args, comm, par, program, task) -> int:
    from soapstone.comm import Mesh
    from soapstone.shard.train import ProgressBar, Trainer

    rank = comm.rank
    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and program.world_size > 1 else None
    lr = args.lr if args.lr is not None else default_lr(args.optimizer)
    trace = getattr(args, "trace", None)
    trainer = Trainer(program, mesh, task=task, seed=args.seed, custom=custom_layers(),
                      precision=args.precision, optimizer=args.optimizer, lr=lr,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      trace=bool(trace))
    layout = f" / {par.name}" if par is not None else ""
    if rank == 0:
        print(f"soapstone run: {program.model}{layout} on {comm.size} rank"
              f"{'s' if comm.size > 1 else ''}, {args.steps} steps, {args.optimizer} lr {lr:g}, "
              f"{'data ' + args.data if args.data else 'synthetic task'}, seed {args.seed}",
              file=sys.stderr, flush=True)
    bar = ProgressBar(args.steps) if rank == 0 and not args.quiet else None
    metrics = open(args.metrics, "w") if rank == 0 and args.metrics else None  # noqa: SIM115
    first = last = None
    total_t = total_tok = 0.0
    try:
        for m in trainer.run(args.steps):
            first = m if first is None else first
            last = m
            total_t += m.step_time_s
            total_tok += m.tokens_per_s * m.step_time_s
            if metrics:
                metrics.write(json.dumps(m.to_json()) + "\n")
                metrics.flush()
            if bar:
                bar.update(m)
    finally:
        if metrics:
            metrics.close()
        if bar:
            bar.close()
    if rank == 0:
        print(f"done: {args.steps} steps, loss {first.loss:.4f} -> {last.loss:.4f}, "
              f"{total_tok / total_t if total_t else 0:,.0f} tokens/s", flush=True)
    if trace:
        write_trace(trainer.executor, trace, rank)
    return 0


def write_trace(pipe, path: str, rank: int) -> None:
    """The last step's timeline: Chrome trace JSON (+ .png) and the bubble (collective)."""
    from soapstone.shard import trace as tr

    events = pipe.events()
    measured, theory = tr.bubble(events, pipe.graph.pipe), pipe.schedule.theory_bubble()
    if rank != 0:
        return
    g = pipe.graph
    tr.write_chrome_trace(path, events, f"{g.model}/{g.parallel}")
    png = str(Path(path).with_suffix(".png"))
    drew = tr.write_png(png, events, f"{g.model}/{g.parallel} {g.schedule}, "
                        f"bubble {measured:.1%}")
    print(f"trace: {path}" + (f" and {png}" if drew else
                              " (no .png: matplotlib is not installed)"), flush=True)
    formula = (f"(p-1)/(v*m+p-1) = {g.pipe - 1}/({g.chunks}*{g.microbatches}+{g.pipe - 1})"
               if g.chunks > 1 else
               f"(p-1)/(m+p-1) = {g.pipe - 1}/({g.microbatches}+{g.pipe - 1})")
    print(f"bubble: measured {measured:.1%} of the last step, theory {theory:.1%} "
          f"({g.schedule}, {formula})", flush=True)
