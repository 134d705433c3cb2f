"""The command-line flags several commands share (argparse only; what they mean:
dsl/app/build.py)."""

from __future__ import annotations

import argparse

from soapstone.comm.dtype_table import COMMAND_PRECISIONS


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """--dim and --plugin."""
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="override a dim size (repeatable)")
    add_plugin_option(parser)


def add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """--plugin (repeatable)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                        help="import a module or .py file that registers custom layers")


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
    parser.add_argument("--precision", choices=COMMAND_PRECISIONS, default="fp32",
                        help="parameter and activation dtype (default fp32); float8: the weight "
                             "matmuls in float8 with dynamic scales, bf16 around them")
    parser.add_argument("--data", metavar="FILE",
                        help="token data: a .npy of integer ids, or any file read as bytes "
                             "(default: the built-in synthetic task)")


def add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """--warmup, --lr-schedule, --min-lr, --accumulate, --eval-every, --eval-steps,
    --val-data, --data-dtype: how `run` trains and evaluates as people run it."""
    parser.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"),
                        default="constant", help="decay after the warmup (default constant)")
    parser.add_argument("--warmup", type=int, default=0, metavar="N",
                        help="linear warmup over the first N steps (default 0)")
    parser.add_argument("--min-lr", type=float, default=None, metavar="LR",
                        help="the floor cosine/linear decay ends at (default lr/10)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="gradient accumulation: K batches per optimizer step, beyond the "
                             "layout's own microbatches (default 1)")
    parser.add_argument("--eval-every", type=int, default=0, metavar="K",
                        help="evaluate on held-out batches every K steps and after the last "
                             "(default 0: never)")
    parser.add_argument("--eval-steps", type=int, default=10, metavar="E",
                        help="held-out batches per evaluation (default 10)")
    parser.add_argument("--val-data", metavar="FILE",
                        help="held-out token data for --eval-every (default: the last 10%% of "
                             "--data)")
    parser.add_argument("--data-dtype", choices=("uint16", "uint32", "uint8", "int32", "int64"),
                        default=None, help="the id type of a .bin token file (default uint16, "
                                           "as nanoGPT writes them)")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """--save, --save-every, --keep, --async-save, --resume, --init (what they do:
    dsl/app/run_checkpoints.py)."""
    parser.add_argument("--save", metavar="DIR",
                        help="save checkpoints under DIR (DIR/step-NNNNNNNN) after the last step, "
                             "every --save-every steps, and on SIGTERM/SIGINT")
    parser.add_argument("--save-every", type=int, default=None, metavar="K",
                        help="also save every K steps")
    parser.add_argument("--keep", type=int, default=None, metavar="N",
                        help="keep only the newest N checkpoints (default: all)")
    parser.add_argument("--async-save", action="store_true",
                        help="write checkpoints beside training: the step only copies its "
                             "shards to host memory (explain's `async staging` line); a save "
                             "due while the previous one is still being written waits for it "
                             "(never skipped); the run's end waits for the last save")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue from the latest complete checkpoint in DIR (or from one "
                             "DIR/step-NNNNNNNN), in this run's layout; --steps is the total")
    parser.add_argument("--init", metavar="SOURCE",
                        help="initial weights: a .safetensors file of full parameters (`soapstone "
                             "ckpt export`) or a checkpoint directory")


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """--device and --comm: where each rank computes, over what (soapstone.comm.launch.device)."""
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                        help="cpu (MPI), cuda (a GPU per rank, NCCL; needs the gpu extra) or "
                             "auto (cuda when torch sees a GPU); default cpu")
    parser.add_argument("--comm", choices=("auto", "nccl", "mpi"), default="auto",
                        help="auto (NCCL for cuda, MPI for cpu), nccl, or mpi: with --device "
                             "cuda, ranks that share GPUs (more ranks than GPUs) exchange over "
                             "MPI through host memory, to debug a layout on one GPU (slow)")


def add_nonfinite_options(parser: argparse.ArgumentParser) -> None:
    """--on-nonfinite, --max-skips: what a NaN or infinite loss or gradient norm does (what
    they mean: shard/train/nonfinite.py)."""
    parser.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                        help="a step whose loss or gradient norm is NaN or infinite never "
                             "updates: stop the run (exit 3; default) or skip the step and go on")
    parser.add_argument("--max-skips", type=int, default=None, metavar="N",
                        help="with --on-nonfinite skip: stop after N skipped steps in a row "
                             "(default 10)")


def add_nodes_option(parser: argparse.ArgumentParser) -> None:
    """--devices-per-node: how many ranks a node holds, for which mesh axes cross nodes."""
    parser.add_argument("--devices-per-node", type=int, metavar="N",
                        help="ranks per node (consecutive ranks fill a node): print which mesh "
                             "axes stay inside a node and which cross nodes (default: "
                             "--profile's devices per node)")
