"""A layout's score on a hardware profile, as `run` would report it: the predicted step time
(cost.py), the model FLOP/s per device it means, the MFU and the tokens per second
(`explain --profile`, `plan`'s table).

Model FLOPs follow `run`'s convention (dsl/app/throughput.py): the single-rank Program's
matmul FLOPs (2 x the iteration space of every einsum, forward, `cost.program_work`) x (1 +
BACKWARD_FACTOR), whatever the layout, without what recompute runs again (MFU's convention,
as in PaLM and Megatron). Per device: over the world size and the predicted step. MFU: that
over one device's peak in the run's precision (the profile's `peak_tflops`, not its
matmul efficiency). Tokens per step: the elements of the labels input of the global batch
(shard/data/tasks.py's `tokens`: else the first input's), so tokens/s is what `run` prints.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.plan.analysis.cost import BACKWARD_FACTOR, StepTime, Work, program_work
from soapstone.shard.plan.analysis.hardware import Profile, ProfileError
from soapstone.shard.plan.analysis.precision import mfu_peak, missing_peak
from soapstone.shard.plan.program import Program


def model_flops(program: Program, accumulate: int = 1) -> float:
    """Model FLOPs of one training step of the single-rank `program` (module doc)."""
    return program_work(program).matmul_flops * (1 + BACKWARD_FACTOR) * accumulate


def tokens_per_step(program: Program) -> int:
    """Tokens (or samples) of one global batch of the single-rank `program`: the elements of
    its labels input, else of its first input (as `run` counts them)."""
    name = next((r.name for r in program.roles if r.role == "labels"), None)
    name = name or (program.inputs[0] if program.inputs else None)
    if name is None:
        return 0
    sizes = dict(program.dims)
    return math.prod(sizes[d] for d in program.value(name).dims)


def graph_work(graph) -> list[Work]:
    """Each pipe rank's forward work per microbatch: the sum over its virtual stages."""
    work = [Work()] * graph.pipe
    for st in graph.stages:
        work[st.rank] = work[st.rank] + program_work(st.program)
    return work


def peak_of(profile: Profile, precision: str) -> float:
    """One device's peak FLOP/s in `precision` (ProfileError, a user error, when the profile
    gives none)."""
    lacks = missing_peak(profile.peak_flops, precision)
    if lacks is not None:
        raise ProfileError(f"profile {profile.name} has no peak_tflops for {lacks!r}, which "
                           f"--precision {precision} needs (it has "
                           f"{', '.join(profile.peak_flops)}); pick a profile with one or "
                           f"another --precision")
    return profile.peak_flops[mfu_peak(precision)]


@attrs.frozen
class Score:
    """What a step of a layout is predicted to achieve on a profile (module doc)."""

    step_s: float  # the predicted step time
    model_flops: float  # one step's model FLOPs, every device together
    tokens: int  # per step
    devices: int
    peak_flops: float  # one device's, in the precision
    profile: str
    precision: str

    @property
    def tflops_per_device(self) -> float:
        """Model TFLOP/s per device."""
        return self.model_flops / self.devices / self.step_s / 1e12 if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model FLOP/s per device over its peak."""
        return self.tflops_per_device * 1e12 / self.peak_flops if self.peak_flops else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second, every device together."""
        return self.tokens / self.step_s if self.step_s else 0.0

    def to_data(self) -> dict:
        """JSON-ready, with the derived figures."""
        return attrs.asdict(self) | {"tflops_per_device": self.tflops_per_device,
                                     "mfu": self.mfu, "tokens_per_s": self.tokens_per_s}

    def line(self) -> str:
        """One line for `explain`."""
        return (f"predicted on {self.devices} x {self.profile} ({self.precision}): step "
                f"{self.step_s:.4g} s, {self.tflops_per_device:.3g} TFLOP/s per device, MFU "
                f"{self.mfu:.1%}, {self.tokens_per_s:.4g} tokens/s")


def score(time: StepTime, program: Program, devices: int, profile: Profile,
          precision: str) -> Score:
    """The score of a step predicted to take `time` on `devices` devices of `profile`, the
    model being the single-rank `program`."""
    return Score(time.total, model_flops(program), tokens_per_step(program), devices,
                 peak_of(profile, precision), profile.name, precision)


def format_time(t: StepTime) -> str:
    """Where the predicted step goes, for `explain`."""
    parts = [("compute", t.compute), ("blocking comm", t.blocking_comm),
             ("bubble", t.bubble), ("exposed param gathers", t.param_gathers),
             ("exposed grad sync", t.grad_sync), ("after the step", t.after_step),
             ("optimizer", t.optimizer)]
    text = "  step time: " + ", ".join(f"{k} {v:.4g} s" for k, v in parts if v)
    if t.ring_sends:
        text += (f"\n  rings (overlap tensor): sends {t.ring_sends:.4g} s, {t.ring_hidden:.4g} s "
                 f"of it hidden behind their matmuls, {t.ring_sends - t.ring_hidden:.4g} s in "
                 "blocking comm")
    return text
