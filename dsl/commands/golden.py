"""`soapstone golden record SPEC -o FILE` and `mpiexec -n N soapstone golden check SPEC
--parallel P FILE`: pin a single-rank training run, then prove a layout reproduces it.

record trains the model on one rank (SGD with momentum by default, see shard/train/golden.py on why)
and writes the loss of every step and digests of every parameter after every step (plus the
full final parameters of small models) to a no-pickle .npz. check reads the run's settings
(steps, seed, optimizer, lr, precision, --dim overrides, data) from the record, trains the
layout the same way and compares step by step; exit 0, or 1 naming the first diverging step
and tensor. Bad input (spec, flags, launch, record file) exits 2. The library:
dsl/app/golden_run.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import check_train_flags, parse_dims, pick_device, world
from soapstone.dsl.app.golden_run import DEFAULT_STEPS
from soapstone.dsl.app.outputs import cannot_write, check_file, spec_inputs, writes_to
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import (
    add_device_options,
    add_plugin_option,
    add_spec_options,
    add_train_options,
)
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """The `record` and `check` actions and their flags."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    rec = sub.add_parser("record", help="record a single-rank run")
    rec.add_argument("spec", metavar="SPEC", help="the .par file")
    rec.add_argument("--model", help="which model (default: the only one)")
    rec.add_argument("--parallel", help="a one-rank layout to record instead of the plain "
                     "model (e.g. gradient accumulation over microbatches)")
    rec.add_argument("-o", "--output", required=True, metavar="FILE", help="the .npz to write")
    add_spec_options(rec)
    add_train_options(rec, steps=DEFAULT_STEPS, optimizer="sgd", lr=None)
    add_device_options(rec)
    chk = sub.add_parser("check", help="check that a layout reproduces a record")
    chk.add_argument("spec", metavar="SPEC", help="the .par file")
    chk.add_argument("record", metavar="FILE", help="the .npz written by `golden record`")
    chk.add_argument("--parallel", help="the layout to check (default: one rank)")
    add_plugin_option(chk)
    add_device_options(chk)
    chk.add_argument("--quiet", action="store_true", help="print only the verdict")


def main(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    return _record(args) if args.action == "record" else _check(args)


def _record(args: argparse.Namespace) -> int:
    from soapstone.dsl.app.golden_run import record_run
    from soapstone.shard.train.nonfinite import EXIT_NONFINITE, NonFinite

    try:
        check_train_flags(args)
        dims = parse_dims(args.dim)
        if not Path(args.output).resolve().parent.is_dir():
            raise BadInput(f"-o {args.output}: the directory does not exist")
        check_file(args.output, "-o", "record.npz",
                   spec_inputs(args) + [("--data", args.data)])
        comm = world(pick_device(args.device, args.comm), args.comm)
        if comm.size != 1:
            raise BadInput(f"golden record runs on one rank; this run has {comm.size} "
                           "(drop mpiexec)")
        rec = record_run(args.spec, args.output, model=args.model, dims=dims,
                         plugins=tuple(args.plugin), steps=args.steps, seed=args.seed,
                         optimizer=args.optimizer, lr=args.lr, precision=args.precision,
                         data=args.data, parallel=args.parallel, device=args.device,
                         comm=args.comm)
    except UserError as e:
        from soapstone.comm.launch.supervisor import launched_rank

        # under mpiexec every rank finds the same error, some before MPI starts: the
        # launcher's rank says which one prints it
        return fail(e, launched_rank() or 0)
    except OSError as e:
        if not writes_to(e, args.output):  # not the record's write: not a path's fault
            raise
        return fail(cannot_write("-o", args.output, e))
    except NonFinite as e:  # nothing worth recording
        print(e.format(), file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    print(f"recorded {rec.header['model']}: {rec.steps} steps ({rec.header['optimizer']} "
          f"lr {rec.header['lr']:g}, seed {rec.header['seed']}), loss {rec.loss[0]:.6f} -> "
          f"{rec.loss[-1]:.6f}, {len(rec.digests)} parameters -> {args.output}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from soapstone.dsl.app.golden_run import prepare_check

    try:
        comm = world(pick_device(args.device, args.comm), args.comm)
    except UserError as e:
        from soapstone.comm.launch.failure import world_rank

        return fail(e, world_rank())
    rank = comm.rank

    def show(step: int, got: float, want: float) -> None:
        if rank == 0 and not args.quiet:
            rel = abs(got - want) / abs(want) if want else abs(got)
            print(f"step {step}: loss {got:.7f}  recorded {want:.7f}  (rel {rel:.1e})  "
                  "params ok", flush=True)

    try:
        job = prepare_check(args.spec, args.parallel, args.record, plugins=tuple(args.plugin),
                            device=args.device, comm=args.comm)
    except UserError as e:
        return fail(e, rank)
    from soapstone.shard.train.nonfinite import NonFinite

    # not inside the try: an error while training is on one rank, not all; it aborts the job
    try:
        bad = job.run(on_step=show)
    except NonFinite as e:  # on every rank alike: the layout does not reproduce the record
        bad = e.message()
    layout = args.parallel or "one rank"
    if bad is not None:
        if rank == 0:
            print(f"FAIL {layout}: {bad}", flush=True)
        return 1
    if rank == 0:
        print(f"ok: {layout} reproduces {args.record}", flush=True)
    return 0
