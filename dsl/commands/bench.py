"""`[mpiexec -n N] soapstone bench comm [--sizes S] [--ops O] [--json F]`: soapstone's
collectives vs raw mpi4py (the floor) vs torch gloo, nccl-tests style rows on rank 0: size,
time_us, algbw and busbw per implementation, and the ratios soapstone/mpi4py and
gloo/soapstone. The measuring: soapstone.comm.bench.collectives.

`[mpiexec -n 2] soapstone bench calibrate -o PROFILE.json`: this machine's matmul throughput,
memory bandwidth and collective alpha-beta as a hardware profile for `soapstone plan`
(shard/runtime/calibrate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from soapstone.comm.bench.collectives import OPS  # imports neither torch nor MPI

DEFAULT_SIZES = "8,64,512,4KiB,32KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
WATCHDOG_ITERS, WATCHDOG_ROUNDS = 2000, 20  # --watchdog: the ratio wants many short turns
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '64KiB' -> 65536, '4MiB' -> 4194304 (K/M/G are binary)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 8, 64KiB, 4MiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _op_list(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    return ops


def _json_path(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} of {text!r} does not exist; "
                                         "create it or pick another path")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench arguments to `parser`."""
    parser.add_argument("name", choices=["comm", "calibrate"],
                        help="which benchmark (comm: collectives; calibrate: this machine as "
                             "a hardware profile, with -o)")
    parser.add_argument("-o", "--output", metavar="PROFILE.json", type=_json_path,
                        help="calibrate: the profile file to write")
    parser.add_argument("--sizes", type=_size_list, default=_size_list(DEFAULT_SIZES),
                        help=f"comma-separated byte sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--ops", type=_op_list, default=list(OPS),
                        help=f"comma-separated ops (default {','.join(OPS)})")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations per op/size/impl (capped for big sizes; default "
                             f"100, {WATCHDOG_ITERS} with --watchdog)")
    parser.add_argument("--json", metavar="FILE", type=_json_path,
                        help="also write the rows as a JSON array")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    parser.add_argument("--backend", choices=("mpi", "nccl"), default="mpi",
                        help="comm: mpi (CPU buffers; vs mpi4py and gloo) or nccl (CUDA buffers, "
                             "one GPU per rank; vs torch.distributed's NCCL)")
    parser.add_argument("--alloc", action="store_true",
                        help="time soapstone's allgather/reduce_scatter/alltoall without out= "
                             "(a new output per call) instead of into a preallocated buffer")
    parser.add_argument("--watchdog", action="store_true",
                        help="the watchdog's cost: also time soapstone with its ops not recorded "
                             "(column no-recorder, which the watchdog watches from stack samples "
                             "at no per-op cost; ratio rec/none), the implementations interleaved "
                             f"in {WATCHDOG_ROUNDS} rounds; gloo is left out")


