"""The cost model: one training step's time on a hardware profile, from explain's exact counts.

Nothing here counts bytes again: memory and communication are `explain`'s Estimate (per pipe
rank, per phase, kind and axis, in the comm layer's bus-byte convention). This module adds
time, on a `hardware.Profile`:

- compute: each Compute step of a Program, forward, per microbatch (`program_work`), by what
  its op's record says bounds it (shard/ops/): a matmul (einsum) costs its record's FLOPs (2
  x the product of its iteration dims' local sizes), run at the profile's achievable matmul
  rate in the run's precision; every other op (elementwise, norms, softmax, embedding, cross
  entropy) is memory-bound: the bytes of its float inputs and output at the
  memory bandwidth (half of them in bf16). Backward costs twice the forward (a matmul's two
  gradients; an elementwise op reads and writes its gradients). Each op (a fused chain is
  one, a redistribution is one) also costs the profile's fixed `op_overhead_us`, forward and
  backward together: what dominates a small model.
- collectives: the alpha-beta model, per traffic row: calls x ring hops x latency + bus bytes
  / bandwidth, on the link class of the row's axes. Axes are laid out row-major (the last mesh
  axis innermost, as comm.Mesh places ranks): a group of axes stays inside a node when its
  ranks span at most `devices_per_node` consecutive ranks, else it crosses the inter-node
  links. Ring hops: allreduce 2(n-1), reduce_scatter / allgather / alltoall / broadcast
  n-1, a p2p send 1.
- overlap, where the runtime overlaps: bucketed gradient reduction runs during the last
  microbatch's backward (every microbatch's under ZeRO >= 2, which reduce-scatters each one),
  so only what exceeds that backward, and at least the last bucket, is exposed; ZeRO-3's
  prefetched parameter gathers hide behind compute; tensor-parallel collectives (forward and
  backward rows on the other axes) block and are paid in full; the ZeRO-1/2 gather of the
  updated parameters and the grad-norm and loss reductions follow the step.
- pipeline: a pipe rank's busy time per step (compute + blocking collectives over its
  microbatches) stretched by the schedule's bubble, busy / (1 - bubble) with explain's
  (p-1)/(v*m+p-1), plus the fill and drain of the p2p chain ((p-1) hops each way).
- optimizer: memory-bound: each local optimizer-state element reads and writes its parameter,
  gradient and state.
"""

from __future__ import annotations

import math

import attrs

from soapstone.comm.dtype_table import PRECISIONS
from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.selective_plan import rebuild_steps
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.analysis.explain import OPTIMIZER_STATE, Estimate, Traffic
from soapstone.shard.plan.analysis.hardware import Link, Profile
from soapstone.shard.plan.dtypes import DTYPES
from soapstone.shard.plan.program import Compute, Program
from soapstone.shard.runtime.fusion_plan import find_fusions

HOPS = {"allreduce": lambda n: 2 * (n - 1), "send": lambda n: 1}  # else n - 1
BACKWARD_FACTOR = 2.0  # backward work / forward work


def _width(precision: str) -> float:
    """Bytes of a `precision` value relative to the spec's f32 (what other ops' traffic is)."""
    return PRECISIONS[precision].nbytes / DTYPES["f32"].nbytes


