"""Sampling from a trained language model under any layout, one token per forward pass.

The model keeps its compiled shapes: each step fills every row of the batch with the last
`seq` ids (padded with id 0 after them; the model is causal, so the padding never reaches the
position read), runs `Executor.infer` (forward only, the logits gathered to their full size on
every rank) and reads row 0 at the last real position. Temperature 0 is greedy (argmax);
otherwise softmax(logits / temperature) over the top_k ids, drawn from a generator seeded by
`seed`. Rank 0's choice is broadcast, so every rank extends the same sequence.
"""

from __future__ import annotations

import torch


def generate(executor, ids: str, targets: str, logits: str, prompt: list[int], tokens: int,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
             shape: tuple[int, int] = (1, 1), world=None,
             classes: int | None = None) -> list[int]:
    """`tokens` new ids after `prompt` (collective: every rank calls it with the same
    arguments). shape: (rows, seq) of the model's token input; world: the world communicator
    (None on one rank); classes: the real ids of a padded vocab (the rest never picked)."""
    rows, seq = shape
    g = torch.Generator().manual_seed(seed)
    out = list(prompt)
    for _ in range(tokens):
        ctx = out[-seq:]
        row = torch.zeros(seq, dtype=torch.long)
        row[:len(ctx)] = torch.tensor(ctx, dtype=torch.long)
        batch = {ids: row.expand(rows, seq).clone(), targets: torch.zeros(rows, seq,
                                                                           dtype=torch.long)}
        _, full = executor.infer(batch, gather=(logits,))
        scores = full[logits][0, len(ctx) - 1, :classes].double()
        pick = torch.tensor([next_id(scores, temperature, top_k, g)], dtype=torch.long)
        if world is not None and world.size > 1:
            world.broadcast(pick, src=0)
        out.append(int(pick))
    return out[len(prompt):]


def next_id(scores: torch.Tensor, temperature: float, top_k: int | None,
            g: torch.Generator) -> int:
    """The next id from one position's logits: argmax at temperature 0, else a draw."""
    if temperature == 0:
        return int(scores.argmax())
    scores = scores / temperature
    if top_k is not None and top_k < scores.numel():
        floor = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=g))