def _fmt_row(op, nbytes, cells, ratios):
    text = f"{op:>14} {nbytes:>11}"
    for cell in cells:
        text += " |" + ("      n/a " * 3 if cell is None else
                        f"{cell['time_us']:>10.1f}{cell['algbw_GBps']:>9.3f}"
                        f"{cell['busbw_GBps']:>9.3f}")
    return text + " | " + "  ".join(f"{r:>8}" for r in ratios)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; rank 0 prints the table. Returns 0."""
    if args.name == "calibrate":
        return _calibrate(args)
    if args.backend == "nccl":
        return _nccl(args)
    from mpi4py import MPI

    from soapstone.comm import init
    from soapstone.comm.bench.collectives import init_gloo, measure
    from soapstone.comm.errors import UserError
    from soapstone.dsl.commands import fail
    from soapstone.shard.plan.units import format_bytes

    try:
        world = init("mpi")
    except UserError as e:  # a bad SOAPSTONE_* setting
        return fail(e, MPI.COMM_WORLD.Get_rank())
    mpi = MPI.COMM_WORLD
    dist = None if args.no_gloo or args.watchdog else init_gloo(mpi)
    iters = args.iters or (WATCHDOG_ITERS if args.watchdog else 100)
    bare = None
    if args.watchdog:  # the same ranks and MPI communicator, nothing recorded per op
        bare = type(world)(mpi)
        bare.flight.keep(0)
    names = ["soapstone"] + ([] if bare is None else ["no-recorder"]) + ["mpi4py"]
    names += [] if dist is None else ["gloo"]
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"# soapstone bench comm: {world.size} ranks, fp32, median of up to {iters} "
        "iterations (slowest rank); time_us, algbw/busbw in GB/s; soapstone "
        + ("allocates each output" if args.alloc else "writes into a preallocated out="))
    head = f"{'op':>14} {'bytes':>11}" + "".join(
        f" | {name + ' us':>10}{'algbw':>9}{'busbw':>9}" for name in names)
    say(head + " | soap/mpi  gloo/soap" + ("  rec/none" if bare is not None else ""))
    rows, cost = [], []
    for op, nbytes, cells in measure(world, mpi, dist, args.ops, args.sizes, iters,
                                     args.alloc, bare, WATCHDOG_ROUNDS if bare is not None else 1):
        rows.extend(c for c in cells if c is not None)
        cell = dict(zip(names, cells, strict=True))
        soap, raw, gloo = cell["soapstone"], cell["mpi4py"], cell.get("gloo")
        ratios = [f"{soap['time_us'] / raw['time_us']:.3f}"]
        ratios.append("n/a" if gloo is None else f"{gloo['time_us'] / soap['time_us']:.2f}")
        if bare is not None:
            none_us = cell["no-recorder"]["time_us"]
            ratios.append(f"{soap['time_us'] / none_us:.3f}")
            cost.append(f"#   {op} {format_bytes(nbytes)}: {soap['time_us'] / none_us:.3f}x "
                        f"({soap['time_us'] - none_us:+.2f} us per call)")
        say(_fmt_row(op, nbytes, cells, ratios), flush=True)
    if cost:
        from soapstone.comm.communicator import TENSOR_READING

        say("# the watchdog's cost: soapstone recorded / unrecorded, same communicator "
            "(rec/none; the bar is under 1.02x)", *cost,
            f"# the recorder reads shapes through {TENSOR_READING}", sep="\n")
    if args.json and world.rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if dist is not None:
        dist.destroy_process_group()
    return 0


def _nccl(args: argparse.Namespace) -> int:
    """--backend nccl: soapstone's NCCL communicator vs torch.distributed's NCCL on CUDA
    buffers (soapstone.comm.bench.nccl); no usable GPU is bad input (exit 2) on every rank."""
    import torch
    from mpi4py import MPI

    from soapstone.comm import init
    from soapstone.comm.bench.nccl import IMPLS, init_torch_nccl, measure
    from soapstone.comm.errors import UserError
    from soapstone.comm.launch.device import pick
    from soapstone.dsl.commands import fail

    try:
        device = pick("cuda", flag="bench comm --backend nccl", instead="--backend mpi")
        world = init("nccl")
    except UserError as e:
        return fail(e, MPI.COMM_WORLD.Get_rank())
    mpi = MPI.COMM_WORLD
    dist = init_torch_nccl(mpi, device)
    iters = args.iters or 100
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"# soapstone bench comm --backend nccl: {world.size} ranks on "
        f"{torch.cuda.get_device_name(device)}, fp32, {iters} calls enqueued "
        "then one synchronise (slowest rank); time_us, algbw/busbw in GB/s")
    say(f"{'op':>14} {'bytes':>11}" + "".join(
        f" | {name + ' us':>10}{'algbw':>9}{'busbw':>9}" for name in IMPLS) + " | torch/soap")
    rows = []
    for op, nbytes, cells in measure(world, mpi, dist, device, args.ops, args.sizes, iters):
        rows.extend(c for c in cells if c is not None)
        soap, ref = cells
        say(_fmt_row(op, nbytes, cells, [f"{ref['time_us'] / soap['time_us']:.3f}"]),
            flush=True)
    if args.json and world.rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Measure, print and (rank 0) write the profile."""
    from soapstone.comm import init
    from soapstone.comm.errors import UserError
    from soapstone.dsl.commands import fail
    from soapstone.dsl.lang.errors import BadInput
    from soapstone.shard.plan.analysis.hardware import save_profile
    from soapstone.shard.runtime.calibrate import PROBE_SPEC, calibrate

    world = init("mpi")
    if not args.output:
        return fail(BadInput("bench calibrate needs -o PROFILE.json"), world.rank)
    try:
        from soapstone.dsl.compile.stages import lower_graph
        from soapstone.dsl.lang.spec import load

        probe = lower_graph(load(PROBE_SPEC).model(), None)
        profile = calibrate(world, probe)
    except UserError as e:
        return fail(e, world.rank)
    if world.rank == 0:
        save_profile(profile, args.output)
        print(json.dumps(profile.to_data(), indent=1))
        print(f"wrote {args.output}: soapstone plan SPEC --world N --profile {args.output}")
    return 0
