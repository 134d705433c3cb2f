"""Damaged copies of a JSON document for the fuzz tests of its readers (a checkpoint's
index.json, a rank's debug dump): each copy has one or two fields set to a value of another
type or range, or deleted, drawn from a seeded generator so a failure reproduces."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator


def field_paths(obj, at: tuple = ()) -> Iterator[tuple]:
    """Every path into `obj` (dict keys, the first two items of a list), the root's () first."""
    yield at
    for k, v in (obj.items() if isinstance(obj, dict) else
                 enumerate(obj[:2]) if isinstance(obj, list) else ()):
        yield from field_paths(v, (*at, k))


def mutants(base, values: list, count: int, depth: int = 1, seed: int = 0) -> Iterator:
    """`count` copies of `base`, each with one or two of its fields at least `depth` deep set to
    one of `values` or (three times in ten, in a dict) deleted."""
    where = [p for p in field_paths(base) if len(p) >= depth]
    rng = random.Random(seed)
    for _ in range(count):
        doc = copy.deepcopy(base)
        for p in rng.sample(where, rng.choice((1, 2))):
            parent = doc
            try:
                for k in p[:-1]:
                    parent = parent[k]
                if rng.random() < 0.3 and isinstance(parent, dict):
                    parent.pop(p[-1], None)
                else:
                    parent[p[-1]] = rng.choice(values)
            except (KeyError, IndexError, TypeError):
                pass  # the first change removed what the second would change
        yield doc
