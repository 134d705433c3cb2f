"""Optimizers over flat fp32 buffers, and `build_optimizer`, the one entry point for training.

    opt = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.0, grad_clip=1.0, zero=1)
    for batch in data:
        model(batch)["loss"].backward()   # gradient buckets reduce while backward runs
        opt.step()                        # finish reduction, clip by global norm, update
        opt.zero_grad()
    opt.grad_norm                         # the global gradient norm of the last step
                                          # (None with track_norm=False and no grad_clip)

`zero` picks the ZeRO stage (0 plain data parallel, 1 optimizer state sharded, 2 gradients too,
3 parameters too); see data_parallel.py for the buckets and zero.py for stage 3. The update
rules run on flat fp32 (fp64 for a float64 model) master tensors, one bucket's slice at a
time, and are elementwise, so a sharded update of a slice computes, element by element, what
the single-rank optimizer computes:
- AdamW: torch's fused kernel `torch._fused_adamw_`, the arithmetic of
  torch.optim.AdamW(fused=True) (the tests check it bitwise); its CPU kernel needs
  torch >= 2.4, pyproject's lower bound.
- SGD with momentum: written out here with the arithmetic of torch.optim.SGD.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from soapstone.shard.parallel.data_parallel import GradReducer
from soapstone.shard.parallel.offload import HostStep
from soapstone.shard.parallel.offload import wanted as offload_wanted
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.train.errors import SettingError

OPTIMIZERS = ("adamw", "sgd")  # the update rules build_optimizer knows


class FlatAdamW:
    """torch.optim.AdamW's update (amsgrad off) on one flat fp32 slice."""

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def init_state(self, p: torch.Tensor) -> dict:
        """Zeroed moments and a step counter for master slice `p`."""
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                "step": torch.zeros((), dtype=torch.float32, device=p.device)}

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, step: int) -> None:
        """One step on master slice `p` (fp32/fp64, always: the fused kernel's dtypes) with
        gradient `g`; `step` counts from 1."""
        beta1, beta2 = self.betas
        state["step"].fill_(step)
        torch._fused_adamw_([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [],
                            [state["step"]], lr=self.lr, beta1=beta1, beta2=beta2,
                            weight_decay=self.weight_decay, eps=self.eps, amsgrad=False,
                            maximize=False)


class FlatSGD:
    """torch.optim.SGD's update (dampening 0, no nesterov) on one flat fp32 slice."""

    def __init__(self, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def init_state(self, p: torch.Tensor) -> dict:
        """A momentum buffer for master slice `p` (nothing without momentum)."""
        return {"momentum_buffer": torch.zeros_like(p)} if self.momentum else {}

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, step: int) -> None:
        """One step on master slice `p` with gradient `g`; `step` counts from 1."""
        d = g.add(p, alpha=self.weight_decay) if self.weight_decay else g
        if self.momentum:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(d)
            else:
                buf.mul_(self.momentum).add_(d)
            d = buf
        p.add_(d, alpha=-self.lr)


class Optimizer:
    """Gradient reduction + global-norm clipping + a flat update rule, for one ShardedModel."""

    def __init__(self, model, rule, grad_clip: float | None, reducer: GradReducer,
                 offload: bool = False, track_norm: bool = True):
        self.model = model
        self.rule = rule
        self.grad_clip = grad_clip
        self.reducer = reducer
        # whether step() computes the global norm when no clipping needs it: a pass over
        # every gradient byte (3 ms of a 190 ms step at 21M params) that nothing else reads
        self.track_norm = track_norm
        self.grad_norm: float | None = 0.0
        self.steps = 0
        # called at the start of step(), before the masters or the state change: an
        # asynchronous checkpoint whose copy of them is still being made waits there
        self.before_update: list = []
        # `offload optimizer` with the parameters on a GPU: state and update in host memory
        # (shard/parallel/offload.py); on a CPU run they are there already
        segs = reducer.segments()
        self.host = HostStep(segs, rule) if offload and offload_wanted(segs) else None
        self.state = self.host.state if self.host else [
            rule.init_state(seg.master) if seg.master is not None else {} for seg in segs]

    @property
    def zero(self) -> ZeroStage:
        """The ZeRO stage."""
        return self.reducer.zero

    def no_sync(self):
        """Context: backward passes inside accumulate gradients without reducing them (stages
        0 and 1; stages 2 and 3 keep only gradient shards, so they reduce-scatter every
        microbatch and accumulate the shards)."""
        return self.reducer.no_sync()

    def one_backward(self):
        """Context: several autograd calls inside are one backward for the gradient buckets
        (a zero-bubble schedule's W, shard/runtime/split_backward.py)."""
        return self.reducer.one_backward()

    @property
    def param_provider(self):
        """ZeRO-3's parameter source for ShardedModel.forward(provider=...); None otherwise."""
        return self.reducer.provider

    def unreduced_grad(self, name: str) -> torch.Tensor:
        """A deferred parameter's local gradient before its reduction: the pre-reduction hook
        for a caller that must add to it first (see data_parallel.py, deferred parameters)."""
        return self.reducer.unreduced_grad(name)

    def grad_norm_sq(self, weights: dict[str, float] | None = None) -> float:
        """The squared global gradient norm of this model after reduction (collective
        over the model's mesh); weights scale deferred parameters' terms."""
        self.reducer.finish()
        return self.reducer.global_grad_norm_sq(weights)

    def step(self, grad_norm: float | None = None) -> None:
        """Finish gradient reduction, clip by the global norm (if grad_clip), update params.
        grad_norm: a norm the caller computed over more than this model (a pipeline's norm
        over every pipeline stage, Executor.step); default: this model's own global norm, or
        None without grad_clip and track_norm (nothing reads it)."""
        for hook in self.before_update:
            hook()
        self.reducer.finish()
        self.steps += 1
        segs = self.reducer.segments()
        if grad_norm is None and (self.grad_clip is not None or self.track_norm):
            grad_norm = self.reducer.global_grad_norm()
        self.grad_norm = grad_norm
        if self.grad_clip is not None:
            coef = min(self.grad_clip / (self.grad_norm + 1e-6), 1.0)
            if coef < 1.0:
                for seg in segs:
                    if seg.grad is not None:
                        seg.grad.mul_(coef)
        with torch.no_grad():
            if self.host is not None:
                self.host.step(segs, self.rule, self.steps)
            else:
                for seg, state in zip(segs, self.state, strict=True):
                    if seg.master is not None and seg.grad is not None and seg.master.numel():
                        self.rule.update(seg.master, seg.grad, state, self.steps)
        self.reducer.publish_params()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following updates (a schedule's value for the step)."""
        self.rule.lr = check_setting("lr", lr)

    def zero_grad(self) -> None:
        """Clear the gradients (the flat buffers are zeroed, not freed)."""
        self.reducer.zero_grad()

    def gathered(self):
        """Context: under ZeRO-3, every parameter holds its full value inside it (for
        model.full_state_dict() or evaluation); a no-op otherwise."""
        return self.reducer.gathered() if self.reducer.zero.shards_params \
            else contextlib.nullcontext()


def check_setting(name: str, value, positive: bool = False) -> float:
    """`value` as a float where it is a finite real number >= 0 (> 0 where `positive`); else
    SettingError naming the setting. A NaN, negative or string rate would reach the update
    kernels and train silently on NaN weights, or against the gradient."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
            and value.dtype != torch.bool:
        value = value.item()  # a schedule written with torch math hands one-element tensors
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise SettingError(f"{name}={value!r}: give a finite number {bound}")
    return float(value)


def build_optimizer(model, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.0,
                    momentum: float = 0.9, grad_clip: float | None = None, zero: int | None = None,
                    bucket_mb: float = 25.0, data_axes: tuple[str, ...] | None = None,
                    deferred: tuple[str, ...] = (), overlap: bool = True,
                    betas=(0.9, 0.999), eps: float = 1e-8,
                    offload: bool | None = None, track_norm: bool = True) -> Optimizer:
    """An optimizer for `model` (a ShardedModel) that also owns its gradient reduction.

    name: "adamw" | "sgd" (momentum). zero: ZeRO stage 0..3 over the data and context
    parallel axes (default: the Program's, from the spec's `zero` statement). data_axes: the
    axes to shard over (default: the Program's zero_axes, its sample and context-parallel
    axes). bucket_mb: gradient bucket size (the first bucket is 1 MiB at most, as in PyTorch
    DDP). deferred: parameters whose gradients the caller sums
    further before reduction (weights tied across pipeline stages). Mixed precision follows
    the model: built with compute_dtype=torch.bfloat16, it computes in bf16 while the
    optimizer keeps fp32 master weights, gradient buffers and state. overlap=False reduces
    only after backward (for benchmarks). offload: master copies and state in host memory
    when the parameters are on a GPU (default: the Program's, from `offload optimizer`).
    track_norm=False: step() computes the global gradient norm only when grad_clip needs it
    (opt.grad_norm is None otherwise), as a loop that neither clips nor logs it would.
    """
    lr = check_setting("lr", lr)
    weight_decay = check_setting("weight_decay", weight_decay)
    momentum = check_setting("momentum", momentum)
    if grad_clip is not None:  # 0 would zero every gradient, a negative one reverse them
        grad_clip = check_setting("grad_clip", grad_clip, positive=True)
    if name == "adamw":
        rule = FlatAdamW(lr, betas, eps, weight_decay)
    elif name == "sgd":
        rule = FlatSGD(lr, momentum, weight_decay)
    else:
        raise SettingError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    if zero not in (None, 0, 1, 2, 3):
        raise SettingError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    reducer = GradReducer(model, zero=zero, bucket_mb=bucket_mb, data_axes=data_axes,
                          deferred=deferred, overlap=overlap)
    if offload is None:
        offload = model.program.offload
    return Optimizer(model, rule, grad_clip, reducer, offload, track_norm)
