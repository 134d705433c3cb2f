"""`[mpiexec -n N] soapstone generate SPEC --init SOURCE --prompt TEXT [--tokens N] ...`:
sample from a trained language model, on one rank or under any layout (--parallel).

SOURCE is what `run --init` takes (dsl/app/init_weights.py: a checkpoint directory, a safetensors
file of full parameters, or a registered scheme such as hf:DIR). The prompt is encoded as
UTF-8 bytes (a model trained on byte-level data, vocab 256) or by a Hugging Face
tokenizer.json: --tokenizer's, else the one beside hf:DIR's weights (a model of more than 256
ids without either is exit 2 naming --tokenizer); the continuation printed as text (rank 0)
as each token is drawn: generation reads only the last `seq` ids, so --tokens has no bound
but time, and a long run shows its text as it goes rather than all at the end.
Every rank checks the flags on its own and reaches the same verdict, so bad input exits 2 on
all of them at once; weights whose logits are NaN or infinite are exit 2 naming --init.
"""

from __future__ import annotations

import argparse
import codecs
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
    from soapstone.shard.train.generate import NonFiniteLogits, generate_ids

    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    ex = Executor(graph, mesh, seed=args.seed, custom=custom_layers(), draw=False)  # --init fills
    try:  # a damaged byte: every rank raises the same CheckpointError together
        loaded = load_init(ex, args.init)
    except UserError as e:
        return fail(e, comm.rank)
    dims = next(i.type.dims for i in lm.model.inputs if i.name == lm.ids)
    rows = lm.model.size(dims[0]) if len(dims) == 2 else 1
    new = generate_ids(ex, lm.ids, lm.targets, lm.logits_output, prompt, args.tokens,
                       args.temperature, args.top_k, args.seed, (rows, lm.seq),
                       comm if comm.size > 1 else None, classes=lm.real)
    text = TextStream(tok)
    try:
        for i, pick in enumerate(new):
            if comm.rank == 0 and i == 0:  # with the first token: bad weights print one line
                print(f"soapstone generate: {lm.model.name}"
                      f"{' / ' + par.name if par is not None else ''} on {comm.size} rank"
                      f"{'s' if comm.size > 1 else ''}, {loaded}, {args.tokens} tokens, "
                      f"temperature {args.temperature:g}", file=sys.stderr, flush=True)
                sys.stdout.write(args.prompt)
            if comm.rank == 0:
                sys.stdout.write(text.push(pick))
                sys.stdout.flush()
    except NonFiniteLogits as e:  # every rank holds the same logits: all stop together
        return fail(BadInput(f"--init {args.init}: {e}; train again from a finite checkpoint, "
                             "or check what wrote the file"), comm.rank)
    if comm.rank == 0:
        print(text.end(), flush=True)
    return 0


class TextStream:
    """Generated ids to text piece by piece, each character printed once: bytes through an
    incremental UTF-8 decoder (a character split over tokens waits for its last byte); a
    tokenizer's ids decoded beside the ids before them, since a token's text may depend on its
    left neighbour (a leading space, a character split over tokens), and held back while they
    end in a broken character. Holds a few ids, whatever the length."""

    def __init__(self, tok):
        self.tok = tok
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") \
            if tok.name == "bytes" else None
        self.ids: list[int] = []
        self.read = 0  # ids[:read]: printed already, kept as the left context of the rest

    def push(self, i: int) -> str:
        """The text that id `i` completes ('' while it cannot be told yet)."""
        if self.utf8 is not None:
            return self.utf8.decode(bytes([i]))
        self.ids.append(i)
        piece = self.pending()
        # a character's bytes span at most 4 tokens: past 8 held, what is broken stays broken
        if (not piece or piece.endswith("\ufffd")) and len(self.ids) - self.read < 8:
            return ""
        self.ids = self.ids[self.read:]  # the newest printed ids are the next one's context
        self.read = len(self.ids)
        return piece

    def pending(self) -> str:
        """The text of the ids not printed yet, read beside the ones before them."""
        before = self.tok.decode(self.ids[:self.read])
        return self.tok.decode(self.ids)[len(before):]

    def end(self) -> str:
        """What is still held back (a broken character at the very end)."""
        return self.utf8.decode(b"", final=True) if self.utf8 is not None else self.pending()
