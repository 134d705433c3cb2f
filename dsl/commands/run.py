"""`[mpiexec -n N] soapstone run SPEC [--parallel P] [--steps K] ...`: train a spec's model.

Every rank parses the spec, lowers the chosen layout and checks the launch (N must equal the
layout's world size) on its own; all ranks reach the same verdict, so a bad input makes every
rank exit 2 at once (rank 0 prints the error) instead of leaving some waiting in a collective.
Errors during training are not caught here: one rank's exception aborts the whole job
(soapstone.comm's failure handler), since the other ranks would wait for it forever.
Rank 0 draws the progress bar and writes --metrics; other ranks print only when failing.
Every comm op runs under the watchdog's deadline (--collective-timeout, default
SOAPSTONE_COLLECTIVE_TIMEOUT or 600 s; a timeout ends the job with a report naming the op and
the ranks that did not arrive), dumps go to --debug-dir (`soapstone debug hang DIR` reads them),
and SIGTERM/SIGINT to mpiexec end every rank promptly with one line (soapstone.comm.watchdog).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from soapstone.comm.errors import UserError

from ..build import (
    build_program,
    check_memory,
    check_trace_flag,
    check_train_flags,
    custom_layers,
    default_lr,
    single_program,
    world,
)
from . import fail
from .flags import add_model_options, add_train_options


def configure(parser: argparse.ArgumentParser) -> None:
    """The model and training options, --metrics, --quiet and --trace."""
    add_model_options(parser)
    add_train_options(parser, steps=100, optimizer="adamw", lr=None)
    parser.add_argument("--metrics", metavar="F.jsonl",
                        help="write one JSON line per step (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--trace", metavar="FILE",
                        help="pipeline layouts: write the last step's timeline as a Chrome "
                             "trace (and FILE with .png if matplotlib is installed) and print "
                             "the measured bubble next to the schedule's theoretical one")
    parser.add_argument("--collective-timeout", type=_seconds, metavar="S",
                        help="end the job with a report when a rank waits longer than S seconds "
                             "in one collective or p2p op (default: SOAPSTONE_COLLECTIVE_TIMEOUT "
                             "or 600; 0: no deadline)")
    parser.add_argument("--debug-dir", metavar="DIR",
                        help="where every rank writes its flight-recorder dump on a timeout, a "
                             "failure or SIGUSR1 (default: SOAPSTONE_TRACE_DIR; read them with "
                             "`soapstone debug hang DIR`)")


def _seconds(text: str) -> float:
    from soapstone.comm.watchdog import WatchdogError, check_timeout

    try:
        return check_timeout(text, "--collective-timeout")
    except WatchdogError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    """Check the flags and the launch on every rank, then train."""
    from soapstone.shard.data import make_task

    try:
        comm = world()  # a bad SOAPSTONE_* watchdog setting is bad input too
        watch(args)
    except UserError as e:
        from soapstone.comm.failure import world_rank

        return fail(e, world_rank())
    try:
        check_train_flags(args)
        model, par, program = build_program(args, comm.size)
        if getattr(args, "trace", None):
            check_trace_flag(args.trace, par)
        check_memory(model, program, comm, args.optimizer, args.spec)
        task = make_task(single_program(model, program), args.seed, args.data)
    except UserError as e:
        return fail(e, comm.rank)
    return train(args, comm, par, program, task)


def watch(args) -> None:
    """The watchdog as the flags say; SIGTERM/SIGINT end every rank promptly."""
    from soapstone.comm import watchdog

    watchdog.configure(timeout=args.collective_timeout, trace_dir=args.debug_dir)
    dog = watchdog.get()
    if dog is not None:
        dog.exit_on_signals("soapstone run")


def train(args, comm, par, program, task) -> int:
    """Train `program` (a StageGraph) on `comm` as the flags say; rank 0 reports."""
    from soapstone.comm import Mesh
    from soapstone.shard.train import Trainer

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


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal; on a pipe, a line
    every tenth of the run) showing the step, loss and tokens/s."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()

    def update(self, m) -> None:
        """Show step `m`, a StepMetrics (on a pipe: every tenth of the run and the last)."""
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
