"""The learning rate of each step: linear warmup, then cosine, linear or no decay to a floor.

For `steps` steps (0-based step i), peak rate `lr`, `warmup` steps and floor `min_lr`:

    i <  warmup:   lr * (i + 1) / warmup                     (reaches lr at step warmup - 1)
    i >= warmup:   r = (i - warmup) / (steps - warmup)       (0 at the first decay step)
        cosine:    min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2
        linear:    min_lr + (lr - min_lr) * (1 - r)
        constant:  lr

r never reaches 1 inside the run: the floor is where the step after the last would be, so the
last update still moves the weights when min_lr is 0 (nanoGPT's and torchtitan's shape).
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.train.errors import SettingError

KINDS = ("cosine", "linear", "constant")


@attrs.frozen
class LRSchedule:
    """Warmup then decay; `at(i)` is step i's rate."""

    lr: float
    steps: int
    warmup: int = 0
    kind: str = "constant"
    min_lr: float = 0.0

    def __attrs_post_init__(self):
        if self.kind not in KINDS:
            raise SettingError(f"lr schedule must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not 0 <= self.warmup <= self.steps:
            raise SettingError(f"warmup {self.warmup} must be between 0 and steps {self.steps}")
        if not 0 <= self.min_lr <= self.lr:
            raise SettingError(f"min_lr {self.min_lr} must be between 0 and lr {self.lr}")

    def at(self, i: int) -> float:
        """The learning rate of step i (0-based)."""
        if i < self.warmup:
            return self.lr * (i + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        r = min((i - self.warmup) / max(self.steps - self.warmup, 1), 1.0)
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * r))
        return self.min_lr + (self.lr - self.min_lr) * (1.0 - r)
