"""The fit check: does a layout's explain estimate fit the memory each rank has?

`run`, `golden check` and the Python `Trainer` call `check_fit` before allocating anything:
a layout whose busiest rank needs more than the device (or this host's share per rank) holds
is bad input (`DoesNotFit`, exit 2) with the numbers, instead of an out-of-memory crash
minutes later. The estimate is explain's (shard/plan/analysis/explain.py: parameters, gradients,
optimizer state, saved activations and the working set above them, within a few percent of
the measured peak), for the pipe rank that holds the most. No torch here: the caller says how
much memory a rank has (`host_memory_per_rank` on a CPU run, the GPU's on a CUDA one).
"""

from __future__ import annotations

import os
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.shard.plan.analysis.explain import Estimate, estimate_pipeline
from soapstone.shard.plan.units import format_bytes

LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


class DoesNotFit(UserError, MemoryError):
    """A layout whose estimate exceeds the memory a rank has."""


def ranks_on_this_host(default: int = 1) -> int:
    """How many ranks the launcher put on this host (its environment), else `default`."""
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


def host_memory() -> int:
    """This host's physical memory in bytes (MemTotal: the same on every rank)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_per_rank(ranks: int | None = None) -> tuple[int, str]:
    """(bytes, how they were found) of this host's memory per rank on it."""
    n = ranks if ranks is not None else ranks_on_this_host()
    total = host_memory()
    return total // n, (f"this host's {format_bytes(total)} / {n} rank{'s' if n > 1 else ''} "
                        "on it" if n > 1 else f"this host's {format_bytes(total)}")


def layout_estimate(graph, optimizer: str = "adamw") -> Estimate:
    """explain's estimate of the busiest rank of `graph` under the layout's own ZeRO stage."""
    zero = graph.stages[0].program.zero
    return estimate_pipeline(graph, zero, optimizer)


def breakdown(est: Estimate) -> str:
    """"params 1 KiB, grads ..., working set ...": where a rank's bytes go."""
    parts = (("params", est.param_bytes), ("grads", est.grad_bytes),
             ("optimizer", est.optimizer_bytes), ("activations", est.activation_bytes),
             ("working set", est.transient_bytes))
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in parts)


def check_fit(graph, optimizer: str, available: int, where: str, hint: str | None = None,
              what: str | None = None) -> Estimate:
    """explain's estimate of `graph`, or DoesNotFit when its busiest rank needs more than
    `available` bytes (`where` says whose memory that is)."""
    est = layout_estimate(graph, optimizer)
    if est.total_bytes <= available:
        return est
    what = what or (f"layout '{graph.parallel}'" if graph.parallel else
                    f"model '{graph.model}' on one rank")
    rank = f" (pipe rank {est.pipe_rank})" if graph.pipe > 1 else ""
    msg = (f"{what} does not fit: it needs {format_bytes(est.total_bytes)} per rank{rank} "
           f"({breakdown(est)}; explain's estimate), but a rank has "
           f"{format_bytes(available)} ({where})")
    raise DoesNotFit(msg + (f"\nhint: {hint}" if hint else ""))
