"""The loss over a large vocab: peak memory and step time of soapstone's chunked cross-entropy
(shard/ops/loss/loss_kernels.py) against the same kernel in one chunk and against torch's
F.cross_entropy, side by side on CPU.

One step: logits = h . W (h [tokens, 16], W [16, vocab]: logits made in the step, as the
model's head makes them), the mean token loss, backward to h and W. Implementations:
- torch: F.cross_entropy(logits, targets);
- torch is also what soapstone's op ran on one rank before chunks (reduction "sum" / count);
- one chunk: the chunked kernel with every token in one chunk and the gradient in a new
  buffer (backward's recompute without the chunking: the worst of both);
- chunked: the chunk rule's tokens per chunk (cross_entropy.CHUNK_ELEMENTS), gradient in a
  new buffer;
- chunked, in place: the same, the gradient written over the logits (what the runtime runs
  where no one reads the logits again: shard/runtime/overwrite_plan.py);
- folded into forward: Liger's way, each chunk's gradient computed in forward and written
  over the logits (its loss equals the others' to rounding, not to the bit).
Peak: the tensors the step allocates and still holds at its high point
(shard/runtime/memory.LiveBytes; h, W and the targets exist before). Time: the harness's
interleaved median of 30 steps with its IQR, and the load average.

    .venv/bin/python bench/bench_loss.py [--tokens 2048] [--vocab 32768] [--precision bf16]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def folded(rows: int):
    """The gradient folded into forward (Liger's way), written over the logits chunk by chunk:
    forward must assume the loss's incoming gradient (here 1 / tokens, the mean's) and
    backward rescales by whatever arrives. The same bytes as chunked, in place; kept here
    only to measure it."""
    import torch

    class Folded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            """The mean loss; x becomes its gradient for an incoming 1, chunk by chunk."""
            n = x.shape[0]
            picked = torch.empty(n, dtype=x.dtype)
            for a in range(0, n, rows):
                b = min(n, a + rows)
                lp = torch.log_softmax(x[a:b], -1)
                picked[a:b] = lp.gather(1, t[a:b, None]).squeeze(1)
                lp.exp_().scatter_add_(1, t[a:b, None], torch.full((b - a, 1), -1.0,
                                                                    dtype=x.dtype))
                x[a:b] = lp.div_(n)
                del lp
            ctx.save_for_backward(x)
            return -picked.sum() / n

        @staticmethod
        def backward(ctx, g):
            """The gradient written in forward, rescaled by g unless g is 1."""
            (x,) = ctx.saved_tensors
            return (x if float(g) == 1.0 else x.mul_(g)), None

    return Folded


def steps(tokens: int, vocab: int, dtype, rows: int):
    """name -> one forward and backward of the loss (closures over the same h, W, targets)."""
    import torch
    import torch.nn.functional as F

    from soapstone.shard.ops.loss.loss_kernels import PlainLoss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 16, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(16, vocab, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)

    def run(loss_of):
        def step():
            h.grad = w.grad = None
            loss = loss_of(h @ w)
            loss.backward()
            return float(loss.detach())
        return step

    return {
        "torch F.cross_entropy": run(lambda x: F.cross_entropy(x, t)),
        "one chunk": run(lambda x: PlainLoss.apply(x, t, vocab, tokens, False) / tokens),
        "chunked": run(lambda x: PlainLoss.apply(x, t, vocab, rows, False) / tokens),
        "chunked, in place": run(lambda x: PlainLoss.apply(x, t, vocab, rows, True) / tokens),
        "folded into forward": run(lambda x: folded(rows).apply(x, t)),
    }


def peak_bytes(step) -> int:
    """The step's peak of live tensor bytes (LiveBytes)."""
    from soapstone.shard.runtime.memory import LiveBytes

    live = LiveBytes()
    with live:
        step()
    return live.peak


def main() -> int:
    """The command line: each loss's (`steps`) peak and step time, printed as a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--chunk", type=int, help="tokens x classes per chunk (default: the "
                    "op's, cross_entropy.CHUNK_ELEMENTS)")
    ap.add_argument("--json", metavar="F")
    args = ap.parse_args()
    import torch

    from soapstone.comm.bench.harness import interleave
    from soapstone.shard.ops.loss.cross_entropy import CHUNK_ELEMENTS

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    rows = max(1, min(args.tokens, (args.chunk or CHUNK_ELEMENTS) // args.vocab))
    runs = steps(args.tokens, args.vocab, dtype, rows)
    losses = {name: run() for name, run in runs.items()}
    peaks = {name: peak_bytes(run) for name, run in runs.items()}
    session = interleave(runs)
    logits = args.tokens * args.vocab * dtype.itemsize
    print(f"{args.tokens} tokens x {args.vocab} classes, {args.precision}: logits "
          f"{logits / 2**20:.0f} MiB, {rows} tokens per chunk; {session.load_text()}")
    print(f"{'':<24} {'peak MiB':>9} {'x logits':>8}   step")
    for t in session.timings.values():
        print(f"{t.name:<24} {peaks[t.name] / 2**20:>9.1f} {peaks[t.name] / logits:>8.2f}   "
              f"{t.text()}")
    base = session.compare("chunked, in place", "torch F.cross_entropy")
    print(f"chunked, in place vs torch: {base.text()}")
    exact = [v for k, v in losses.items() if k != "folded into forward"]
    print("losses equal:", len(set(exact)) == 1, "(folded:",
          f"{losses['folded into forward'] - exact[0]:+.2e})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tokens": args.tokens, "vocab": args.vocab, "precision": args.precision,
            "rows": rows, "logits_bytes": logits, "peak_bytes": peaks, "losses": losses,
            "timing": session.to_json()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
