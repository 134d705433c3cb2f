"""Training data for `soapstone run`: a built-in learnable task, or token data from a file.

Every rank builds the same FULL global batch for a step (a function of the seed and the step
number only) and `ShardedModel.forward` slices its share, so a run's data never depends on the
layout. What the inputs mean is the Program's `roles` (decided by the compiler, dsl/lower.py):

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

`TokenFile` reads real tokens: a .npy of integer ids, or any other file read as bytes (ids
0..255); windows of seq+1 tokens at offsets drawn from (seed, step).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from soapstone.comm.errors import UserError
from soapstone.shard.plan.program import Program

MARKOV_P = 0.9


class DataError(UserError, ValueError):
    """Bad data input (a missing or unreadable file, ids out of range): one line, exit 2."""


def _generator(seed: int, *parts: object) -> torch.Generator:
    key = "/".join(str(p) for p in (seed, *parts)).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def input_roles(program: Program) -> dict[str, tuple[str, int]]:
    """input name -> (role, limit), as the compiler decided (Program.roles)."""
    return {r.name: (r.role, r.limit) for r in program.roles}


def _shape(program: Program, name: str) -> tuple[int, ...]:
    sizes = dict(program.dims)
    return tuple(sizes[d] for d in program.value(name).dims)


def _dtype(program: Program, name: str) -> torch.dtype:
    from soapstone.shard.runtime import TORCH_DTYPES

    return TORCH_DTYPES[program.value(name).dtype]


def _lm_pair(program: Program, roles) -> tuple[str, str, int] | None:
    """(ids input, targets input, vocab) when the model is a next-token language model."""
    ids = [n for n, (r, _) in roles.items() if r == "ids"]
    labels = [n for n, (r, _) in roles.items() if r == "labels"]
    if len(ids) == 1 and len(labels) == 1:
        (i, v), (t, c) = (ids[0], roles[ids[0]][1]), (labels[0], roles[labels[0]][1])
        if _shape(program, i) == _shape(program, t) and v == c and _shape(program, i):
            return i, t, v
    return None


class SyntheticTask:
    """The built-in task: `batch(step)` -> full global inputs, the same on every rank."""

    def __init__(self, program: Program, seed: int = 0):
        self.program, self.seed = program, seed
        self.roles = input_roles(program)
        self.lm = _lm_pair(program, self.roles)
        if self.lm:
            self.perm = torch.randperm(self.lm[2], generator=_generator(seed, "perm"))
        self.teachers: dict[str, torch.Tensor] = {}
        floats = [n for n, (r, _) in self.roles.items() if r == "float"]
        for name, (role, limit) in self.roles.items():
            if role == "labels" and not self.lm and floats:
                feat = _shape(program, floats[0])[-1]
                self.teachers[name] = torch.randn(feat, limit,
                                                  generator=_generator(seed, "teacher", name))
        self.features = floats[0] if floats else None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """The full global batch of training step `step`."""
        g = _generator(self.seed, "batch", step)
        out: dict[str, torch.Tensor] = {}
        if self.lm:
            ids, targets, vocab = self.lm
            shape = _shape(self.program, ids)
            seq = torch.empty(*shape[:-1], shape[-1] + 1, dtype=torch.long)
            seq[..., 0] = torch.randint(0, vocab, shape[:-1], generator=g)
            for t in range(shape[-1]):
                follow = torch.rand(shape[:-1], generator=g) < MARKOV_P
                noise = torch.randint(0, vocab, shape[:-1], generator=g)
                seq[..., t + 1] = torch.where(follow, self.perm[seq[..., t]], noise)
            out[ids] = seq[..., :-1].to(_dtype(self.program, ids))
            out[targets] = seq[..., 1:].to(_dtype(self.program, targets))
        for name, (role, limit) in self.roles.items():
            if name in out:
                continue
            shape = _shape(self.program, name)
            if role == "float":
                out[name] = torch.randn(shape, generator=g).to(_dtype(self.program, name))
            else:
                out[name] = torch.randint(0, limit, shape, generator=g) \
                    .to(_dtype(self.program, name))
        for name, w in self.teachers.items():
            x = out[self.features].double()
            scores = x.reshape(-1, x.shape[-1]) @ w.double()
            labels = scores.argmax(-1).reshape(_shape(self.program, name))
            if labels.shape == out[name].shape:
                out[name] = labels.to(_dtype(self.program, name))
        return out

    def tokens(self, step: int) -> int:
        """Tokens (or samples) per global batch: the elements of the label input."""
        name = next((n for n, (r, _) in self.roles.items() if r == "labels"), None)
        name = name or self.program.inputs[0]
        return int(np.prod(_shape(self.program, name)))


def read_tokens(path: str | Path) -> np.ndarray:
    """Token ids from a .npy of integers, or any other file's bytes; DataError if unusable."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data {path}: no such file")
    try:
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
            if not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"--data {path}: expected integer token ids, got {arr.dtype}")
            arr = arr.reshape(-1).astype(np.int64)
        else:
            arr = np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64)
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"--data {path}: cannot read it ({e})") from None
    if arr.size and arr.min() < 0:
        raise DataError(f"--data {path}: negative token id {int(arr.min())}")
    return arr


class TokenFile(SyntheticTask):
    """Language-model batches cut from a token file (windows at seeded random offsets)."""

    def __init__(self, program: Program, path: str | Path, seed: int = 0):
        super().__init__(program, seed)
        if not self.lm:
            raise DataError(f"--data {path}: model {program.model} has no token input and "
                            "next-token targets of the same shape to feed from a token file")
        self.data = read_tokens(path)
        ids, _, vocab = self.lm
        need = _shape(program, ids)[-1] + 1
        if self.data.size < need:
            raise DataError(f"--data {path}: {self.data.size} tokens, fewer than the "
                            f"{need} one sequence needs")
        top = int(self.data.max())
        if top >= vocab:
            raise DataError(f"--data {path}: token id {top} does not fit the vocab of {vocab}; "
                            f"raise it (e.g. --dim vocab={_pow2(top + 1)})")
        self.data_t = torch.from_numpy(self.data)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        ids, targets, _ = self.lm
        shape = _shape(self.program, ids)
        rows, seq = int(np.prod(shape[:-1])), shape[-1]
        g = _generator(self.seed, "data", step)
        starts = torch.randint(0, self.data.size - seq, (rows,), generator=g)
        win = self.data_t[starts.unsqueeze(1) + torch.arange(seq + 1)]
        out = {n: v for n, v in super().batch(step).items() if n not in (ids, targets)}
        out[ids] = win[:, :-1].reshape(shape).to(_dtype(self.program, ids))
        out[targets] = win[:, 1:].reshape(shape).to(_dtype(self.program, targets))
        return out


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def make_task(program: Program, seed: int = 0, data: str | None = None) -> SyntheticTask:
    """The data source of a run: `TokenFile` with --data, the synthetic task otherwise."""
    return TokenFile(program, data, seed) if data else SyntheticTask(program, seed)


def random_inputs(program: Program, step: int) -> dict[str, torch.Tensor]:
    """Uniformly random inputs in range (no task): what the numerics tests feed."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    roles = input_roles(program)
    for name in program.inputs:
        (role, limit), shape = roles[name], _shape(program, name)
        if role == "float":
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randint(0, limit, shape, generator=g)
    return out
