"""`[mpiexec -n N] soapstone run SPEC [--parallel P] [--steps K] ...`: train a spec's model.

Every rank parses the spec, lowers the chosen layout and checks the launch (N must equal the
layout's world size) on its own; all ranks reach the same verdict, so a bad input makes every
rank exit 2 at once (rank 0 prints the error) instead of leaving some waiting in a collective.
Errors during training are not caught here: one rank's exception aborts the whole job
(soapstone.comm's failure handler), since the other ranks would wait for it forever. The
exception: a checkpoint's load or save that fails (a damaged byte, a full disk) raises the same
CheckpointError on every rank at once (shard/checkpoint/agree.py), so all exit 2 together.
Rank 0 draws the progress bar and writes --metrics; other ranks print only when failing.
Rank 0's outputs (--metrics, --trace, --tensorboard) are checked on rank 0 before launch and
opened before the first step, its verdict shared with every rank (dsl/app/outputs.py): a
path that cannot be written, or names an input, ends every rank with exit 2 at once.
A NaN or infinite loss or gradient norm never updates (shard/train/nonfinite.py): the run
stops with one message on rank 0 and exit 3 on every rank (EXIT_NONFINITE), or under
--on-nonfinite skip drops that step's update and goes on (--max-skips in a row at most).
Every comm op runs under the watchdog's deadline (--collective-timeout, default
SOAPSTONE_COLLECTIVE_TIMEOUT or 600 s; a timeout ends the job with a report naming the op and
the ranks that did not arrive), dumps go to --debug-dir (`soapstone debug hang DIR` reads them),
and SIGTERM/SIGINT to mpiexec end every rank promptly with one line
(soapstone.comm.observe.watchdog).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import (
    build_program,
    check_memory,
    check_trace_flag,
    check_train_flags,
    custom_layers,
    default_lr,
    lr_schedule,
    pick_device,
    single_program,
    world,
)
from soapstone.dsl.app.outputs import (
    cannot_write,
    check_dir,
    check_file,
    rank0_verdict,
    same_file,
    spec_inputs,
)
from soapstone.dsl.app.run_checkpoints import after_step, begin, checkpoint_plan
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import (
    add_checkpoint_options,
    add_device_options,
    add_model_options,
    add_nonfinite_options,
    add_schedule_options,
    add_train_options,
)
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """The model and training options, --metrics, --quiet and --trace."""
    add_model_options(parser)
    add_train_options(parser, steps=100, optimizer="adamw", lr=None)
    add_schedule_options(parser)
    add_nonfinite_options(parser)
    add_checkpoint_options(parser)
    add_device_options(parser)
    parser.add_argument("--metrics", metavar="F.jsonl",
                        help="write one JSON line per step and per evaluation (rank 0)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write TensorBoard event files to DIR (rank 0; needs "
                             "tensorboardX: pip install 'soapstone[tensorboard]')")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--profile", metavar="NAME|FILE",
                        help="the device's hardware profile (a preset or a file), whose peak "
                             "in --precision gives the MFU (default: read off the GPU's name; "
                             "on a CPU, no MFU)")
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
    from soapstone.comm.observe.watchdog import WatchdogError, check_timeout

    try:
        return check_timeout(text, "--collective-timeout")
    except WatchdogError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    """Check the flags and the launch on every rank, then train."""
    from soapstone.dsl.compile.layout_proof import prove_layout
    from soapstone.shard.data.source import make_task
    from soapstone.shard.runtime.p2p_mode import check_device

    try:
        # --device before any NCCL call (every rank reaches the same verdict); a bad
        # SOAPSTONE_* watchdog setting is bad input too
        comm = world(pick_device(args.device, args.comm), args.comm)
        watch(args)
    except UserError as e:
        from soapstone.comm.launch.failure import world_rank

        return fail(e, world_rank())
    try:
        check_train_flags(args)
        model, par, program = build_program(args, comm.size)
        nodes = launch_nodes(par, comm.size)  # collective; every rank gets the same verdict
        check_device(program, comm.device)
        ckpt = checkpoint_plan(args, program, model)  # before the task: --resume sets the seed
        if getattr(args, "trace", None):
            check_trace_flag(args.trace, par)
        prove_layout(model, program, args.optimizer)  # every rank's calls match, statically
        check_memory(model, program, comm, args.optimizer, args.spec, args.precision)
        if args.precision == "float8":  # _scaled_mm's widths, before anything runs
            from soapstone.shard.runtime.float8 import check_graph

            check_graph(program)
        schedule = lr_schedule(args, args.lr if args.lr is not None else default_lr(args.optimizer))
        check_tensorboard(args.tensorboard)
        rank0_verdict(comm, lambda: check_outputs(args))  # rank 0 writes them: its verdict
        task = make_task(single_program(model, program), args.seed, args.data, args.val_data,
                         args.data_dtype)
        speed = throughput(args, model, comm.device)
    except UserError as e:
        return fail(e, comm.rank)
    if comm.rank == 0 and nodes:
        for line in nodes:
            print(line, file=sys.stderr, flush=True)
    from soapstone.shard.train.nonfinite import EXIT_NONFINITE, NonFinite

    try:
        return train(args, comm, par, program, task, schedule, ckpt, speed)
    except NonFinite as e:  # raised on every rank alike; nothing of that step was applied
        if comm.rank == 0:
            print(e.format(), file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except UserError as e:  # rank 0's write failed mid-run (a full disk)
        if comm.size > 1:  # the others wait in a collective: the failure handler ends the job
            raise
        return fail(e)


def check_outputs(args) -> None:
    """The files rank 0 writes (--metrics, --trace and its image) and --tensorboard's
    directory: writable, none the same as another or as an input of the run (BadInput)."""
    inputs = spec_inputs(args) + [(flag, value) for flag, value in (
        ("--data", args.data), ("--val-data", args.val_data), ("--init", args.init),
        ("--resume", args.resume), ("--profile", args.profile)) if value]
    trace = getattr(args, "trace", None)
    if trace and Path(trace).suffix.lower() == ".png":  # the image would overwrite the JSON
        raise BadInput(f"--trace {trace}: the trace is chrome://tracing JSON and its image is "
                       f"written beside it as .png; give --trace "
                       f"{Path(trace).with_suffix('.json')}")
    files = [(flag, path, example) for flag, path, example in (
        ("--metrics", args.metrics, "metrics.jsonl"), ("--trace", trace, "trace.json"),
        ("--trace's image", trace and str(Path(trace).with_suffix(".png")), "trace.png"))
        if path]
    for i, (flag, path, example) in enumerate(files):
        for other, written, _ in files[:i]:
            if same_file(path, written):
                raise BadInput(f"{flag} {path}: the same file as {other} {written}; give each "
                               "its own path")
        check_file(path, flag, example, inputs)
    if args.tensorboard:
        check_dir(args.tensorboard, "--tensorboard")


def open_outputs(args) -> tuple:
    """(the --metrics file, the TensorBoard writer), each None without its flag (rank 0);
    BadInput naming the path that cannot be written."""
    metrics = board = None
    try:
        if args.metrics:
            metrics = open(args.metrics, "w")  # noqa: SIM115 - train() closes it
    except OSError as e:
        raise cannot_write("--metrics", args.metrics, e) from None
    try:
        if args.tensorboard:
            board = tensorboard_writer(args.tensorboard)
    except OSError as e:
        if metrics is not None:
            metrics.close()
        raise cannot_write("--tensorboard", args.tensorboard, e) from None
    return metrics, board


def launch_nodes(par, world: int) -> list[str]:
    """The launch's nodes checked (NodeError: unequal nodes) and, over more than one node,
    the lines saying which mesh axes cross nodes (and a warning for a tensor-parallel one)."""
    from soapstone.comm.launch.nodes import check_nodes, node_map, ranks_per_node_override
    from soapstone.shard.plan.analysis.placement import format_placement, place, tp_warnings

    node_of = node_map() if world > 1 else [0]
    check_nodes(node_of)
    count = len(set(node_of))
    if count == 1 or par is None:
        return []
    per_node = world // count
    override = ranks_per_node_override()
    where = ("simulated: SOAPSTONE_RANKS_PER_NODE" if override is not None
             else "ranks sharing memory")
    placed = place(par.mesh, node_of)
    return [format_placement(placed, per_node, f"{count} nodes, {where}"),
            *(f"warning: {w}" for w in tp_warnings(par, placed, per_node))]


def throughput(args, model, device):
    """(model FLOPs of a step, Peak or None) for the MFU (dsl/app/throughput.py): the FLOPs of
    the model's single-rank Program (whole batch, whole model), whatever the layout."""
    from soapstone.dsl.app.throughput import find_peak, step_flops
    from soapstone.dsl.compile.lower import lower

    gpu = None
    if device.type == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(device)
    return (step_flops(lower(model, None), args.accumulate),
            find_peak(args.profile, args.precision, gpu))


