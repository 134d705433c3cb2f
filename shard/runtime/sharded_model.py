"""The small runtime that executes a Program on one rank.

`ShardedModel` holds this rank's parameter shards (drawn directly, equal to the same slices of
the tensors the single-rank model draws for the same seed), runs the steps in order with torch
autograd recording them, and sums parameter gradients over the axes the Program says they are
partial on.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from soapstone.comm import autograd as ag
from soapstone.comm import collective_matmul as cm
from soapstone.comm.errors import UserError
from soapstone.comm.launch.device import check_placement
from soapstone.shard.ops.custom import PREFIX as CUSTOM_PREFIX
from soapstone.shard.ops.custom import wrong_shape
from soapstone.shard.ops.dispatch import run_op
from soapstone.shard.ops.einsum import float8_steps
from soapstone.shard.ops.kernels import Shards
from soapstone.shard.parallel.recompute import Segment
from soapstone.shard.parallel.ring_plan import (
    Ring,
    find_rings,
    float8_gathers_beside_rings,
    float8_rings,
    ring_runs_at,
)
from soapstone.shard.parallel.selective import DropPlan
from soapstone.shard.plan.layout import P, RedistributeKind, Split
from soapstone.shard.plan.program import Compute, CopyTo, Program, Value
from soapstone.shard.runtime.float8 import (
    LastCast,
    float8_gather,
    float8_gather_ring,
    float8_matmuls,
    float8_scatter_ring,
)
from soapstone.shard.runtime.fusion import find_fusions, run_fused
from soapstone.shard.runtime.init.param_init import (  # noqa: F401
    TORCH_DTYPES,
    empty_shard,
    init_full,
    init_shard,
)
from soapstone.shard.runtime.overwrite_plan import overwritable


class ShapeMismatch(UserError, RuntimeError):
    """A tensor's shape differs from the one the Program was compiled with (or a dict of
    them, its names or kinds from the Program's)."""


class OpShapeError(RuntimeError):
    """A built-in op produced a local shape other than the compiled one: soapstone's own
    error, so not a UserError: it keeps its traceback, mid-run too (comm/launch/failure.py)."""


def check_mesh(mesh, want: tuple[tuple[str, int], ...], what: str) -> None:
    """ValueError unless `mesh` has exactly the axes and sizes `what` was compiled for."""
    have = dict(getattr(mesh, "shape", {}) or {})
    if have != dict(want):  # a caller's argument (the commands build the mesh from the layout)
        raise ValueError(f"{what} needs a mesh {dict(want)}, got {have or 'none'}")


