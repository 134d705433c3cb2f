"""`[mpiexec -n N] soapstone generate SPEC --init SOURCE --prompt TEXT [--tokens N] ...`:
sample from a trained language model, on one rank or under any layout (--parallel).

SOURCE is what `run --init` takes (dsl/app/init_weights.py: a checkpoint directory, a safetensors
file of full parameters, or a registered scheme such as hf:DIR). The prompt is encoded as
UTF-8 bytes (a model trained on byte-level data, vocab 256) or by a Hugging Face
tokenizer.json: --tokenizer's, else the one beside hf:DIR's weights (a model of more than 256
ids without either is exit 2 naming --tokenizer); the continuation printed as text (rank 0).
Every rank checks the flags on its own and reaches the same verdict, so bad input exits 2 on
all of them at once.
"""

from __future__ import annotations

import argparse
import sys

from soapstone.comm.errors import UserError
from soapstone.dsl.app.build import build_program, compile_layout, custom_layers, world
from soapstone.dsl.commands import fail
from soapstone.dsl.commands.flags import add_model_options
from soapstone.dsl.lang.errors import BadInput


def configure(parser: argparse.ArgumentParser) -> None:
    """SPEC and the model options, --init, --prompt, --tokens, --temperature, --top-k, ..."""
    add_model_options(parser)
    parser.add_argument("--init", required=True, metavar="SOURCE",
                        help="the weights: a checkpoint directory, a .safetensors file of full "
                             "parameters, or hf:DIR")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--tokens", type=int, default=100, metavar="N",
                        help="how many tokens to generate (default 100)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="softmax temperature; 0: greedy, the most likely token (default 1)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens only")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--tokenizer", metavar="tokenizer.json",
                        help="a Hugging Face tokenizer.json (default: UTF-8 bytes)")


def check_flags(args: argparse.Namespace) -> None:
    """Numbers that cannot work (BadInput)."""
    if args.tokens < 1:
        raise BadInput(f"--tokens {args.tokens}: give at least 1")
    if not 0 <= args.temperature < float("inf"):  # nan and inf too
        raise BadInput(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if args.top_k is not None and args.top_k < 1:
        raise BadInput(f"--top-k {args.top_k}: give at least 1")


def main(args: argparse.Namespace) -> int:
    """Check everything on every rank, load the weights, sample, print (rank 0)."""
    from soapstone.dsl.app.init_weights import check_init, init_tokenizer, load_init
    from soapstone.dsl.model.language_model import language_model
    from soapstone.shard.data.tokenizer import load_tokenizer

    try:
        comm = world()
    except UserError as e:
        from soapstone.comm.launch.failure import world_rank

        return fail(e, world_rank())
    try:
        check_flags(args)
        model, par, _ = build_program(args, comm.size)  # the launch matches the layout
        lm = language_model(model, args.spec)
        # a Hugging Face directory's own tokenizer.json, unless --tokenizer names another
        tok = load_tokenizer(args.tokenizer or init_tokenizer(args.init))
        if tok.name == "bytes" and lm.real > 256:
            raise BadInput(f"model '{model.name}' has a vocab of {lm.real}: its ids are no "
                           "bytes, so the text needs the tokenizer it was trained with; give "
                           "--tokenizer tokenizer.json (or a directory holding one)")
        prompt = tok.encode(args.prompt)
        if not prompt:
            raise BadInput("--prompt '': give at least one character to continue")
        if max(prompt) >= lm.real:
            raise BadInput(f"--prompt: id {max(prompt)} ({tok.name}) does not fit model "
                           f"'{model.name}''s vocab of {lm.real}; a model trained on bytes "
                           "needs --dim vocab=256 (or more), another needs its --tokenizer")
        graph = compile_layout(lm.model, par)
        check_init(args.init, graph, lm.model)  # the source holds this model's parameters
    except UserError as e:
        return fail(e, comm.rank)
    return sample(args, comm, par, graph, lm, tok, prompt, load_init)


def sample(args, comm, par, graph, lm, tok, prompt, load_init) -> int:
    """Build the layout, load --init, generate, print the text on rank 0."""
    from soapstone.comm import Mesh
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.train.generate import generate

    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    ex = Executor(graph, mesh, seed=args.seed, custom=custom_layers(), draw=False)  # --init fills
    try:  # a damaged byte: every rank raises the same CheckpointError together
        loaded = load_init(ex, args.init)
    except UserError as e:
        return fail(e, comm.rank)
    dims = next(i.type.dims for i in lm.model.inputs if i.name == lm.ids)
    rows = lm.model.size(dims[0]) if len(dims) == 2 else 1
    new = generate(ex, lm.ids, lm.targets, lm.logits_output, prompt, args.tokens,
                   args.temperature, args.top_k, args.seed, (rows, lm.seq),
                   comm if comm.size > 1 else None, classes=lm.real)
    if comm.rank == 0:
        print(f"soapstone generate: {lm.model.name}"
              f"{' / ' + par.name if par is not None else ''} on {comm.size} rank"
              f"{'s' if comm.size > 1 else ''}, {loaded}, {args.tokens} tokens, temperature "
              f"{args.temperature:g}", file=sys.stderr, flush=True)
        print(args.prompt + tok.decode(new), flush=True)
    return 0
