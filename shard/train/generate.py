"""Sampling from a trained language model under any layout, one token per forward pass.

The model keeps its compiled shapes: each step fills every row of the batch with the last
`seq` ids (padded with id 0 after them; the model is causal, so the padding never reaches the
position read), runs `Executor.infer` (forward only, the logits gathered to their full size on
every rank) and reads row 0 at the last real position. Temperature 0 is greedy (argmax);
otherwise softmax(logits / temperature) over the top_k ids, drawn from a generator seeded by
`seed`. Rank 0's choice is broadcast, so every rank extends the same sequence.

Logits that are NaN or infinite mean the weights are (NonFiniteLogits, bad input): every rank
holds the same gathered logits, so every rank raises at the same step. A temperature so small
that logits / temperature overflows samples the limit (the largest logit, ties drawn evenly).
`generate_ids` yields each id as it is drawn (a caller prints them as they come) and keeps only
the last `seq` ids, so any number of tokens runs in bounded memory.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from soapstone.comm.errors import UserError
from soapstone.shard.data.errors import DataError
from soapstone.shard.train.errors import SettingError


class NonFiniteLogits(UserError, ValueError):
    """The model's logits hold NaN or infinity: so do its weights (bad input, exit 2)."""


def generate(executor, ids: str, targets: str, logits: str, prompt: list[int], tokens: int,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
             shape: tuple[int, int] = (1, 1), world=None,
             classes: int | None = None) -> list[int]:
    """`tokens` new ids after `prompt` (collective: every rank calls it with the same
    arguments). shape: (rows, seq) of the model's token input; world: the world communicator
    (None on one rank); classes: the real ids of a padded vocab (the rest never picked)."""
    return list(generate_ids(executor, ids, targets, logits, prompt, tokens, temperature, top_k,
                             seed, shape, world, classes))


def generate_ids(executor, ids: str, targets: str, logits: str, prompt: list[int], tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
                 shape: tuple[int, int] = (1, 1), world=None,
                 classes: int | None = None) -> Iterator[int]:
    """`generate`'s ids one at a time, as each is drawn (collective, as `generate`); its
    arguments are checked at the call, not at the first id drawn."""
    if isinstance(prompt, torch.Tensor | np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()  # then checked as a list: float ids are refused there
    check_args(prompt, tokens, temperature, top_k, classes)
    return _draw(executor, ids, targets, logits, list(prompt), tokens, temperature, top_k,
                 seed, shape, world, classes)


def check_args(prompt, tokens: int, temperature: float, top_k: int | None,
               classes: int | None) -> None:
    """DataError for a prompt that is not a non-empty list of ids (below `classes`, where
    given), SettingError for a count, temperature or top_k that cannot work. Every rank
    passes the same arguments, so every rank raises alike, before any collective."""
    def whole(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence) or not prompt \
            or not all(whole(i) and i >= 0 for i in prompt):
        # an empty one would read the logits after the padding, at position -1
        raise DataError(f"prompt={_short(prompt)}: give a non-empty list of token ids >= 0 "
                        "(text encoded by the model's tokenizer)")
    if classes is not None and max(prompt) >= classes:
        raise DataError(f"prompt: id {max(prompt)} does not fit the model's {classes} ids; "
                        f"give ids below {classes}, encoded by the model's own tokenizer")
    if not whole(tokens) or tokens < 1:
        raise SettingError(f"tokens={tokens!r}: give at least 1 (how many ids to draw)")
    if not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        # a negative one would silently favour the least likely ids
        raise SettingError(f"temperature={temperature!r}: give 0 (greedy) or more")
    if top_k is not None and (not whole(top_k) or top_k < 1):
        raise SettingError(f"top_k={top_k!r}: give at least 1, or None for every id")


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _draw(executor, ids: str, targets: str, logits: str, prompt: list[int], tokens: int,
          temperature: float, top_k: int | None, seed: int, shape: tuple[int, int], world,
          classes: int | None) -> Iterator[int]:
    rows, seq = shape
    g = torch.Generator().manual_seed(seed)
    ctx = list(prompt)[-seq:]
    for step in range(tokens):
        row = torch.zeros(seq, dtype=torch.long)
        row[:len(ctx)] = torch.tensor(ctx, dtype=torch.long)
        batch = {ids: row.expand(rows, seq).clone(), targets: torch.zeros(rows, seq,
                                                                           dtype=torch.long)}
        _, full = executor.infer(batch, gather=(logits,))
        scores = full[logits][0, len(ctx) - 1, :classes].double()
        check_finite(scores, step)
        pick = torch.tensor([next_id(scores, temperature, top_k, g)], dtype=torch.long)
        if world is not None and world.size > 1:
            world.broadcast(pick, src=0)
        ctx = (ctx + [int(pick)])[-seq:]
        yield int(pick)


def check_finite(scores: torch.Tensor, step: int) -> None:
    """NonFiniteLogits naming the first id whose logit is NaN or infinite, if one is."""
    bad = (~torch.isfinite(scores)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise NonFiniteLogits(f"the logits of new token {step + 1} are not finite (id {i}: "
                              f"{float(scores[i])}, {len(bad)} of {scores.numel()} ids): the "
                              "weights hold NaN or infinity")


def next_id(scores: torch.Tensor, temperature: float, top_k: int | None,
            g: torch.Generator) -> int:
    """The next id from one position's logits: argmax at temperature 0, else a draw."""
    if temperature == 0:
        return int(scores.argmax())
    scaled = scores / temperature
    if not bool(torch.isfinite(scaled).all()):
        # a temperature so small that a logit / T overflows (inf - inf is NaN in the softmax):
        # shifted by the largest logit first, each is 0 (the largest) or below, and / T tends
        # to -inf, never +inf: the draw is the limit T -> 0 (the largest, ties evenly). Only
        # here, so a draw at any other temperature is the one it always was.
        scaled = (scores - scores.max()) / temperature
    scores = scaled
    if top_k is not None and top_k < scores.numel():
        floor = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=g))