class ShardedModel:
    """One rank's share of a model compiled to `program`, on `mesh` (None for one rank)."""

    def __init__(self, program: Program, mesh=None, seed: int = 0, custom: dict | None = None,
                 dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 fuse: bool = True, device: torch.device | str | None = None,
                 draw: bool = True, float8: bool = False):
        if program.world_size > 1:
            check_mesh(mesh, program.mesh, f"program {program.model}/{program.parallel}")
        self.program = program
        self.mesh = mesh
        # device: where parameters and activations live (cpu by default; a CUDA device needs
        # a mesh of NCCL communicators: soapstone.comm.launch.device.pick chooses it per rank)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        check_placement(self.device, mesh)
        self.ctx = Shards(program, mesh)
        self.ctx.device = self.device
        self.ctx.rng_seed = seed
        self.custom = {f"custom:{k}": fn for k, fn in (custom or {}).items()}
        # chains of ops run as one fused kernel (shard/runtime/fusion.py); fuse=False runs each op
        self.fused = find_fusions(program) if fuse else {}
        # where each step's inputs are read: a covered step's are read by its fused chain
        self.run_index = {i: f.at for f in self.fused.values() for i in f.covered}
        # `overlap tensor`: collective matmuls, their matmuls run inside the ring at the
        # collective step (shard/parallel/ring_plan.py)
        self.rings = find_rings(program)
        self.ring_stash = None  # inside a `recompute R` range: its Checkpointed (recompute.py)
        ring_steps = ring_runs_at(program)
        self.run_index.update(ring_steps)
        self.covered = set(self.run_index)
        self.frees = _last_uses(program, self.run_index, frozenset(ring_steps))
        # the logits a loss may write its gradient over (shard/runtime/overwrite_plan.py)
        self.ctx.overwritable = overwritable(program, self.fused)
        # `recompute`: the step ranges run as checkpointed segments, by first step
        self.recompute = {a: Segment.of(program, a, b, self.run_index)
                          for a, b in program.recompute}
        # `recompute selective`: values freed after forward's last use, rebuilt for backward
        # (and under sequence parallelism the gathered linear inputs, gathered again)
        self.drop_plan = DropPlan(program, self.run_index) \
            if program.dropped or program.regathered else None
        self._dropping = None
        # dtype: the parameters' and activations' float dtype instead of the spec's (float64
        # for checks). compute_dtype: the activations' only (bf16 under mixed precision,
        # where the parameters start in fp32 and the optimizer keeps them as fp32 masters).
        self.compute_dtype = compute_dtype or dtype
        # float8: the weight matmuls in float8 (--precision float8), refused up front where
        # a width is no multiple of 16 (Float8Shape, a UserError)
        self.float8_last = LastCast() if float8 else None
        # and sequence parallelism's gathers of their inputs in float8 too (einsum.py)
        self.float8_gathered = set()
        # and `overlap tensor`'s rings of float8 matmuls, at the blocking steps' scales
        self.float8_rings = float8_rings(program) if float8 else {}
        # the dims each float8 matmul contracts, found once (a walk of the whole program)
        self.float8_ks = float8_steps(program) if self.float8_rings else {}
        if float8:
            self.ctx.float8 = float8_matmuls(program, self.float8_last)
            self.float8_gathered = {program.steps[i].out
                                    for i in float8_gathers_beside_rings(program)}
        # each rank draws only its own slice of every parameter (shard/runtime/init/param_init.py);
        # draw=False leaves them empty for weights loaded right after (--init, --resume)
        def first(p):
            box = self.ctx.local_slices(program.value(p.name))
            return init_shard(p, seed, box, self.device) if draw else \
                empty_shard(p, box, self.device)

        self.params: dict[str, torch.nn.Parameter] = {
            p.name: torch.nn.Parameter(_cast(first(p), dtype)) for p in program.params}

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return _cast(t, self.compute_dtype)

    # --- parameters ------------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        """The local parameter shards, in program order (for a torch optimizer)."""
        return list(self.params.values())

    def named_parameters(self):
        """(qualified name, local shard) pairs."""
        return iter(self.params.items())

    def local(self, full: torch.Tensor, value: Value) -> torch.Tensor:
        """This rank's slice of a full tensor laid out as `value`."""
        want = tuple(dict(self.program.dims)[d] for d in value.dims)
        if tuple(full.shape) != want:
            dims = ", ".join(f"{d}={s}" for d, s in zip(value.dims, want, strict=True))
            raise ShapeMismatch(f"{value.name}: expected global shape [{dims}], got "
                                f"{list(full.shape)}")
        return full[self.ctx.local_slices(value)].contiguous()

    def gather(self, t: torch.Tensor, value: Value) -> torch.Tensor:
        """The full tensor from this rank's piece: allgather splits, allreduce partials."""
        t = t.detach()
        # innermost first: a dim split over two axes nests the second's pieces in the first's
        for axis, placement in reversed(value.layout.placements):
            comm = self.mesh.comm(axis)
            if placement == P:
                t = comm.allreduce(t.clone())
            elif isinstance(placement, Split):
                d = value.dims.index(placement.dim)
                t = comm.allgather(t.contiguous(), dim=d)
                if self.ctx.balanced_over(value, placement.dim) == axis:  # natural order
                    t = self.ctx.reorder(t, d, comm.size, back=True)
            else:  # Owned: only the owner holds it
                t = t.contiguous()
                comm.broadcast(t, src=placement.coord)
        return t

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as its full tensor (collective: all ranks must call it)."""
        return {n: self.gather(p, self.program.value(n)) for n, p in self.params.items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) tensors, keeping this rank's slices; ShapeMismatch unless
        `state` holds exactly this Program's parameters, each a float tensor of its shape."""
        # a caller's argument (the commands load checkpoints through shard/checkpoint): a key
        # left over is a misspelt or another model's parameter, never one to skip silently
        missing = sorted(set(self.params) - set(state))
        extra = sorted(str(k) for k in set(state) - set(self.params))
        if missing or extra:
            said = [f"missing {len(missing)} of its parameters ({', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''})"] if missing else []
            said += [f"{len(extra)} key(s) naming none ({', '.join(extra[:3])}"
                     f"{', ...' if len(extra) > 3 else ''})"] if extra else []
            raise ShapeMismatch(f"load_full_state_dict (program {self.program.model}): "
                                f"{'; '.join(said)}; the keys are the parameter names "
                                "full_state_dict() gives")
        for n, p in self.params.items():
            t = state[n]
            if not isinstance(t, torch.Tensor) or t.is_floating_point() != p.is_floating_point():
                got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) \
                    else f"of type {type(t).__name__}"
                raise ShapeMismatch(f"load_full_state_dict: {n} is {got}; pass a torch.Tensor "
                                    f"of its kind ({p.dtype}), cast on purpose if at all")
        # every shape checked (by local) before the first copy: no half-loaded model
        pieces = {n: self.local(state[n], self.program.value(n)) for n in self.params}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(pieces[n].to(p.dtype))

    # --- forward and backward --------------------------------------------------------------

    def forward(self, inputs: dict[str, torch.Tensor],
                local: dict[str, torch.Tensor] | None = None, *, rng_step: int = 0,
                window: dict[str, tuple[int, int]] | None = None,
                provider=None) -> dict[str, torch.Tensor]:
        """Run the steps on full inputs (every rank passes the same) or, for names in `local`,
        on this rank's shards already (a pipeline stage's received tensors); local outputs.

        rng_step: the training step (dropout masks are a function of seed, step and value).
        window: where this call's batch sits in the global batch when it runs a microbatch
        (dim -> (offset, global size); see ops.Shards). provider: ZeRO-3's parameter source
        (shard/parallel/zero.py), asked for parameters step by step; default: this model's own."""
        self.ctx.rng_step = rng_step
        self.ctx.window = window or {}
        env: dict[str, torch.Tensor] = {}
        for name in self.program.inputs:
            if local and name in local:
                env[name] = local[name]
            elif name in inputs:
                env[name] = self._cast(self.local(inputs[name], self.program.value(name))
                                       .to(self.device))
            else:  # a caller's argument: the commands' tasks make every input
                raise ShapeMismatch(f"forward: missing input {name!r}; the program's inputs "
                                    f"are {', '.join(self.program.inputs)}")
        env.update(self.params)  # under ZeRO-3 the provider gathers their data step by step
        self._dropping = self.drop_plan.begin(self, provider) \
            if self.drop_plan and torch.is_grad_enabled() else None
        with provider.forward_context() if provider else contextlib.nullcontext():
            i = 0
            while i < len(self.program.steps):
                if i in self.recompute:
                    i = self.recompute[i].run(self, env, provider)
                    continue
                self._step(i, env, provider)
                i += 1
        if self._dropping is not None:
            self._dropping.end()
            self._dropping = None
        if self.float8_last is not None:
            self.float8_last.release()
        return {o.name: env[o.value] for o in self.program.outputs}

    def _step(self, i: int, env: dict[str, torch.Tensor], provider) -> None:
        """Run Program step i on `env` (with ZeRO-3's gathers and frees around it)."""
        step = self.program.steps[i]
        drops = self._dropping
        if provider:
            provider.before_step(i, env)
        if drops is not None:
            drops.before_step(i, env)
        if i in self.fused:
            f = self.fused[i]
            out = run_fused(f, env, self.program, self.ctx, self.ctx.float8)
            env[f.out] = self._checked(step, out, f.out)
        elif i in self.rings:
            self._ring(self.rings[i], env)
        elif i not in self.covered:
            env[step.out] = self._run(step, env)
        if drops is not None:
            drops.after_step(i, self.fused[i].out if i in self.fused else step.out, env)
        for name in self.frees.get(i, ()):
            t = env.pop(name, None)  # last use: autograd keeps what backward needs, no more
            if drops is not None and t is not None:
                drops.free(name, t)
        if provider:
            provider.after_step(i)

    __call__ = forward

    def _run(self, step, env: dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(step, Compute):
            if step.owner and self.mesh.coord(step.owner[0]) != step.owner[1]:
                return self._placeholder(step, env)
            y = run_op(step, [env[a] for a in step.args], self.ctx, self.custom)
            return self._checked(step, y, step.out)
        x = env[step.src]
        comm = self.mesh.comm(step.axis)
        if isinstance(step, CopyTo):
            return ag.copy_to(x, comm)
        src = self.program.value(step.src)
        # a balanced split's pieces are zigzag chunks: the whole dim is permuted into their
        # rank order before it is cut over its own axis, and back into natural order once
        # gathered; a second axis (sequence parallel) cuts and gathers the cp-local order as is
        into, out_of = (p.dim if isinstance(p, Split) and p.dim in self.program.balanced
                        and self.ctx.balanced_over(v, p.dim) == step.axis else None
                        for p, v in ((step.to, self.program.value(step.out)),
                                     (step.frm, src)))
        if into is not None:
            x = self.ctx.reorder(x, src.dims.index(into), comm.size)
        y = self._redistribute(step, x, comm, src)
        if out_of is not None:
            y = self.ctx.reorder(y, src.dims.index(out_of), comm.size, back=True)
        return y

    def _redistribute(self, step, x: torch.Tensor, comm, src: Value) -> torch.Tensor:
        if not src.is_float and step.kind in (RedistributeKind.ALLGATHER, RedistributeKind.SLICE):
            # integer data (token ids): no gradient to route
            if step.kind is RedistributeKind.ALLGATHER:
                return comm.allgather(x.contiguous(), dim=src.dims.index(step.frm.dim))
            return x.chunk(comm.size, src.dims.index(step.to.dim))[comm.rank].contiguous()
        if step.out in self.float8_gathered:
            return float8_gather(x, comm, src.dims.index(step.frm.dim), step.grad)
        return REDISTRIBUTE[step.kind](x, comm, step, src.dims.index)

    def _ring(self, ring: Ring, env: dict[str, torch.Tensor]) -> None:
        """A collective matmul: the gather with its readers, or a matmul with its scatter."""
        step, prog = self.program.steps[ring.at], self.program
        comm = self.mesh.comm(step.axis)
        mms = [prog.steps[j] for j in ring.matmuls]
        weights = [next(a for a in s.args if a in self.params) for s in mms]
        if ring.at in self.float8_rings:
            return self._float8_ring(ring, env, mms, weights)
        fns = [functools.partial(self._matmul, s, w) for s, w in zip(mms, weights, strict=True)]
        if ring.kind is RedistributeKind.ALLGATHER:
            dim = prog.value(step.src).dims.index(ring.dim)
            ys = cm.all_gather_apply(env[step.src], comm, dim, fns, [env[w] for w in weights],
                                     [prog.value(s.out).dims.index(ring.dim) for s in mms],
                                     self.ring_stash)
            for s, y in zip(mms, ys, strict=True):
                env[s.out] = self._checked(s, y, s.out)
            return
        x = next(a for a in mms[0].args if a != weights[0])
        env[step.out] = cm.apply_reduce_scatter(
            env[x], comm, prog.value(x).dims.index(ring.dim), fns[0], env[weights[0]],
            self.ring_stash)

    def _float8_ring(self, ring: Ring, env, mms: list[Compute], weights: list[str]) -> None:
        """A ring of float8 matmuls (shard/runtime/float8.py `Float8GatherRing`,
        `Float8ScatterRing`): the blocking float8 step's results, bit for bit."""
        step, prog = self.program.steps[ring.at], self.program
        comm = self.mesh.comm(step.axis)
        ks = [self.float8_ks[j] for j in ring.matmuls]  # the dims each contracts
        scales = [s.attr("scale") for s in mms]
        ws = [env[w] for w in weights]
        if ring.kind is RedistributeKind.ALLGATHER:
            dim = prog.value(step.src).dims.index(ring.dim)
            ys = float8_gather_ring(env[step.src], comm, dim, ws, ks, scales)
            for s, y in zip(mms, ys, strict=True):
                env[s.out] = self._checked(s, y, s.out)
            return
        x = mms[0].args[0]
        env[step.out] = float8_scatter_ring(env[x], comm, prog.value(x).dims.index(ring.dim),
                                            ws[0], ks[0], scales[0])

    def _matmul(self, step: Compute, weight: str, x: torch.Tensor, w: torch.Tensor):
        return run_op(step, [w if a == weight else x for a in step.args], self.ctx, self.custom)

    def _checked(self, step: Compute, y: torch.Tensor, name: str) -> torch.Tensor:
        v = self.program.value(name)
        if tuple(y.shape) == v.local_shape:
            return y
        if step.kind.startswith(CUSTOM_PREFIX):  # a plugin's bug: one line naming its layer
            raise wrong_shape(step, list(y.shape), list(v.local_shape), v.dims)
        raise OpShapeError(
            f"{step.kind} producing {name}: local shape {list(y.shape)} differs from the "
            f"compiled {list(v.local_shape)} (dims {', '.join(v.dims)}); this is soapstone's "
            "error, not the input's: please report it with the spec and layout")

    def _placeholder(self, step: Compute, env: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a rank off a branch holds for the branch's op: zeros, wired to the op's inputs
        so that backward passes through the same collectives, in the same order, as on the
        owner (with zero gradients)."""
        v = self.program.value(step.out)
        y = torch.zeros(v.local_shape, device=self.device, dtype=self._cast(
            torch.zeros((), dtype=TORCH_DTYPES[v.dtype])).dtype)
        for a in step.args:
            t = env[a]
            if t.is_floating_point() and t.requires_grad:
                y = y + 0 * t.sum()
        return y

    def loss_value(self, outputs: dict[str, torch.Tensor]) -> float:
        """The global loss (summed over the axes it is partial on), as a float."""
        out = self.program.loss
        return float(self.gather(outputs[out.name], self.program.value(out.value)))


# Each redistribution kind of shard/plan/collectives.py as the autograd collective that runs it
# (forward and, through autograd, the backward the table names): (x, comm, step, dim index).
K = RedistributeKind
REDISTRIBUTE = {
    K.ALLREDUCE: lambda x, comm, step, dim: ag.reduce_from(x, comm),
    K.REDUCE_SCATTER: lambda x, comm, step, dim: ag.reduce_scatter(x, comm, dim(step.to.dim)),
    K.ALLGATHER: lambda x, comm, step, dim: ag.all_gather(x, comm, dim(step.frm.dim),
                                                          grad=step.grad),
    K.SLICE: lambda x, comm, step, dim: ag.split(x, comm, dim(step.to.dim)),
    K.ALLTOALL: lambda x, comm, step, dim: ag.all_to_all(x, comm, split_dim=dim(step.to.dim),
                                                         concat_dim=dim(step.frm.dim)),
    K.BROADCAST: lambda x, comm, step, dim: ag.broadcast(x.contiguous(), comm,
                                                         src=step.frm.coord),
    # a branch's value as a partial sum: zeros off the owner
    K.ZERO_FILL: lambda x, comm, step, dim: x if comm.rank == step.frm.coord else x * 0,
}


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _last_uses(program: Program, runs_at: dict[int, int],
               made: frozenset[int] = frozenset()) -> dict[int, list[str]]:
    """Step index -> the values whose last use it is (a fused chain uses its inputs where it
    runs), so the forward drops them at once: intermediates are freed as soon as no later
    step reads them, as in eager torch. Program outputs and parameters are kept. `made`: the
    steps of runs_at that make their outputs where they run (a ring's matmuls)."""
    keep = {o.value for o in program.outputs} | {p.name for p in program.params}
    # never materialised: fused away
    keep |= {program.steps[i].out for i in runs_at if i not in made}
    last: dict[str, int] = {}
    for i, step in enumerate(program.steps):
        for a in step.args if isinstance(step, Compute) else (step.src,):
            last[a] = runs_at.get(i, i)
    frees: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            frees.setdefault(i, []).append(name)
    return frees