def watch(args) -> None:
    """The watchdog as the flags say; SIGTERM/SIGINT end every rank promptly."""
    from soapstone.comm.observe import watchdog

    watchdog.configure(timeout=args.collective_timeout, trace_dir=args.debug_dir)
    dog = watchdog.get()
    if dog is not None:
        dog.exit_on_signals("soapstone run")


def check_tensorboard(logdir: str | None) -> None:
    """--tensorboard needs tensorboardX (found, not imported: a run without the flag never
    loads it) and a directory it can create."""
    import importlib.util

    if not logdir:
        return
    if importlib.util.find_spec("tensorboardX") is None:
        raise BadInput(f"--tensorboard {logdir}: needs the tensorboardX package; "
                      "pip install 'soapstone[tensorboard]'")
    if Path(logdir).exists() and not Path(logdir).is_dir():
        raise BadInput(f"--tensorboard {logdir}: exists and is not a directory")


def train(args, comm, par, program, task, schedule=None, ckpt=None, speed=None) -> int:
    """Train `program` (a StageGraph) on `comm` as the flags say; rank 0 reports. `speed`:
    (model FLOPs of a step, Peak or None) for TFLOP/s and MFU."""
    from soapstone.comm import Mesh
    from soapstone.comm.observe import expected
    from soapstone.dsl.compile.layout_proof import expected_calls
    from soapstone.shard.train.nonfinite import DEFAULT_MAX_SKIPS, OnNonFinite
    from soapstone.shard.train.trainer import Trainer

    rank = comm.rank
    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and program.world_size > 1 else None
    lr = args.lr if args.lr is not None else default_lr(args.optimizer)
    trace = getattr(args, "trace", None)
    trainer = Trainer(program, mesh, task=task, seed=args.seed, custom=custom_layers(),
                      precision=args.precision, optimizer=args.optimizer, lr=lr,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      trace=bool(trace), schedule=schedule, accumulate=args.accumulate,
                      device=comm.device, flops_per_step=speed[0] if speed else None,
                      peak_flops=speed[1].flops if speed and speed[1] else None,
                      on_nonfinite=OnNonFinite(args.on_nonfinite),
                      max_skips=DEFAULT_MAX_SKIPS if args.max_skips is None else args.max_skips,
                      # weights that --init or --resume overwrite are not drawn first
                      draw=ckpt is None or not (ckpt.init or ckpt.resume))
    layout = f" / {par.name}" if par is not None else ""
    if rank == 0:
        print(f"soapstone run: {program.model}{layout} on {comm.size} rank"
              f"{'s' if comm.size > 1 else ''} ({comm.device.type}), {args.steps} steps, "
              f"{args.optimizer} lr {lr:g}, "
              f"{'data ' + args.data if args.data else 'synthetic task'}, seed {args.seed}",
              file=sys.stderr, flush=True)
        if speed:
            peak = (f"peak {speed[1].flops / 1e12:g} TFLOP/s {args.precision} per device "
                    f"({speed[1].source})" if speed[1] else
                    "no peak known, so no MFU (--profile NAME|FILE gives one)")
            print(f"model FLOPs: {speed[0] / 1e12:.4g} TFLOP per step; {peak}",
                  file=sys.stderr, flush=True)
    try:  # a damaged checkpoint or a full disk: every rank raises the same error together
        start = begin(trainer, ckpt, args, rank) if ckpt is not None else 0
        # rank 0's files, opened before the first step; a failure ends every rank (collective)
        metrics, board = rank0_verdict(comm, lambda: open_outputs(args)) or (None, None)
    except UserError as e:
        return fail(e, rank)
    if rank == 0 and par is not None and par.offload and comm.device.type != "cuda":
        from soapstone.shard.parallel.offload_plan import CPU_RUN_NOTE

        print(f"note: {CPU_RUN_NOTE}", file=sys.stderr, flush=True)
    if mesh is not None and args.accumulate == 1:  # the plan is one step of the layout
        from soapstone.shard.plan.analysis.precision import graph_as_run

        # the calls as this precision makes them (bf16 activations, fp32 gradient reduction),
        # so a hang report does not flag every bf16 call as differing from the plan
        expected.expect(expected_calls(graph_as_run(program, args.precision), comm.rank))
    stopped = None
    bar = progress_bar(args.steps - start) if rank == 0 and not args.quiet else None
    first = last = None
    total_t = total_tok = 0.0
    every = args.eval_every
    try:
        for m in trainer.run(args.steps - start, start):
            first = m if first is None else first
            last = m
            total_t += m.step_time_s
            total_tok += m.tokens_per_s * m.step_time_s
            rows = [m]
            if every and ((m.step + 1) % every == 0 or m.step + 1 == args.steps):
                e = trainer.evaluate(args.eval_steps, m.step)  # collective: every rank
                if e.stopped:  # a partial loss is no eval loss: say so, log nothing
                    if rank == 0:
                        say(bar, f"step {m.step + 1}: evaluation stopped by "
                                 f"{signal.Signals(e.stopped).name} after {e.batches} of "
                                 f"{args.eval_steps} held-out batches")
                else:
                    rows.append(e)
                    if rank == 0:
                        ppl = (f", perplexity {e.perplexity:.3f}" if e.perplexity is not None
                               else "")
                        say(bar, f"step {m.step + 1}: eval loss {e.loss:.4f}{ppl} "
                                 f"({e.batches} held-out batches)")
            for row in rows:
                if metrics:
                    try:
                        metrics.write(json.dumps(row.to_json()) + "\n")
                        metrics.flush()
                    except OSError as e:
                        raise cannot_write("--metrics", args.metrics, e) from None
                if board:
                    log_scalars(board, row)
            if m.skipped and rank == 0:
                say(bar, f"step {m.step + 1}: loss {m.loss}, gradient norm {m.grad_norm}: "
                         f"update skipped ({trainer.skips_in_a_row} in a row, "
                         f"{m.skipped_steps} in all; --on-nonfinite skip)")
            if bar:
                bar.set_postfix_str(f"loss {m.loss:.4f}, {m.tokens_per_s:,.0f} tok/s, "
                                    f"{rate(m)}lr {m.lr:.3g}"
                                    + (f", skipped {m.skipped_steps}" if m.skipped_steps
                                       else ""), refresh=False)
                bar.update(1)
            try:
                stopped = after_step(trainer, ckpt, args, m.step, rank) if ckpt else None
            except UserError as e:
                return fail(e, rank)
            expected.step_began()  # evaluation and checkpoints are not in the plan's step
            if stopped:
                break
    finally:
        if metrics:
            # every line is flushed as written: a close that fails follows a failed write,
            # already reported
            with contextlib.suppress(OSError):
                metrics.close()
        if bar:
            bar.close()
        if board:
            board.close()
    if rank == 0:
        flops = (speed[0] * (last.step + 1 - start) / comm.size / total_t
                 if speed and total_t else None)
        mfu = (f", MFU {flops / speed[1].flops:.1%}" if flops is not None and speed[1]
               else "")
        per_dev = f", {flops / 1e12:.3g} TFLOP/s per device{mfu}" if flops is not None else ""
        print(f"done: {last.step + 1} steps, loss {first.loss:.4f} -> {last.loss:.4f}, "
              f"{total_tok / total_t if total_t else 0:,.0f} tokens/s{per_dev}"
              + (f", {trainer.skipped} non-finite steps skipped" if trainer.skipped else ""),
              flush=True)
    if trace:
        try:  # rank 0 writes, after the last collective: the others have finished
            write_trace(trainer.executor, trace, rank)
        except UserError as e:
            return fail(e, rank)
    return 128 + stopped if stopped else 0


