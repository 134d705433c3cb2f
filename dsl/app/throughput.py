"""`run`'s model FLOPs utilisation: TFLOP/s per device and MFU beside tokens/s.

Model FLOPs of one step are the single-rank Program's matmul FLOPs as the cost model counts
them (shard/plan/analysis/cost.py `program_work`: 2 x the iteration space of every einsum,
forward), times (1 + its BACKWARD_FACTOR) for the backward, times the batches a step takes
(--accumulate): the work the model needs, whatever the layout, without what recompute runs
again (MFU's convention, as in PaLM and Megatron). Per device: over the world size and the
step's time. The peak a device could reach is `--profile`'s (a preset or a file) in the run's
precision, else read off the GPU's name (the SXM presets of profiles.json); on a CPU without
--profile there is no peak and no MFU.
"""

from __future__ import annotations

import attrs

from soapstone.dsl.lang.errors import BadInput

# a GPU name's marker -> the preset of profiles.json it is, the first that matches (H200
# before H100; an 80 GB A100 names its memory)
GPU_PRESETS = (("H200", "h200"), ("H100", "h100-80gb"), ("A100-SXM4-80GB", "a100-80gb"),
               ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"))


@attrs.frozen
class Peak:
    """A device's peak FLOP/s in the run's precision, and where it was read."""

    flops: float
    source: str


def step_flops(program, accumulate: int = 1) -> float:
    """Model FLOPs of one training step of the single-rank `program` (module doc; a layout's
    Program counts only its rank's local shapes)."""
    from soapstone.shard.plan.analysis.score import model_flops

    return model_flops(program, accumulate)  # explain's and plan's MFU count them alike


def preset_for_gpu(name: str) -> str | None:
    """The profiles.json preset a GPU's name (torch.cuda.get_device_name) matches, or None."""
    upper = name.upper()
    return next((preset for marker, preset in GPU_PRESETS if marker in upper), None)


def find_peak(profile: str | None, precision: str, gpu_name: str | None) -> Peak | None:
    """The peak from --profile, else from the GPU's name; None when neither gives one.
    BadInput when --profile has no peak for `precision`."""
    from soapstone.shard.plan.analysis.hardware import load_profile, presets
    from soapstone.shard.plan.analysis.precision import mfu_peak, missing_peak

    if profile:
        prof = load_profile(profile)
        source = f"--profile {profile}"
    elif gpu_name and preset_for_gpu(gpu_name):
        prof = presets()[preset_for_gpu(gpu_name)]
        source = f"{prof.name}, from the GPU's name {gpu_name!r}; --profile to set another"
    else:
        return None
    lacks = missing_peak(prof.peak_flops, precision)
    if lacks is not None:
        raise BadInput(f"--profile {profile or prof.name}: has no peak_tflops for "
                       f"--precision {precision} (it needs {lacks}, it has "
                       f"{', '.join(prof.peak_flops)})")
    return Peak(prof.peak_flops[mfu_peak(precision)], source)

