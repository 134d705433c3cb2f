"""Selective recompute in the runtime: dropped values are freed after forward's last use of
them and rebuilt just before backward needs them.

The compiler names the values (Program.dropped, the rule of shard/parallel/selective_plan.py).
Autograd keeps them anyway, inside the kernels that read them (a matmul keeps its input), so the
runtime frees their storage instead of their tensors: once forward is done with a value, its
storage shrinks to nothing, while the kernels' saved references still point at it. Before the
backward of any step that reads it (a pre-hook on that step's output node), the value's
steps run again without autograd on the inputs forward gave them, and the result is copied
into the same storage, so every saved reference sees it again; autograd frees it as usual
once the last of them is done. This is Megatron's output-discarding checkpoint, and it keeps
the matmul outputs without running a matmul twice.

Sequence parallelism's gathered linear inputs (Program.regathered) go the same way: their
recipe is the all-gather step itself, run again on the kept shard before the first of the
linears' backward (Megatron's approach: the shard kept, the gather repeated). Every rank runs
the same backward graph, so the gathers meet in the same order on every rank.

Rebuilding draws the same dropout masks: the model's Shards context is set back to the
forward's settings (training step, microbatch window) around the second run. The selective
steps make no collective (the rule refuses distributed forms) and read no ZeRO-3 parameter;
the one collective run again is a regathered value's all-gather, which the plan counts (a
float8 gather's stand-in holds no bytes: its float8 values are what is freed and refilled).
`recompute ops` (op_policy_plan.py) also runs weight matmuls again: under ZeRO-3 their
weights' bucket is gathered at the rebuild (zero.py `gather_for`), which is backward's own
gather of it, moved a little earlier: no gather is added.
"""

from __future__ import annotations

import torch

from soapstone.shard.parallel.regather_plan import gather_step
from soapstone.shard.parallel.selective_plan import rebuild_steps
from soapstone.shard.plan.program import Compute, Program
from soapstone.shard.runtime.float8 import float8_bytes
from soapstone.shard.runtime.memory import storage_resized


class Dropping:
    """What one forward call needs to free and later rebuild the values of Program.dropped."""

    def __init__(self, model, plan: DropPlan, provider=None):
        self.model, self.plan, self.provider = model, plan, provider
        self.held: dict[str, torch.Tensor] = {}  # rebuild inputs, captured as steps read them
        self.recipes: dict[str, _Recipe] = {}
        ctx = model.ctx
        self.settings = (ctx.rng_step, dict(ctx.window), ctx.training)

    def before_step(self, i: int, env: dict[str, torch.Tensor]) -> None:
        """Keep a reference to what step i reads that a rebuild will read again."""
        for a in self.plan.captures.get(i, ()):
            if a in env:
                self.held[a] = env[a]

    def after_step(self, i: int, out: str, env: dict[str, torch.Tensor]) -> None:
        """Step i made `out`: start a dropped value's recipe, and hook the backward of a step
        reading dropped values so that they are rebuilt before it runs."""
        if out in self.plan.chains:
            self.recipes[out] = _Recipe(self, out, env[out])
        hooked = [self.recipes[a] for a in self.plan.reads.get(i, ()) if a in self.recipes]
        if out in self.recipes:
            hooked.append(self.recipes[out])  # a kernel may keep its own output (softmax)
        node = env[out].grad_fn if out in env else None
        if hooked and node is not None:
            node.register_prehook(lambda grads, rs=tuple(hooked): _restore_all(rs))

    def end(self) -> None:
        """Forward is done: drop the references kept for recipes not started (what a freed
        value needs, its recipe holds)."""
        self.held.clear()

    def free(self, name: str, t: torch.Tensor) -> None:
        """Forward's last use of `name`: shrink a dropped value's storage to nothing."""
        r = self.recipes.get(name)
        if r is not None:
            r.discard(t)