def rate(m) -> str:
    """The progress line's `T TFLOP/s/dev, MFU x%, ` (empty without FLOPs)."""
    if m.tflops_per_device is None:
        return ""
    mfu = f"MFU {m.mfu:.1%}, " if m.mfu is not None else ""
    return f"{m.tflops_per_device:.3g} TFLOP/s/dev, {mfu}"


def write_trace(pipe, path: str, rank: int) -> None:
    """The last step's timeline: Chrome trace JSON (+ .png) and the bubble (collective)."""
    from soapstone.shard.runtime import trace as tr

    events = pipe.events()
    measured, theory = tr.bubble(events, pipe.graph.pipe), pipe.schedule.theory_bubble()
    if rank != 0:
        return
    g = pipe.graph
    png = str(Path(path).with_suffix(".png"))
    try:
        tr.write_chrome_trace(path, events, f"{g.model}/{g.parallel}")
        drew = tr.write_png(png, events, f"{g.model}/{g.parallel} {g.schedule}, "
                            f"bubble {measured:.1%}")
    except OSError as e:
        raise cannot_write("--trace", str(e.filename or path), e) from None
    print(f"trace: {path}" + (f" and {png}" if drew else
                              " (no .png: matplotlib is not installed)"), flush=True)
    formula = (f"(p-1)/(v*m+p-1) = {g.pipe - 1}/({g.chunks}*{g.microbatches}+{g.pipe - 1})"
               if g.chunks > 1 else
               f"(p-1)/(m+p-1) = {g.pipe - 1}/({g.microbatches}+{g.pipe - 1})")
    if pipe.schedule.split:  # zb1p (shard/plan/schedules/ derives it)
        formula = (f"(p-1)/(3m+p-1) = {g.pipe - 1}/(3*{g.microbatches}+{g.pipe - 1})"
                   if g.microbatches >= g.pipe else "1-3m/(2m+2p-1)")
    if pipe.schedule.spec.stages_per_rank > 1:  # a V (zbv, dualpipev): its own closed form
        formula = pipe.schedule.spec.formula(g.pipe, g.microbatches, g.chunks)
    print(f"bubble: measured {measured:.1%} of the last step, theory {theory:.1%} "
          f"({g.schedule}, {formula})", flush=True)


