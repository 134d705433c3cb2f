"""`soapstone golden record SPEC -o FILE` and `mpiexec -n N soapstone golden check SPEC
--parallel P FILE`: pin a single-rank training run, then prove a layout reproduces it.

record trains the model on one rank (SGD with momentum by default, see shard/golden.py on why)
and writes the loss of every step and digests of every parameter after every step (plus the
full final parameters of small models) to a no-pickle .npz. check reads the run's settings
(steps, seed, optimizer, lr, precision, --dim overrides, data) from the record, trains the
layout the same way and compares step by step; exit 0, or 1 naming the first diverging step
and tensor. Bad input (spec, flags, launch, record file) exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .check_command import add_spec_options, load_plugins, parse_dims
from .errors import SpecError
from .run_command import (
    BadInput,
    add_train_options,
    check_train_flags,
    compile_layout,
    custom_layers,
    default_lr,
    report,
    single_program,
    world,
)

DEFAULT_STEPS = 5


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    rec = sub.add_parser("record", help="record a single-rank run")
    rec.add_argument("spec", metavar="SPEC", help="the .par file")
    rec.add_argument("--model", help="which model (default: the only one)")
    rec.add_argument("-o", "--output", required=True, metavar="FILE", help="the .npz to write")
    add_spec_options(rec)
    add_train_options(rec, steps=DEFAULT_STEPS, optimizer="sgd", lr=None)
    chk = sub.add_parser("check", help="check that a layout reproduces a record")
    chk.add_argument("spec", metavar="SPEC", help="the .par file")
    chk.add_argument("record", metavar="FILE", help="the .npz written by `golden record`")
    chk.add_argument("--parallel", help="the layout to check (default: one rank)")
    chk.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                     help="import a module or .py file that registers custom layers")
    chk.add_argument("--quiet", action="store_true", help="print only the verdict")


def _trainer(graph, mesh, header: dict, model):
    """The Trainer a record's header describes, for `graph` (a StageGraph of ir.Model
    `model`)."""
    from soapstone.shard.data import make_task
    from soapstone.shard.train import Trainer

    task = make_task(single_program(model, graph), header["seed"], header.get("data"))
    return Trainer(graph, mesh, task=task, seed=header["seed"], custom=custom_layers(),
                   precision=header["precision"], optimizer=header["optimizer"],
                   lr=header["lr"])


def record_run(spec_path: str, output: str, *, model: str | None = None,
               dims: dict | None = None, plugins: tuple[str, ...] = (),
               steps: int = DEFAULT_STEPS, seed: int = 0, optimizer: str = "sgd",
               lr: float | None = None, precision: str = "fp32", data: str | None = None):
    """Train `model` on one rank and write the record; returns the Record."""
    from soapstone.shard import golden
    from soapstone.shard.data import make_task

    from .spec import load

    load_plugins(list(plugins))
    spec = load(spec_path, dims=dims, filename=spec_path)
    m = spec.model(model)
    graph = compile_layout(m, None)
    program = graph.program
    lr = default_lr(optimizer) if lr is None else lr
    make_task(program, seed, data)  # bad data is bad input before any training
    header = {"spec": Path(spec_path).name, "model": m.name, "dims": dict(dims or {}),
              "steps": steps, "seed": seed, "optimizer": optimizer, "lr": lr,
              "precision": precision, "data": data}
    trainer = _trainer(graph, None, header, model=m)
    rec = golden.Recorder(header, [p.name for p in program.params])
    for metrics in trainer.run(steps):
        rec.add(metrics.loss, trainer.full_state_dict())
    record = rec.finish(trainer.full_state_dict())
    golden.save(record, output)
    return record


def check_run(spec_path: str, parallel: str | None, record_file: str, *,
              plugins: tuple[str, ...] = (), tol=None,
              on_step: Callable[[int, float, float], None] | None = None):
    """Train `parallel` (on this process's MPI world) as the record says and compare.

    Returns the first Mismatch, or None when every step matches. Bad input raises SpecError,
    BadInput or golden.GoldenError (all ranks alike)."""
    from soapstone.comm import Mesh
    from soapstone.shard import golden

    from .spec import load

    comm = world()
    record = golden.load(record_file)
    header = record.header
    load_plugins(list(plugins))
    spec = load(spec_path, dims=header.get("dims") or None, filename=spec_path)
    par = spec.parallel(parallel) if parallel else None
    if par is None and header["model"] not in spec.models:
        raise golden.GoldenError(f"{record_file}: recorded model '{header['model']}', but "
                                 f"{spec_path} defines {', '.join(spec.models) or 'none'}")
    model = spec.model(par.model if par else header["model"])
    if model.name != header["model"]:
        raise golden.GoldenError(f"{record_file}: recorded model '{header['model']}', but "
                                 f"layout '{parallel}' is for model '{model.name}'")
    graph = compile_layout(model, par)
    if comm.size != graph.world_size:
        what = f"layout '{par.name}'" if par else f"model '{model.name}' on one rank"
        raise BadInput(f"{what} needs {graph.world_size} ranks, but this run has "
                       f"{comm.size}: launch it with `mpiexec -n {graph.world_size} ...`")
    names = {p.name for s in graph.stages for p in s.program.params}
    if names != set(header["params"]):
        raise golden.GoldenError(f"{record_file}: the record's parameters differ from the "
                                 f"model's (e.g. {sorted(set(names) ^ set(header['params']))[:1]})")
    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    trainer = _trainer(graph, mesh, header, model=model)
    tol = tol or golden.Tolerance.for_record(header)
    for m in trainer.run(record.steps):
        state = trainer.full_state_dict()
        bad = golden.compare_step(record, m.step, m.loss, state, tol)
        if bad is None and m.step == record.steps - 1:
            bad = golden.compare_final(record, state, tol)
        if bad is not None:
            return bad
        if on_step:
            on_step(m.step, m.loss, float(record.loss[m.step]))
    return None


def main(args: argparse.Namespace) -> int:
    return _record(args) if args.action == "record" else _check(args)


def _record(args: argparse.Namespace) -> int:
    from soapstone.shard.data import DataError

    try:
        check_train_flags(args)
        dims = parse_dims(args.dim)
        if not Path(args.output).resolve().parent.is_dir():
            raise BadInput(f"-o {args.output}: the directory does not exist")
        comm = world()
        if comm.size != 1:
            raise BadInput(f"golden record runs on one rank; this run has {comm.size} "
                           "(drop mpiexec)")
        rec = record_run(args.spec, args.output, model=args.model, dims=dims,
                         plugins=tuple(args.plugin), steps=args.steps, seed=args.seed,
                         optimizer=args.optimizer, lr=args.lr, precision=args.precision,
                         data=args.data)
    except SpecError as e:
        print(e.format(), file=sys.stderr)
        return 2
    except (BadInput, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"recorded {rec.header['model']}: {rec.steps} steps ({rec.header['optimizer']} "
          f"lr {rec.header['lr']:g}, seed {rec.header['seed']}), loss {rec.loss[0]:.6f} -> "
          f"{rec.loss[-1]:.6f}, {len(rec.digests)} parameters -> {args.output}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from soapstone.shard.data import DataError
    from soapstone.shard.golden import GoldenError

    comm = world()
    rank = comm.rank

    def show(step: int, got: float, want: float) -> None:
        if rank == 0 and not args.quiet:
            rel = abs(got - want) / abs(want) if want else abs(got)
            print(f"step {step}: loss {got:.7f}  recorded {want:.7f}  (rel {rel:.1e})  "
                  "params ok", flush=True)

    try:
        bad = check_run(args.spec, args.parallel, args.record, plugins=tuple(args.plugin),
                        on_step=show)
    except SpecError as e:
        return report(rank, e.format())
    except (BadInput, DataError, GoldenError) as e:
        return report(rank, f"error: {e}")
    layout = args.parallel or "one rank"
    if bad is not None:
        if rank == 0:
            print(f"FAIL {layout}: {bad}", flush=True)
        return 1
    if rank == 0:
        print(f"ok: {layout} reproduces {args.record}", flush=True)
    return 0