def _restore_all(recipes) -> None:
    for r in recipes:
        r.restore()


class _Recipe:
    """One dropped value: its tensor, and how to compute it again."""

    def __init__(self, owner: Dropping, name: str, t: torch.Tensor):
        self.owner, self.name, self.tensor = owner, name, t
        self.freed = False

    def discard(self, t: torch.Tensor) -> None:
        """Free the storage when the tensor owns exactly it (else keep it: a layout the copy
        back could not restore)."""
        if t.grad_fn is None:
            return
        t = float8_bytes(t)
        st = t.untyped_storage()
        if not t.is_contiguous() or t.storage_offset() != 0 \
                or st.nbytes() != t.numel() * t.element_size():
            return
        self.inputs = {a: self.owner.held[a] for a in self.owner.plan.inputs[self.name]}
        old = st.data_ptr()
        st.resize_(0)
        storage_resized(st, old)
        self.freed = True

    def restore(self) -> None:
        """Run the value's steps again on forward's inputs and refill its storage."""
        if not self.freed:
            return
        self.freed = False
        owner = self.owner
        model, ctx = owner.model, owner.model.ctx
        for a in owner.plan.inputs[self.name]:
            if a in owner.recipes:  # a dropped input: rebuilt first
                owner.recipes[a].restore()
        if owner.provider is not None:  # ZeRO-3: the weights of a rebuilt matmul (recompute ops)
            owner.provider.gather_for([a for a in self.inputs if a in model.params])
        then = (ctx.rng_step, ctx.window, ctx.training)
        ctx.rng_step, ctx.window, ctx.training = owner.settings[0], dict(owner.settings[1]), \
            owner.settings[2]
        try:
            with torch.no_grad():
                local = dict(self.inputs)
                for i in owner.plan.chains[self.name]:
                    step = model.program.steps[i]
                    local[step.out] = model._run(step, local)
                fresh = float8_bytes(local[self.name]).contiguous()
        finally:
            ctx.rng_step, ctx.window, ctx.training = then
        st = float8_bytes(self.tensor).untyped_storage()
        st.resize_(fresh.untyped_storage().nbytes())
        storage_resized(st, 0)
        st.copy_(fresh.untyped_storage())
        # autograd's saved references hold the storage from here (the hooks that hold this
        # recipe live as long as the graph: keeping the tensor would keep it to the end)
        self.inputs, self.tensor = {}, None


class DropPlan:
    """Per Program, where the dropped values are made, read and rebuilt from (by step index,
    a fused chain's reads at the step it runs at)."""

    def __init__(self, program: Program, run_index: dict[int, int]):
        steps = program.steps
        dropped = set(program.dropped) | set(program.regathered)
        self.chains = {n: rebuild_steps(program, n) for n in program.dropped}
        # sequence parallelism's gathered linear inputs: their gather runs again on the shard
        self.chains.update({n: (gather_step(program, n),) for n in program.regathered})
        made = {n: {steps[i].out for i in c} for n, c in self.chains.items()}
        self.inputs = {n: tuple(dict.fromkeys(a for i in c for a in _reads(steps[i])
                                              if a not in made[n]))
                       for n, c in self.chains.items()}
        self.captures: dict[int, list[str]] = {}
        self.reads: dict[int, list[str]] = {}
        wanted = {a for ins in self.inputs.values() for a in ins}
        for i, s in enumerate(steps):
            at = run_index.get(i, i)
            for a in _reads(s):
                if a in wanted:
                    self.captures.setdefault(i, []).append(a)
                if a in dropped:
                    self.reads.setdefault(at, []).append(a)

    def begin(self, model, provider=None) -> Dropping:
        """The state of one forward call (provider: ZeRO-3's, which rebuilds ask for weights)."""
        return Dropping(model, self, provider)


def _reads(step) -> tuple[str, ...]:
    return step.args if isinstance(step, Compute) else (step.src,)