def progress_bar(total: int, stream=None):
    """tqdm on stderr (rank 0): steps, ETA, and the loss, tokens/s and lr of the last step.
    On a terminal it is redrawn in place; on a pipe (a log file) it is a whole line every
    tenth of the run, never a carriage return."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    if stream.isatty():
        bar = tqdm(total=total, unit="step", file=stream, dynamic_ncols=True)
    else:  # delay: no 0/N line before the first step
        bar = tqdm(total=total, unit="step", file=LinePipe(stream), ascii=True, ncols=110,
                   miniters=max(1, total // 10), mininterval=0, maxinterval=float("inf"),
                   delay=1e-9)
    bar.on_pipe = not stream.isatty()
    return bar


class LinePipe:
    """tqdm's output as lines: each redraw of a new step count becomes one line (close()
    redraws the last count: skipped)."""

    def __init__(self, stream):
        self.stream, self.last = stream, None

    def write(self, text: str) -> None:
        """One redraw: the text between carriage returns, as a line."""
        line = text.replace("\r", "").strip()
        count = re.search(r"\d+/\d+", line)
        key = count.group() if count else line
        if line and key != self.last:
            self.stream.write(line + "\n")
            self.last = key

    def flush(self) -> None:
        """Flush the underlying stream."""
        self.stream.flush()


def say(bar, text: str) -> None:
    """A line on stdout that does not tear a terminal's progress bar."""
    if bar is not None and not bar.on_pipe:
        bar.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


def tensorboard_writer(logdir: str):
    """A TensorBoard event-file writer (tensorboardX, imported only for --tensorboard)."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir=logdir)


def log_scalars(board, row) -> None:
    """A step's (train/...) or an evaluation's (eval/...) figures as TensorBoard scalars,
    at the step they follow (1-based, as printed)."""
    step = row.step + 1
    for key, value in row.to_json().items():
        if key == "step" or value is None or not isinstance(value, float | int) \
                or not math.isfinite(value):
            continue
        tag = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        board.add_scalar(tag, value, step)
