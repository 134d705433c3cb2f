"""The command-line flags several commands share (argparse only; what they mean: dsl/build.py)."""

from __future__ import annotations

import argparse


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
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="parameter and activation dtype (default fp32)")
    parser.add_argument("--data", metavar="FILE",
                        help="token data: a .npy of integer ids, or any file read as bytes "
                             "(default: the built-in synthetic task)")
