"""`soapstone export SPEC [--init SOURCE] --hf DIR`: a model's weights as a Hugging Face
save_pretrained directory (config.json + model.safetensors) that transformers loads.

The weights are those `run --init SOURCE` would start from (dsl/app/init_weights.py: a checkpoint
directory, a .safetensors file of full parameters, hf:DIR), or without --init the model's
seeded initialisation (--seed). The model must be a GPT-2 or LLaMA written as
examples/gpt2.par and examples/llama.par are (dsl/interop/hf.py checks it op by op before writing).
One rank; no mpiexec needed.
"""

from __future__ import annotations

import argparse

from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import compile_layout, load_layout, world
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_spec_options


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC, --model, --dim, --plugin, --init, --seed and --hf DIR."""
    parser.add_argument("spec", metavar="SPEC", help="the .par file")
    parser.add_argument("--model", help="which model (default: the only one)")
    add_spec_options(parser)
    parser.add_argument("--init", metavar="SOURCE",
                        help="the weights: a checkpoint directory, a .safetensors file of full "
                             "parameters, or hf:DIR (default: the seeded initialisation)")
    parser.add_argument("--seed", type=int, default=0,
                        help="initialisation seed without --init (default 0)")
    parser.add_argument("--hf", required=True, metavar="DIR",
                        help="write config.json and model.safetensors here")


def main(args: argparse.Namespace) -> int:
    """Build the model on one rank, load its weights, write the Hugging Face directory."""
    from soapstone.dsl.app.init_weights import check_init, load_init
    from soapstone.dsl.interop import hf, hf_config
    from soapstone.shard.runtime.executor import Executor

    try:
        comm = world()
    except UserError as e:
        from soapstone.comm.launch.failure import world_rank

        return fail(e, world_rank())
    try:
        args.parallel = None
        model, _ = load_layout(args)
        hf.check_model(model, hf_config.config_of(model), args.spec)
        graph = compile_layout(model, None)
        if args.init:
            check_init(args.init, graph, model)
        ex = Executor(graph, None, seed=args.seed, draw=not args.init)  # --init fills it
        what = load_init(ex, args.init) if args.init else f"seed {args.seed}"
        if comm.rank == 0:  # under mpiexec every rank builds the same: one writes
            cfg = hf.save(args.hf, model, ex.full_state_dict())
            print(f"exported {model.name} ({what}) as a Hugging Face {cfg.kind} to {args.hf}")
    except UserError as e:
        return fail(e, comm.rank)
    return 0
