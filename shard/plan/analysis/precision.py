"""What a run's `--precision` keeps and moves, as the Program's dtypes: the estimates (explain,
plan, the fit check) read a Program retyped to what the runtime holds, so every byte they
count (activations and saved tensors, the working set, TP/SP/CP collectives and statistics
sums, ZeRO-3 parameter gathers, ZeRO-1/2 parameter publishes, p2p boundaries, the loss) is
in the dtype the runtime uses, with no correction factor anywhere else.

What the runtime does (shard/train/trainer.py, shard/runtime/sharded_model.py,
shard/parallel/data_parallel.py, shard/parallel/zero.py, shard/runtime/pipe_p2p.py):
- fp32: the spec's dtypes as declared.
- bf16: every float input is cast to bf16 and the flat parameters the model computes with
  are bf16 (every op runs in its inputs' dtype), so every float value of the Program is bf16;
  p2p boundaries travel in bf16; ZeRO-3 gathers and ZeRO-1/2 publishes carry the bf16 copy of
  the master shard. The optimizer keeps fp32 master weights, fp32 gradient buffers (so
  gradient reduction moves fp32) and fp32 state: explain counts those from the master width
  (explain.py), whatever the model's dtype.
- fp64: the whole model in float64 (parameters too), masters float64.
- float8: what bf16 keeps and moves (the float8 casts are transient: shard/runtime/float8.py
  saves the bf16 operands for backward, as torchao does), its float8 steps marked
  `float8 = true` so that the working set counts their casts while they run
  (einsum.float8_scratch), with the weight matmuls' FLOPs at the profile's fp8 peak and their
  amax and cast passes as memory-bound work (cost.py).
Integer and bool values never change.
"""

from __future__ import annotations

import math

import attrs

from soapstone.comm.dtype_table import MIXED_PRECISIONS, PRECISIONS
from soapstone.shard.plan.dtypes import DTYPES
from soapstone.shard.plan.program import Compute, Program

#: --precision -> the spec dtype every float value takes (None: the spec's own)
COMPUTE = {"fp32": None, "bf16": "bf16", "fp64": "f64"}


