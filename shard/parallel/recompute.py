"""Activation recompute: a range of Program steps whose forward runs again in backward.

`recompute R` in a parallel block makes the compiler mark each block of repeat R as a step
range (Program.recompute). ShardedModel runs such a range through torch's non-reentrant
checkpoint: forward keeps only the values the range reads from before it (and the parameters,
which are kept anyway); backward reaches the range, runs its steps again with the same
inputs, then backpropagates through them.

The second run must compute what the first did. Dropout draws its mask from (seed, step,
value) and the microbatch's window in the global batch, all read from the model's Shards
context, which by then holds a later microbatch's settings (pipelines run other forwards in
between): the segment restores the settings of its own forward around the second run, so
the masks are the same. The collectives inside the range run again too, on every rank of
their communicators in the same order, so torch's early stop (ending the second run once it
has made what backward needs) is off: it could stop ranks holding different tensors at
different calls. Under ZeRO-3 the provider's before/after hooks run again, gathering each
block's parameters for the second run (prefetching the previous block's, which backward
needs next) and freeing them after.
"""

from __future__ import annotations

import attrs
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from soapstone.comm.collective_matmul import Checkpointed
from soapstone.shard.plan.program import Compute, Program


def _reads(program: Program, i: int) -> tuple[str, ...]:
    step = program.steps[i]
    return step.args if isinstance(step, Compute) else (step.src,)


@attrs.frozen
class Segment:
    """Steps [start, stop) of a Program, run as one checkpointed range."""

    start: int
    stop: int
    inputs: tuple[str, ...]  # values made before the range and read in it
    outputs: tuple[str, ...]  # values made in it and read after it (or model outputs)

    @classmethod
    def of(cls, program: Program, start: int, stop: int, run_index: dict[int, int]) -> Segment:
        """The segment of steps [start, stop); a fused chain must lie inside or outside it."""
        for i, at in run_index.items():
            if (start <= i < stop) != (start <= at < stop):  # a compiler bug, not user input
                raise ValueError(f"recompute range {start}..{stop} of {program.model} cuts "
                                 f"the fused chain running at step {at}")
        made = {program.steps[i].out for i in range(start, stop)}
        inputs = dict.fromkeys(a for i in range(start, stop) for a in _reads(program, i)
                               if a not in made)
        later = {a for i in range(stop, len(program.steps)) for a in _reads(program, i)}
        later |= {o.value for o in program.outputs}
        outputs = tuple(program.steps[i].out for i in range(start, stop)
                        if program.steps[i].out in later)
        return cls(start, stop, tuple(inputs), outputs)

    def run(self, model, env: dict[str, torch.Tensor], provider) -> int:
        """Run the range on `env` (adding its outputs, dropping what it used last); the index
        of the step after it."""
        ctx = model.ctx
        mine = (ctx.rng_step, dict(ctx.window), ctx.training)
        inputs = {n: env[n] for n in self.inputs}
        again = _Again(provider) if provider is not None else None
        first = [True]
        rings = Checkpointed()  # `overlap tensor`: the range's collective matmuls

        def steps() -> tuple[torch.Tensor, ...]:
            then = (ctx.rng_step, ctx.window, ctx.training)
            ctx.rng_step, ctx.window, ctx.training = mine[0], dict(mine[1]), mine[2]
            hooks = provider if first[0] else again
            rings.enter(replay=not first[0])
            model.ring_stash = rings
            first[0] = False  # any later run is backward's
            try:
                local = dict(inputs)
                for i in range(self.start, self.stop):
                    model._step(i, local, hooks)
                return tuple(local[n] for n in self.outputs)
            finally:
                ctx.rng_step, ctx.window, ctx.training = then
                model.ring_stash = None

        if torch.is_grad_enabled():
            with set_checkpoint_early_stop(False):
                outs = checkpoint(steps, use_reentrant=False)
        else:
            outs = steps()
        env.update(zip(self.outputs, outs, strict=True))
        for i in range(self.start, self.stop):
            for name in model.frees.get(i, ()):
                env.pop(name, None)
        return self.stop


@attrs.frozen
class _Again:
    """ZeRO-3's hooks for backward's second run of a range: gather and free as in forward,
    prefetching the bucket before each (backward's next) instead of the one after it (its
    backward is done), as unpacking a saved weight does."""

    provider: object

    def before_step(self, i: int, env: dict) -> None:
        """Gather the buckets first used at step i; prefetch the one before each."""
        self.provider.before_step(i, env, ahead=-1)

    def after_step(self, i: int) -> None:
        """Free the buckets last used at step i."""
        self.provider.after_step(i)