@attrs.frozen
class Work:
    """Forward work of one microbatch: matmul FLOPs and bytes of memory-bound ops; `again`:
    the forward work that `recompute` runs a second time in backward."""

    matmul_flops: float = 0.0
    other_bytes: float = 0.0
    ops: float = 0.0  # kernels run (a fused chain is one)
    again: Work | None = None

    def __add__(self, other: Work) -> Work:
        again = (self.again or Work()) + other.again if other.again else self.again
        return Work(self.matmul_flops + other.matmul_flops, self.other_bytes + other.other_bytes,
                    self.ops + other.ops, again)

    def forward_seconds(self, profile: Profile, precision: str) -> float:
        """The forward pass's time at the profile's rates, with each op's fixed cost."""
        width = _width(precision)
        return self.matmul_flops / profile.matmul_flops(precision) + \
            self.other_bytes * width / profile.memory_bandwidth + self.ops * profile.op_overhead_s

    def seconds(self, profile: Profile, precision: str) -> float:
        """Forward + backward time at the profile's rates, each op's fixed cost, and the
        forward that recompute runs again."""
        width = _width(precision)
        fwd = self.matmul_flops / profile.matmul_flops(precision) + \
            self.other_bytes * width / profile.memory_bandwidth
        again = self.again.forward_seconds(profile, precision) if self.again else 0.0
        return fwd * (1 + BACKWARD_FACTOR) + self.ops * profile.op_overhead_s + again


def program_work(program: Program) -> Work:
    """The forward work of one microbatch of `program` on one rank (module doc); under
    `recompute`, the recomputed ranges' forward again as `again` (under `recompute selective`,
    the steps that rebuild the dropped values)."""
    if program.recompute or program.dropped:
        again = {i for a, b in program.recompute for i in range(a, b)}
        again |= {i for n in program.dropped for i in rebuild_steps(program, n)}
        return attrs.evolve(_work(program, range(len(program.steps))),
                            again=_work(program, again))
    return _work(program, range(len(program.steps)))


def _work(program: Program, indices) -> Work:
    flops = 0.0
    moved = 0.0
    indices = set(indices)
    covered = {i for f in find_fusions(program).values() for i in f.covered}
    work = {i: record_of(s.kind).bound for i, s in enumerate(program.steps)
            if i in indices and isinstance(s, Compute)}
    ops = sum(1 for i in range(len(program.steps)) if i in indices and i not in covered and
              work.get(i) is not Bound.VIEW)  # a view is no work
    for i, step in enumerate(program.steps):
        if work.get(i, Bound.VIEW) is Bound.VIEW:
            continue
        if work[i] is Bound.MATMUL:
            flops += record_of(step.kind).flops(step, program)
        else:
            vals = [program.value(a) for a in step.args] + [program.value(step.out)]
            moved += sum(v.nbytes for v in vals if v.is_float)
    return Work(flops, moved, ops)


def link_of(axes: str, mesh: dict[str, int], profile: Profile) -> Link:
    """The link class of a communicator over `axes` ("a" or "a,b"), ranks laid out row-major
    over `mesh` (last axis innermost): intra-node when its ranks fit in one node."""
    names = list(mesh)
    group = [a for a in axes.split(",") if a in mesh]
    if not group:
        return profile.intra_node
    outer = min(names.index(a) for a in group)
    span = math.prod(mesh[a] for a in names[outer:])
    return profile.intra_node if span <= profile.devices_per_node else profile.inter_node


def row_seconds(t: Traffic, mesh: dict[str, int], profile: Profile) -> float:
    """One traffic row's time: calls x hops x latency + bus bytes / bandwidth."""
    n = math.prod(mesh.get(a, 1) for a in t.axis.split(","))
    hops = HOPS.get(t.kind, lambda n: n - 1)(n)
    return link_of(t.axis, mesh, profile).time(t.calls * hops, t.bytes)


@attrs.frozen
class StepTime:
    """A step's modelled time and where it goes (seconds)."""

    total: float
    compute: float  # the busiest pipe rank's compute over its microbatches
    blocking_comm: float  # its tensor/sequence-parallel collectives (not overlapped)
    bubble: float  # pipeline idle time (and p2p fill/drain)
    grad_sync: float  # exposed gradient reduction (what the backward does not hide)
    after_step: float  # ZeRO-1/2 parameter gathers, grad norm, loss, tied sums
    optimizer: float
    comm_per_axis: dict[str, float] = attrs.field(factory=dict)  # the busiest rank's, seconds

    def to_data(self) -> dict:
        """JSON-ready."""
        return attrs.asdict(self)


