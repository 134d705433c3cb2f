"""ZeRO as one strategy object: the questions the reducer, the planner, explain and the
proofs ask of a ZeRO stage, answered in one place. Pure data: no torch.

The spec's `zero N` stays the user's syntax (and the number Program, Estimate and the
planner carry); `ZeroStage.of(N)` is what code asks. The stages nest, each sharding over the
data axes what the one below it does and one thing more (data_parallel.py's module doc):

  0  nothing: every rank allreduces whole gradients and updates everything.
  1  the optimizer state (and fp32 master weights): each rank updates 1/N of every bucket,
     its gradients reduce-scattered, then gathers the updated parameters.
  2  and the gradients: the full gradient buffer lives only until its reduce-scatter, which
     runs every microbatch; each rank accumulates its shard.
  3  and the parameters: kept as shards, gathered per block before use and freed after
     (zero.py); so buckets never span blocks and nothing is gathered after the update.

A bucket over one data rank has nothing to shard over: it runs stage 0 (`on`).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ZeroStage:
    """ZeRO stage `level` (0..3) and what it does (the module doc)."""

    level: int = attrs.field(validator=attrs.validators.in_(range(4)))

    @staticmethod
    def of(zero: int | ZeroStage) -> ZeroStage:
        """The stage of the spec's `zero N` (or the stage itself)."""
        if isinstance(zero, ZeroStage):
            return zero
        if zero not in range(4):
            raise ValueError(f"zero = {zero!r}: the ZeRO stage is 0, 1, 2 or 3")
        return STAGES[zero]

    def on(self, n: int) -> ZeroStage:
        """The stage a bucket runs over `n` data ranks: this one, or 0 on a single rank."""
        return self if n > 1 else STAGES[0]

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state and master weights are sharded: gradients are reduce-scattered and
        the update is of this rank's shard (stages 1-3; any sharding at all)."""
        return self.level >= 1

    @property
    def shards_grads(self) -> bool:
        """Only gradient shards are kept: each microbatch's gradients are reduce-scattered at
        once (no no_sync accumulation of whole gradients) and the full buffer is transient
        (stages 2, 3)."""
        return self.level >= 2

    @property
    def shards_params(self) -> bool:
        """Parameters are kept as shards and gathered per block for forward and again for
        backward (zero.py), so a bucket never spans two blocks (stage 3)."""
        return self.level >= 3

    @property
    def keeps_full_grad(self) -> bool:
        """The full gradient buffer persists between steps (stages 0, 1)."""
        return not self.shards_grads

    @property
    def publishes_params(self) -> bool:
        """The updated parameter shards are allgathered after the optimizer step (stages 1,
        2: sharded updates of parameters every rank keeps whole)."""
        return self.shards_optimizer and not self.shards_params

    @property
    def summary(self) -> str:
        """What it shards, in words (the planner's reasons)."""
        return ("no ZeRO", "ZeRO-1 shards the optimizer state",
                "ZeRO-2 shards gradients and optimizer state",
                "ZeRO-3 shards parameters too")[self.level]

    def __str__(self) -> str:
        return str(self.level)


STAGES = tuple(ZeroStage(n) for n in range(4))