def compute_dtype(precision: str) -> str | None:
    """The spec dtype float values take under `--precision precision` (None: as declared);
    ValueError for an unknown precision (the commands' choices never pass one)."""
    precision = MIXED_PRECISIONS.get(precision, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    return COMPUTE.get(precision)


def matmul_peaks(precision: str) -> tuple[str, str]:
    """The profile peaks (peak_tflops keys) a run in `precision` computes its weight matmuls
    and its activation matmuls at: float8 runs only the weight matmuls in fp8."""
    if precision == "float8":
        return "fp8", "bf16"
    return precision, precision


def mfu_peak(precision: str) -> str:
    """The peak (peak_tflops key) MFU divides by: float8's is bf16's, the rate the model's
    other matmuls run at (a float8 step mixes two peaks; torchtitan quotes no MFU for it)."""
    return matmul_peaks(precision)[1]


def missing_peak(peaks: dict, precision: str) -> str | None:
    """The peak_tflops key a run in `precision` needs and `peaks` lacks, or None."""
    return next((k for k in matmul_peaks(precision) if k not in peaks), None)


def _retype(x, dtype: str):
    return attrs.evolve(x, dtype=dtype) if DTYPES[x.dtype].is_float and x.dtype != dtype else x


def program_as_run(program: Program, precision: str) -> Program:
    """`program` with every float value and parameter in the dtype `run --precision` computes
    in (module doc); the same Program under fp32."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return program
    steps = program.steps
    if precision == "float8":  # the steps that run in float8 say so (their working set),
        # and those whose input a float8 gather brings (no cast of theirs: float8_scratch)
        from soapstone.shard.ops.einsum import float8_steps
        from soapstone.shard.parallel.ring_plan import (
            float8_gathers_beside_rings,
            float8_ring_gathers,
        )

        f8 = float8_steps(program)
        gathered = {steps[i].out for i in (*float8_gathers_beside_rings(program),
                                           *float8_ring_gathers(program))}
        steps = tuple(attrs.evolve(s, attrs=tuple(sorted(
            {**dict(s.attrs), "float8": True,
             **({"float8_gathered": True} if s.args[0] in gathered else {})}.items())))
            if i in f8 else s for i, s in enumerate(steps))
    return attrs.evolve(program, values=tuple(_retype(v, dtype) for v in program.values),
                        params=tuple(_retype(p, dtype) for p in program.params), steps=steps)


def graph_as_run(graph, precision: str):
    """A StageGraph whose stage Programs and boundary tensors are as `run --precision` keeps
    and sends them (module doc)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return graph
    stages = tuple(attrs.evolve(st, program=program_as_run(st.program, precision))
                   for st in graph.stages)
    edges = tuple(attrs.evolve(e, tensors=tuple(_retype(t, dtype) for t in e.tensors))
                  for e in graph.edges)
    return attrs.evolve(graph, stages=stages, edges=edges)


def float8_kept(program: Program) -> tuple[dict[str, int], dict[int, int]]:
    """What `--precision float8`'s gathers (einsum.float8_gathers, in a Program as
    program_as_run marks it) hold, as explain's walks (activations.py) count it: each gathered
    value in e4m3, one byte an element (its readers keep those bytes for backward:
    shard/runtime/float8.py `Float8Gather`; a float8 gather ring's too, `Float8GatherRing`),
    and each gather's working set beside its shard
    and result: the shard's cast (two fp32 copies at once, einsum.CAST_BYTES an element,
    before the result exists), then the shard's e4m3 copy beside the receive buffer the
    gathered bytes are concatenated from (collective_scratch.py), one byte an element.
    ({value: bytes kept}, {step: working set}); both empty for other programs."""
    from soapstone.shard.ops.einsum import CAST_BYTES
    from soapstone.shard.parallel.ring_plan import (
        float8_gathers_beside_rings,
        float8_ring_gathers,
    )
    from soapstone.shard.plan.analysis.collective_scratch import collective_scratch

    kept: dict[str, int] = {}
    work: dict[int, int] = {}
    for i in float8_gathers_beside_rings(program, marked=True):
        step = program.steps[i]
        out = program.value(step.out)
        shard, n = math.prod(program.value(step.src).local_shape), math.prod(out.local_shape)
        kept[step.out] = n
        work[i] = max(CAST_BYTES * shard - n,
                      shard + collective_scratch(step, program)[0] * n // out.nbytes)
    for i in float8_ring_gathers(program, marked=True):  # kept whole, in e4m3 (a ring's
        # working set is its own: ring_memory.float8_gather)
        kept[program.steps[i].out] = math.prod(program.value(program.steps[i].out).local_shape)
    return kept, work


def float8_last_cast(program: Program, steps: list[int]) -> int:
    """The bytes of the e4m3 cast the last of `steps` (in run order) to cast its input keeps
    (shard/runtime/float8.py `LastCast`, one byte an element): a recompute range's second run,
    in backward, leaves it there until the next cast or the step's end. 0 without float8
    steps (a float8 gather's readers cast nothing)."""
    for i in reversed(steps):
        step = program.steps[i]
        if isinstance(step, Compute) and step.attr("float8") is True \
                and step.attr("float8_gathered") is not True:
            return math.prod(program.value(step.args[0]).local_shape)
    return 0


def float8_line(graph) -> str:
    """explain's line under `--precision float8`: how many weight matmuls of the stage graph
    run in float8 (einsum.float8_steps), how many weight einsums stay in bf16, and how many
    gathers move float8 (einsum.float8_gathers), and how many rings run float8
    (ring_plan.float8_rings)."""
    from soapstone.shard.ops.einsum import float8_steps
    from soapstone.shard.parallel.ring_plan import float8_gathers_beside_rings, float8_rings

    ran = kept = gathers = rings = 0
    for stage in graph.stages:
        program = stage.program
        f8 = float8_steps(program)
        ran += len(f8)
        gathers += len(float8_gathers_beside_rings(program))
        rings += len(float8_rings(program))
        kept += sum(1 for i, s in enumerate(program.steps)
                    if getattr(s, "kind", None) == "einsum" and i not in f8
                    and set(s.args) & program.weights)
    return (f"float8: {ran} weight matmuls in float8 (e4m3 x e4m3 forward, e5m2 gradients, "
            f"dynamic per-tensor scales), {kept} weight einsums in bf16 (float8 = false, or "
            f"not a plain matmul); attention's products in bf16"
            + (f"; {gathers} sequence-parallel gathers of their inputs move e4m3 (1 byte an "
               "element, at the amax allreduced over the axis)" if gathers else "")
            + (f"; {rings} `overlap tensor` rings run their matmuls in float8 (a gather's "
               "chunks e4m3, a reduce-scatter's backward chunks e5m2, each cast at the amax "
               "allreduced over the axis)" if rings else ""))