def _rank_time(traffic: list[Traffic], work: Work, est: Estimate, data_axes: tuple[str, ...],
               profile: Profile, precision: str) -> dict:
    mesh = est.mesh
    m = est.microbatches
    compute = work.seconds(profile, precision) * m
    out = {"compute": compute, "blocking": 0.0, "zero3": 0.0, "p2p": 0.0, "reduce": 0.0,
           "after": 0.0}
    per_axis: dict[str, float] = {}
    buckets = 1
    for t in traffic:
        s = row_seconds(t, mesh, profile)
        per_axis[t.axis] = per_axis.get(t.axis, 0.0) + s
        on_data = set(t.axis.split(",")) <= set(data_axes)
        if t.phase in ("forward", "backward", "recompute"):
            out["zero3" if t.kind == "allgather" and on_data else "blocking"] += s
        elif t.phase == "p2p":
            out["p2p"] += s
        elif t.phase == "grad sync" and t.kind != "allgather":
            out["reduce"] += s
            buckets = max(buckets, t.calls)
        else:  # ZeRO-1/2 gathers after the update, grad norm, loss, tied sums
            out["after"] += s
    # the reduction hides behind backward: the last microbatch's, or every one's (ZeRO >= 2)
    backward = compute * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR)
    window = backward if ZeroStage.of(est.zero).shards_grads else backward / m
    out["reduce"] = max(out["reduce"] - window, out["reduce"] / buckets)
    out["busy"] = max(compute, out["zero3"]) + out["blocking"]
    out["per_axis"] = per_axis
    return out


def optimizer_seconds(est: Estimate, profile: Profile) -> float:
    """The update's memory traffic: per local state element, read and write its parameter
    (fp32), gradient (fp32) and state."""
    per = OPTIMIZER_STATE.get(est.optimizer, 8)
    elems = est.optimizer_bytes / per
    return 2 * elems * (4 + 4 + per) / profile.memory_bandwidth


def step_time(est: Estimate, work: list[Work], profile: Profile, precision: str = "fp32",
              data_axes: tuple[str, ...] = ("data",)) -> StepTime:
    """The modelled time of one step of a layout whose explain estimate is `est` (a pipeline
    or accumulation estimate carries every pipe rank's traffic; a plain one is one rank) and
    whose pipe rank r does `work[r]` forward per microbatch (module doc)."""
    ranks = est.rank_traffic or [est.traffic]
    if len(work) != len(ranks):
        # not user input: the planner and explain pass one figure per pipe rank
        raise ValueError(f"{len(work)} work figures for {len(ranks)} pipe ranks")
    seen: dict[tuple, dict] = {}  # the middle ranks of a pipeline are alike
    rows = []
    for t, w in zip(ranks, work, strict=True):
        key = (tuple((x.phase, x.kind, x.axis, x.calls, x.bytes) for x in t), w)
        if key not in seen:
            seen[key] = _rank_time(t, w, est, data_axes, profile, precision)
        rows.append(seen[key])
    p = len(ranks)
    busiest = max(rows, key=lambda r: r["busy"])
    busy = busiest["busy"]
    pipe = busy / (1 - est.bubble) if est.bubble < 1 else math.inf
    if p > 1:  # fill and drain: (p-1) hops forward and back, one microbatch's tensors each
        pipe += (p - 1) * max(r["p2p"] for r in rows) / est.microbatches
        pipe = max(pipe, max(r["p2p"] for r in rows))  # p2p-bound
    tail = max(r["reduce"] + r["after"] for r in rows)
    opt = optimizer_seconds(est, profile)
    return StepTime(total=pipe + tail + opt, compute=busiest["compute"],
                    blocking_comm=busiest["blocking"], bubble=pipe - busy,
                    grad_sync=max(r["reduce"] for r in rows),
                    after_step=max(r["after"] for r in rows), optimizer=opt,
                    comm_per_axis=busiest["per_axis"])
