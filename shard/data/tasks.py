"""Training data for `soapstone run`: a built-in learnable task, or token data from a file.

Every rank builds the same FULL global batch for a step (a function of the seed and the step
number only) and `ShardedModel.forward` slices its share, so a run's data never depends on the
layout. What the inputs mean is the Program's `roles` (decided by the compiler,
dsl/compile/lower.py):

- an integer input feeding an `embedding` is token ids below that table's vocab size;
- an integer input used as `cross_entropy` targets is labels below the class dim's size;
- every other input is a float tensor.

The synthetic task (`SyntheticTask`), learnable in well under 100 steps on a CPU:

- language models (token ids and targets with the same shape): sequences from a fixed Markov
  chain: the next token is `perm[token]` (a permutation drawn from the seed) with probability
  0.9, else uniform. `targets` is `tokens` shifted by one, so the best achievable loss is about
  0.1 * ln(V) + H(0.9) ~ 0.7 nats instead of the ln(V) of a random guess.
- classifiers (float features, integer labels): features ~ N(0, 1), label = argmax of a fixed
  random linear teacher applied to them.
- anything else: random inputs and random labels (nothing to learn, the run still works).

Held-out batches (`eval_batch(j)`, for `run --eval-every`) are the task's batches of negative
step numbers, which training never draws. Real tokens come from a memory-mapped token file
(shard/data/token_memmap.py: nanoGPT's .bin, .npy, or any file's bytes), with its own held-out
split.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from soapstone.shard.plan.program import Program

MARKOV_P = 0.9


def seeded_generator(seed: int, *parts: object) -> torch.Generator:
    """A torch generator seeded from (seed, *parts): the same stream on every rank."""
    key = "/".join(str(p) for p in (seed, *parts)).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def input_roles(program: Program) -> dict[str, tuple[str, int]]:
    """input name -> (role, limit), as the compiler decided (Program.roles)."""
    return {r.name: (r.role, r.limit) for r in program.roles}


def input_shape(program: Program, name: str) -> tuple[int, ...]:
    """The full global shape of input `name`."""
    sizes = dict(program.dims)
    return tuple(sizes[d] for d in program.value(name).dims)


def input_dtype(program: Program, name: str) -> torch.dtype:
    """The torch dtype of input `name`."""
    from soapstone.shard.runtime.sharded_model import TORCH_DTYPES

    return TORCH_DTYPES[program.value(name).dtype]


def _lm_pair(program: Program, roles) -> tuple[str, str, int] | None:
    """(ids input, targets input, vocab) when the model is a next-token language model."""
    ids = [n for n, (r, _) in roles.items() if r == "ids"]
    labels = [n for n, (r, _) in roles.items() if r == "labels"]
    if len(ids) == 1 and len(labels) == 1:
        (i, v), (t, c) = (ids[0], roles[ids[0]][1]), (labels[0], roles[labels[0]][1])
        shape = input_shape(program, i)
        # c < v: a padded vocab (cross_entropy classes): ids and targets are the real c
        if shape == input_shape(program, t) and v >= c and shape:
            return i, t, c
    return None


class SyntheticTask:
    """The built-in task: `batch(step)` -> full global inputs, the same on every rank."""

    def __init__(self, program: Program, seed: int = 0):
        self.program, self.seed = program, seed
        self.roles = input_roles(program)
        self.lm = _lm_pair(program, self.roles)
        if self.lm:
            self.perm = torch.randperm(self.lm[2], generator=seeded_generator(seed, "perm"))
        self.teachers: dict[str, torch.Tensor] = {}
        floats = [n for n, (r, _) in self.roles.items() if r == "float"]
        for name, (role, limit) in self.roles.items():
            if role == "labels" and not self.lm and floats:
                feat = input_shape(program, floats[0])[-1]
                self.teachers[name] = torch.randn(feat, limit,
                                                  generator=seeded_generator(seed, "teacher", name))
        self.features = floats[0] if floats else None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """The full global batch of training step `step`."""
        g = seeded_generator(self.seed, "batch", step)
        out: dict[str, torch.Tensor] = {}
        if self.lm:
            ids, targets, vocab = self.lm
            shape = input_shape(self.program, ids)
            seq = torch.empty(*shape[:-1], shape[-1] + 1, dtype=torch.long)
            seq[..., 0] = torch.randint(0, vocab, shape[:-1], generator=g)
            for t in range(shape[-1]):
                follow = torch.rand(shape[:-1], generator=g) < MARKOV_P
                noise = torch.randint(0, vocab, shape[:-1], generator=g)
                seq[..., t + 1] = torch.where(follow, self.perm[seq[..., t]], noise)
            out[ids] = seq[..., :-1].to(input_dtype(self.program, ids))
            out[targets] = seq[..., 1:].to(input_dtype(self.program, targets))
        for name, (role, limit) in self.roles.items():
            if name in out:
                continue
            shape = input_shape(self.program, name)
            if role == "float":
                out[name] = torch.randn(shape, generator=g).to(input_dtype(self.program, name))
            else:
                out[name] = torch.randint(0, limit, shape, generator=g) \
                    .to(input_dtype(self.program, name))
        for name, w in self.teachers.items():
            x = out[self.features].double()
            scores = x.reshape(-1, x.shape[-1]) @ w.double()
            labels = scores.argmax(-1).reshape(input_shape(self.program, name))
            if labels.shape == out[name].shape:
                out[name] = labels.to(input_dtype(self.program, name))
        return out

    def eval_batch(self, j: int) -> dict[str, torch.Tensor]:
        """Held-out batch j: the batch of step -1 - j, which training never draws."""
        return self.batch(-1 - j)

    def tokens(self, step: int) -> int:
        """Tokens (or samples) per global batch: the elements of the label input."""
        name = next((n for n, (r, _) in self.roles.items() if r == "labels"), None)
        name = name or self.program.inputs[0]
        return int(np.prod(input_shape(self.program, name)))


def random_inputs(program: Program, step: int) -> dict[str, torch.Tensor]:
    """Uniformly random inputs in range (no task): what the numerics tests feed."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    roles = input_roles(program)
    for name in program.inputs:
        (role, limit), shape = roles[name], input_shape(program, name)
        if role == "float":
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randint(0, limit, shape, generator=g)
    return out
