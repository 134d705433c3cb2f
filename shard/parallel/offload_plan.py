"""Optimizer offload (`offload optimizer`, ZeRO-Offload): what it moves, in figures and words
(pure data, no torch; the runtime half is shard/parallel/offload.py).

On a GPU run the optimizer's fp32 master weights and its state live in host memory and the
update runs there; the device keeps its parameters, gradients and activations. explain's
figures per rank, from its Estimate:
- device with offload: everything but the optimizer state and, under bf16, the fp32 masters
  kept apart from the bf16 copy (parameters, gradients, activations, working set); without:
  explain's total;
- host: the optimizer state, a master copy of the parameters this rank updates (fp32, 4
  bytes an element) and a gradient buffer of the same size (the copy the update reads).
On a CPU run the state already lives in host memory: the statement changes nothing there,
and check, show and run say so in one line.
"""

from __future__ import annotations

import attrs

from soapstone.shard.plan.analysis.explain import OPTIMIZER_STATE

NOTE = ("offload optimizer: a no-op on a CPU run, where the optimizer state already lives in "
        "host memory; on a GPU run the fp32 master weights and optimizer state live in host "
        "memory and the step runs there")
CPU_RUN_NOTE = ("offload optimizer: a no-op on this CPU run (the optimizer state already "
                "lives in host memory)")


@attrs.frozen
class OffloadFigures:
    """Bytes per rank with and without `offload optimizer` on a GPU run."""

    device_bytes: int  # on the device, with offload
    device_bytes_without: int  # on the device, without it (explain's total)
    host_bytes: int  # in host memory, with offload: state + master copy + gradient copy


def offload_figures(est) -> OffloadFigures:
    """The figures of an explain Estimate (module doc)."""
    # fp32, one per element this rank updates (its shard under ZeRO >= 1)
    master = 4 * est.optimizer_bytes // OPTIMIZER_STATE.get(est.optimizer, 8)
    # fp32 masters kept apart from a bf16 model copy (explain's master_bytes) move too
    return OffloadFigures(est.total_bytes - est.optimizer_bytes - est.master_bytes,
                          est.total_bytes,
                          est.optimizer_bytes + 2 * master)


def format_offload(figures: OffloadFigures, fmt) -> list[str]:
    """explain's lines for `offload optimizer` (fmt: format_bytes)."""
    return ["offload optimizer, on a GPU run (a no-op on a CPU run):",
            f"  device        {fmt(figures.device_bytes):>12}   (without offload "
            f"{fmt(figures.device_bytes_without)}: the optimizer state moves to host)",
            f"  host          {fmt(figures.host_bytes):>12}   (optimizer state, fp32 master "
            "weights and a gradient copy)"]
