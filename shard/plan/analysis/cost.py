"""The cost model: one training step's time on a hardware profile, from explain's exact counts.

Nothing here counts bytes again: memory and communication are `explain`'s Estimate (per pipe
rank, per phase, kind and axis, in the comm layer's bus-byte convention). This module adds
time, on a `hardware.Profile`:

- compute: each Compute step of a Program, forward, per microbatch (`program_work`), by what
  its op's record says bounds it (shard/ops/): a matmul (einsum) costs its record's FLOPs (2
  x the product of its iteration dims' local sizes), run at the profile's achievable matmul
  rate in the run's precision, except that a matmul of two activations (attention's q.k and
  p.v, whose intensity does not grow with the batch) runs at the roofline: the slower of its
  FLOPs at that rate and its bytes at the memory bandwidth; every other op (elementwise,
  norms, softmax, embedding, cross entropy) is memory-bound: the bytes of its float inputs and
  output, in the dtype the run computes in (the Program is retyped to it first: precision.py,
  so under bf16 they are half of fp32's), at the profile's memory-bound rate
  (`Profile.memory_bound_rate`: what eager kernels reach in those bytes, forward and backward,
  measured where the profile says so, else the memory bandwidth; the casts, the optimizer and
  the roofline stay on the bandwidth). Under `--precision float8`
  the weight matmuls that run in float8 (einsum.float8_steps) take the profile's fp8 peak at
  the same efficiency, the rest bf16's, and each adds its casts' memory traffic
  (`float8_casts`: amax and scaling passes, forward and backward). A fused chain
  (shard/runtime/fusion_plan.py: attention's scores, mask, softmax and p.v in one call; a
  matmul and its bias) is one kernel: it reads what it takes from outside and writes its
  output once, its inner values never reach memory. Backward costs twice the forward (a
  matmul's two gradients; an elementwise op reads and writes its gradients), except that a
  fused attention's backward also runs its scores q.k^T again (flash-style kernels, on GPU
  and CPU, keep only the log-sum-exp: activations.lse_bytes), 5 matmuls of the chain's size
  against forward's 2: 2.5x (`rescore_flops`). Under a causal mask the fused kernel skips
  the key tiles wholly after a query tile (`causal_work`: FlashAttention's and torch's CPU
  flash kernel's loop bound), where the runtime calls it with `is_causal`: the mask is plain
  key <= query and the chain's query and key dims are whole on the rank (fusion.py; a split
  sequence, context parallel's, passes an explicit mask, which no kernel skips on). The
  skipped FLOPs stay in `matmul_flops` (MFU's model FLOPs count the full square, as
  Megatron's and torchtitan's do) and are taken off its time (`skipped_flops`). A fused
  attention's matmuls (forward and the rescored backward) run at the profile's attention rate
  (`Profile.attention_flops`: a measured curve over the weight matmuls' rate, by the keys a
  query attends), kept per key length in `Work.attention`: a whole causal square attends its
  sequence; each run of a context-parallel rank's queries its visible key prefix (the busiest
  rank's runs); split keys, the rank's keys. Each op (a
  fused chain is one, a redistribution is one) also costs the profile's fixed
  `op_overhead_us`, forward and backward together: what dominates a small model.
- collectives: the alpha-beta model, per traffic row: calls x ring hops x latency + bus bytes
  / bandwidth, on the link class of the row's axes (a ring across nodes pays the inter-node
  latency only on the hops that cross, NCCL's model: `row_seconds`). Axes are laid out
  row-major (the last mesh axis innermost, as comm.Mesh places ranks): a group of axes stays
  inside a node when its ranks span at most `devices_per_node` consecutive ranks, else it
  crosses the inter-node links. Ring hops: allreduce 2(n-1), reduce_scatter / allgather /
  alltoall / broadcast n-1, a p2p send 1.
- overlap, where the runtime overlaps, per link class (intra- or inter-node: every axis on
  one class shares its links, so what overlaps on it adds up first; `LinkLoad`,
  `exposed_on_link`): ZeRO-3's prefetched parameter gathers hide behind forward compute
  (the forward's) and backward compute (the backward's); bucketed gradient reduction runs
  during the last microbatch's backward (every microbatch's under ZeRO >= 2, which
  reduce-scatters each one), in what the backward gathers leave of the link, so only what
  exceeds that, and at least the last bucket, is exposed. Links run side by side: the step
  waits for the busiest. Tensor-parallel collectives (forward and backward rows on the other
  axes) block and are paid in full, except under `overlap tensor` (shard/parallel/ring_plan.py):
  a collective matmul's ring of sends runs while its matmuls compute chunk by chunk, so only
  max(0, ring time - matmul time) is exposed where the profile's `ring_overlap` is 1 (the
  ideal; it hides that share of the shorter of the two), forward (the forward matmuls),
  backward (their two gradients, 2x) and a recomputed range's forward again (its rings'
  matmuls again; under float8 the rings' float8 chunks at 1 byte an element and their float8
  matmuls at the fp8 rate), summed
  over the rank's rings first (per layer, for a stack of alike blocks); the hidden part holds
  its link class for that long, so ZeRO-3's gathers and the reduction on that class hide only
  in the compute the rings leave (`LinkLoad.rings_forward`); the ZeRO-1/2 gather of
  the updated parameters and the grad-norm and loss reductions follow the step.
- pipeline: a pipe rank's busy time per step (compute + blocking collectives over its
  microbatches) stretched by the schedule's bubble, busy / (1 - bubble) with explain's
  (p-1)/(v*m+p-1), plus the fill and drain of the p2p chain ((p-1) hops each way).
- optimizer: memory-bound: each local optimizer-state element reads and writes its parameter,
  gradient and state.
"""

from __future__ import annotations

import math

import attrs

from soapstone.shard.ops.einsum import float8_steps
from soapstone.shard.ops.record import Bound
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.ring_plan import (
    find_rings,
    float8_gathers_beside_rings,
    float8_ring_gathers,
)
from soapstone.shard.parallel.selective_plan import rebuild_steps
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.analysis.explain import OPTIMIZER_STATE, Estimate, Traffic
from soapstone.shard.plan.analysis.hardware import Link, Profile
from soapstone.shard.plan.analysis.precision import matmul_peaks
from soapstone.shard.plan.balanced import causal_prefix_work, nested_runs, prefix_shares
from soapstone.shard.plan.dtypes import DTYPE_BYTES
from soapstone.shard.plan.program import Compute, Program
from soapstone.shard.runtime.fusion_plan import FusedAttention, find_fusions

HOPS = {"allreduce": lambda n: 2 * (n - 1), "send": lambda n: 1}  # else n - 1
BACKWARD_FACTOR = 2.0  # backward work / forward work
# the query (and key) tile of a flash-style attention kernel: FlashAttention-2's kBlockM for
# head dims up to 128 on A100/H100 (the key tile, 64 or 128, divides it), which decides what
# a causal mask lets it skip (torch's CPU flash kernel bounds its key loop alike, with query
# blocks of 32-256: there the figure is approximate)
FLASH_TILE = 128


@attrs.frozen
class Work:
    """Forward work of one microbatch: matmul FLOPs and bytes of memory-bound ops; `again`:
    the forward work that `recompute` runs a second time in backward. `act_flops` and
    `act_bytes`: the part of the matmuls whose operands are both activations (attention's
    q.k and p.v): their intensity does not grow with the batch, so they are bound by memory
    as much as by FLOPs (`matmul_seconds`)."""

    matmul_flops: float = 0.0
    other_bytes: float = 0.0
    ops: float = 0.0  # kernels run (a fused chain is one)
    again: Work | None = None
    act_flops: float = 0.0  # of matmul_flops
    act_bytes: float = 0.0  # their operands and outputs
    # the weight matmuls `--precision float8` runs in float8 (einsum.float8_steps): their
    # FLOPs (of matmul_flops) and their casts' bytes, forward and backward (`float8_casts`)
    f8_flops: float = 0.0
    f8_forward_bytes: float = 0.0
    f8_backward_bytes: float = 0.0
    # fused attention (module doc): the FLOPs a causal kernel skips (of act_flops), and the
    # scores FLOPs its backward runs again (beyond BACKWARD_FACTOR x the forward)
    skipped_flops: float = 0.0
    rescore_flops: float = 0.0
    # `overlap tensor`: the forward FLOPs (of matmul_flops) of the matmuls run inside
    # collective-matmul rings, the window their sends hide in
    ring_flops: float = 0.0
    # fused attention by the keys its queries attend: ((keys, forward FLOPs computed, of
    # act_flops less skipped_flops; rescored FLOPs, of rescore_flops), ...), ascending keys
    attention: tuple[tuple[int, float, float], ...] = ()
    ring_f8_flops: float = 0.0  # of ring_flops, the float8 steps' (of f8_flops too)

    def ring_seconds(self, profile: Profile, precision: str) -> float:
        """The rings' matmuls' forward time, each at its own rate: a float8 step's at the
        fp8 peak's under float8, the rest at the weight matmuls' rate of the other dtype."""
        weight_peak, act_peak = matmul_peaks(precision)
        f8 = self.ring_f8_flops if weight_peak != act_peak else 0.0
        return f8 / profile.matmul_flops(weight_peak) + \
            (self.ring_flops - f8) / profile.matmul_flops(act_peak)

    def __add__(self, other: Work) -> Work:
        again = (self.again or Work()) + other.again if other.again else self.again
        return Work(**{a.name: getattr(self, a.name) + getattr(other, a.name)
                       for a in attrs.fields(Work) if a.name not in ("again", "attention")},
                    again=again, attention=by_keys(self.attention + other.attention))

    def attention_seconds(self, profile: Profile, precision: str,
                          which: int = 1) -> tuple[float, float]:
        """(seconds, FLOPs) of the fused attentions' forward (`which` 1) or rescored (2)
        matmuls at the profile's attention rate for their keys."""
        peak = matmul_peaks(precision)[1]
        return (sum(a[which] / profile.attention_flops(peak, a[0]) for a in self.attention),
                sum(a[which] for a in self.attention))

    def matmul_seconds(self, profile: Profile, precision: str) -> float:
        """The matmuls' forward time: weight matmuls at the achievable rate (under float8,
        those `f8_flops` count at the fp8 peak's); activation matmuls at the roofline, the
        slower of their FLOPs at that rate (a fused attention's at the attention rate for its
        keys) and their bytes at the memory bandwidth."""
        weight_peak, act_peak = matmul_peaks(precision)
        rate = profile.matmul_flops(act_peak)
        attn_s, attn_f = self.attention_seconds(profile, precision)
        act = max((self.act_flops - self.skipped_flops - attn_f) / rate + attn_s,
                  self.act_bytes / profile.memory_bandwidth)
        f8 = self.f8_flops if weight_peak != act_peak else 0.0
        f8_s = f8 / profile.matmul_flops(weight_peak) if f8 else 0.0
        return (self.matmul_flops - self.act_flops - f8) / rate + f8_s + act

    def cast_seconds(self, profile: Profile, precision: str) -> tuple[float, float]:
        """(forward, backward) time of the float8 casts at the memory bandwidth (0 unless the
        weight matmuls run at another peak than the rest: float8)."""
        weight_peak, act_peak = matmul_peaks(precision)
        if weight_peak == act_peak:
            return 0.0, 0.0
        bw = profile.memory_bandwidth
        return self.f8_forward_bytes / bw, self.f8_backward_bytes / bw

    def forward_seconds(self, profile: Profile, precision: str) -> float:
        """The forward pass's time at the profile's rates, with each op's fixed cost."""
        return self.matmul_seconds(profile, precision) + \
            self.other_bytes / profile.memory_bound_rate + self.ops * profile.op_overhead_s + \
            self.cast_seconds(profile, precision)[0]

    def rescore_seconds(self, profile: Profile, precision: str) -> float:
        """What a fused attention's backward adds to BACKWARD_FACTOR x its forward: its
        scores matmul again, at the attention rate for its keys (its tiles stay on chip)."""
        attn_s, attn_f = self.attention_seconds(profile, precision, 2)
        return (self.rescore_flops - attn_f) / profile.matmul_flops(matmul_peaks(precision)[1]) \
            + attn_s

    def seconds(self, profile: Profile, precision: str) -> float:
        """Forward + backward time at the profile's rates, each op's fixed cost, the float8
        casts, the forward that recompute runs again and attention's scores recomputed."""
        fwd = self.matmul_seconds(profile, precision) + \
            self.other_bytes / profile.memory_bound_rate
        again = self.again.forward_seconds(profile, precision) if self.again else 0.0
        return fwd * (1 + BACKWARD_FACTOR) + self.ops * profile.op_overhead_s + again + \
            sum(self.cast_seconds(profile, precision)) + self.rescore_seconds(profile, precision)


def by_keys(entries) -> tuple[tuple[int, float, float], ...]:
    """`Work.attention` entries with equal keys summed, in ascending keys."""
    out: dict[int, tuple[float, float]] = {}
    for keys, f, r in entries:
        f0, r0 = out.get(keys, (0.0, 0.0))
        out[keys] = (f0 + f, r0 + r)
    return tuple((k, *out[k]) for k in sorted(out))


def causal_work(queries: int, keys: int, tile: int = FLASH_TILE) -> float:
    """The fraction of a causal (key <= query) queries x keys score square a flash-style
    kernel computes: each tile of `tile` queries runs the key tiles up to its last query's
    position (`keys` at most) and skips the rest, so the diagonal tiles run whole: for n
    tiles of a square, (n + 1) / 2n."""
    done = sum(min(tile, queries - start) * min(keys, start + tile)
               for start in range(0, queries, tile))
    return done / (queries * keys)


def float8_casts(x: float, w: float, y: float, nbytes: float, shared: bool = False,
                 gathered: int = 0, regathered: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes the casts of one float8 matmul move (shard/runtime/float8.py)
    for x, w and y elements of `nbytes` each: a cast to float8 is an amax pass (reads the
    tensor) and a scaling pass (reads it, writes 1 byte an element), 2 x nbytes + 1 bytes an
    element; a transposing copy of a float8 tensor reads and writes 1 byte an element.
    Forward casts x (unless `shared`: the matmul before read the same x, LastCast) and w, and
    lays w out column-major. Backward casts the output gradient (y elements), casts x and w
    again (backward keeps them in bf16, as torchao does), and copies x^T row-major and the
    gradient column-major for grad_w = x^T . g. `gathered`: x came through a float8 gather
    over that many ranks (einsum.float8_gathers): its cast is of this rank's shard, before
    the gather (x / gathered elements, by the first reader), and backward keeps the gathered
    float8 x instead of casting again (`regathered`: it casts the shard again to regather)."""
    cast = 2 * nbytes + 1
    if gathered:
        mine = x / gathered
        return cast * ((0 if shared else mine) + w) + 2 * w, \
            cast * (y + w + (0 if shared or not regathered else mine)) + 2 * (x + y)
    return cast * ((0 if shared else x) + w) + 2 * w, cast * (y + x + w) + 2 * (x + y)


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
    flops = moved = act_flops = act_bytes = 0.0
    indices = set(indices)
    fusions = find_fusions(program)
    chain_of = {i: at for at, f in fusions.items() for i in (*f.covered, at)}
    covered = {i for f in fusions.values() for i in f.covered}
    work = {i: record_of(s.kind).bound for i, s in enumerate(program.steps)
            if i in indices and isinstance(s, Compute)}
    f8_flops = f8_fwd = f8_bwd = 0.0
    last = None  # the input of the float8 matmul before: its cast is shared (LastCast)
    mesh = dict(program.mesh)
    gathered = {program.steps[j].out: mesh[a]  # a float8 gather's or ring's (cast as shards)
                for j, a in (float8_gathers_beside_rings(program, marked=True)
                             | float8_ring_gathers(program, marked=True)).items()}
    f8_steps = float8_steps(program)
    for i in sorted(f8_steps.keys() & indices):
        x, w, y = (program.value(n) for n in (*program.steps[i].args, program.steps[i].out))
        f8_flops += record_of("einsum").flops(program.steps[i], program)
        fwd, bwd = float8_casts(*(math.prod(v.local_shape) for v in (x, w, y)),
                                DTYPE_BYTES[x.dtype], shared=x.name == last,
                                gathered=gathered.get(x.name, 0),
                                regathered=x.name in program.regathered)
        f8_fwd, f8_bwd, last = f8_fwd + fwd, f8_bwd + bwd, x.name
    ops = sum(1 for i in range(len(program.steps)) if i in indices and i not in covered and
              work.get(i) is not Bound.VIEW)  # a view is no work
    weights = program.weights
    chains: dict[int, float] = {}  # a fused chain's matmul FLOPs, by where it runs
    for i, step in enumerate(program.steps):
        if not isinstance(step, Compute):
            continue
        if work.get(i, Bound.VIEW) is Bound.VIEW:
            continue
        f = record_of(step.kind).flops(step, program) if work[i] is Bound.MATMUL else 0.0
        flops += f
        if i in chain_of:  # one kernel: what it reads from outside and writes, once
            chains[chain_of[i]] = chains.get(chain_of[i], 0.0) + f
            continue
        nbytes = _float_bytes(program, (*step.args, step.out))
        if work[i] is not Bound.MATMUL:
            moved += nbytes
        elif not weights & set(step.args):
            act_flops += f
            act_bytes += nbytes
    skipped = rescore = 0.0
    attention = []
    for at, f in chains.items():
        steps = [program.steps[i] for i in (*fusions[at].covered, at)]
        inner = {s.out for s in steps}
        outside = {a for s in steps for a in s.args if a not in inner}
        if not weights & outside:  # attention: bound by its q, k, v and output as much
            act_flops += f
            act_bytes += _float_bytes(program, (*outside, program.steps[at].out))
        if isinstance(fusions[at], FusedAttention):
            runs = _attention_runs(program, fusions[at])
            done = sum(share for _, share in runs)
            skipped += f * (1 - done)
            scores = program.steps[fusions[at].covered[0]]
            sf = record_of(scores.kind).flops(scores, program)
            rescore += sf * done
            attention += [(keys, f * share, sf * share) for keys, share in runs]
    in_rings = [j for r in find_rings(program).values() for j in r.matmuls if j in indices]
    rings = sum(record_of("einsum").flops(program.steps[j], program) for j in in_rings)
    ring_f8 = sum(record_of("einsum").flops(program.steps[j], program) for j in in_rings
                  if j in f8_steps)
    return Work(flops, moved, ops, None, act_flops, act_bytes, f8_flops, f8_fwd, f8_bwd,
                skipped, rescore, rings, by_keys(attention), ring_f8)


def _attention_runs(program: Program, f: FusedAttention) -> list[tuple[int, float]]:
    """Each (keys attended, share of the score square computed) of the fused kernel's
    queries: `causal_work` of the square where the runtime calls it with is_causal
    (fusion.run_attention); with the queries split (context parallel) and the keys whole, each
    run of query positions against only the key prefix it sees (fusion.causal_prefixes), on
    the rank that computes most (every rank alike where the split is balanced; the last where
    it is contiguous); else all of the rank's keys. The shares sum to the fraction computed."""
    v, sizes = program.value(f.scores), dict(program.dims)
    local = dict(zip(v.dims, v.local_shape, strict=True))
    q, k = local[f.query], local[f.key]
    if not f.causal or not record_of(f.mask_kind).mask.causal(dict(f.mask_attrs)) or \
            k != sizes[f.key]:
        return [(k, 1.0)]  # split keys: an explicit mask, computed whole
    axes = v.layout.dim_axes(f.query)
    if not axes:
        return [(k, causal_work(q, k) if q == k else 1.0)]
    mesh = dict(program.mesh)
    parts, pieces = mesh[axes[0]], math.prod(mesh[a] for a in axes[1:])
    balanced = f.query in program.balanced
    # the busiest rank: the one holding the last positions (any where balanced: rank 0)
    held = max((nested_runs(sizes[f.query], parts, r, balanced, i, pieces)
                for r in ((0,) if balanced else (parts - 1,)) for i in range(pieces)),
               key=lambda runs: causal_prefix_work(runs, k))
    return prefix_shares(held, k) or [(k, 1.0)]


def _float_bytes(program: Program, names) -> float:
    return float(sum(v.nbytes for v in map(program.value, names) if v.is_float))


def link_class(axes: str, mesh: dict[str, int], profile: Profile) -> str:
    """"intra" or "inter": whether a communicator over `axes` ("a" or "a,b"), ranks laid out
    row-major over `mesh` (last axis innermost), stays inside a node (its ranks fit in one)."""
    names = list(mesh)
    group = [a for a in axes.split(",") if a in mesh]
    if not group:
        return "intra"
    outer = min(names.index(a) for a in group)
    span = math.prod(mesh[a] for a in names[outer:])
    return "intra" if span <= profile.devices_per_node else "inter"


def link_of(axes: str, mesh: dict[str, int], profile: Profile) -> Link:
    """The link class of a communicator over `axes` (`link_class`): its alpha-beta model."""
    return profile.intra_node if link_class(axes, mesh, profile) == "intra" else \
        profile.inter_node


def nodes_spanned(axes: str, mesh: dict[str, int], profile: Profile) -> int:
    """How many nodes one communicator over `axes` reaches (ranks laid out row-major over
    `mesh`, `devices_per_node` consecutive ranks to a node): the group of rank 0, its size
    over how many of its ranks rank 0's node holds. Counted without listing the group (a
    mesh may have 2**31 ranks): at most devices_per_node ranks are looked at. Exact where
    node boundaries fall on whole groups, as in every power-of-two layout."""
    names = list(mesh)
    group = [a for a in axes.split(",") if a in mesh]
    per_node = profile.devices_per_node
    on_first = [0]  # the group's ranks on rank 0's node
    for a in group:
        stride = math.prod(mesh[b] for b in names[names.index(a) + 1:])
        on_first = [r + i * stride for r in on_first
                    for i in range(min(mesh[a], (per_node - 1 - r) // stride + 1))]
    size = math.prod(mesh[a] for a in group)
    return -(-size // len(on_first))


def row_seconds(t: Traffic, mesh: dict[str, int], profile: Profile) -> float:
    """One traffic row's time: calls x the ring's latency + bus bytes / bandwidth. A ring
    over several nodes (NCCL's model, src/graph/tuning.cc) crosses between nodes on
    nodes - 1 of its steps (twice as many for an allreduce's two passes) and stays on the
    intra-node links for the rest: those steps cost the intra-node latency."""
    n = math.prod(mesh.get(a, 1) for a in t.axis.split(","))
    hops = HOPS.get(t.kind, lambda n: n - 1)(n)
    link = link_of(t.axis, mesh, profile)
    if link is profile.intra_node or t.kind == "send":
        return link.time(t.calls * hops, t.bytes)
    nodes = nodes_spanned(t.axis, mesh, profile)
    inter = min(hops, (nodes - 1) * (2 if t.kind == "allreduce" else 1))
    return link.time(t.calls * inter, t.bytes) + \
        t.calls * (hops - inter) * profile.intra_node.latency_s


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
    param_gathers: float = 0.0  # exposed ZeRO-3 parameter gathers (what compute does not hide)
    # `overlap tensor`: the busiest rank's ring sends, and the part their matmuls hide (the
    # rest is in blocking_comm)
    ring_sends: float = 0.0
    ring_hidden: float = 0.0

    def to_data(self) -> dict:
        """JSON-ready."""
        return attrs.asdict(self)


@attrs.define
class LinkLoad:
    """One rank's traffic of one step on one link class (seconds at that link's rates), by
    what it can hide behind. Collectives on one link share it: their times add up here,
    before any is set against compute."""

    gathers_forward: float = 0.0  # ZeRO-3 parameter gathers, prefetched ahead of forward use
    gathers_backward: float = 0.0  # and again for backward
    reduce: float = 0.0  # gradient reduction launched from backward (bucket by bucket)
    # `overlap tensor` rings' sends while their matmuls run (the part the matmuls hide): the
    # link is theirs for that long, so ZeRO-3's gathers and the reduction wait for it
    rings_forward: float = 0.0
    rings_backward: float = 0.0  # backward's rings and a recomputed range's again


def exposed_on_link(load: LinkLoad, forward: float, backward: float, reduce_window: float,
                    buckets: int) -> tuple[float, float]:
    """(gather time, reduction time) that one link's overlapped traffic adds to the step:
    what the compute windows do not hide. Forward gathers hide behind forward compute,
    backward gathers behind backward compute, each in what the rings' hidden sends leave of
    it; the reduction hides only in the part of its window (`reduce_window`: the whole
    backward under ZeRO >= 2, else the last microbatch's) that the backward gathers and rings
    leave the link free (they take it in proportion, spread over backward), and never its
    last bucket (launched when backward ends). Neither is negative, and no second of compute
    hides two transfers on one link."""
    gathers = max(0.0, load.gathers_forward - max(0.0, forward - load.rings_forward)) + \
        max(0.0, load.gathers_backward - max(0.0, backward - load.rings_backward))
    taken = load.gathers_backward + load.rings_backward
    busy = min(1.0, taken / backward) if backward > 0 else (1.0 if taken else 0.0)
    free = reduce_window * (1.0 - busy)
    reduce = max(load.reduce - free, load.reduce / max(buckets, 1), 0.0)
    return gathers, reduce


def _rank_time(traffic: list[Traffic], work: Work, est: Estimate, profile: Profile,
               precision: str) -> dict:
    mesh = est.mesh
    m = est.microbatches
    compute = work.seconds(profile, precision) * m
    out = {"compute": compute, "blocking": 0.0, "p2p": 0.0, "after": 0.0}
    per_axis: dict[str, float] = {}
    links: dict[str, LinkLoad] = {}  # by link class: axes on one class share its links
    buckets = 1
    # collective matmuls' sends (module doc), in all and by link class
    rings = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    ring_links: dict[str, dict[str, float]] = {}
    for t in traffic:
        s = row_seconds(t, mesh, profile)
        per_axis[t.axis] = per_axis.get(t.axis, 0.0) + s
        # ZeRO-3's gathers, prefetched over whatever axes ZeRO shards (data, context or both:
        # zero.py gathers each bucket a step ahead alike); context parallelism's own gathers
        # on those axes are other rows, and compute waits for them
        cls = link_class(t.axis, mesh, profile)
        load = links.setdefault(cls, LinkLoad())
        if t.phase in rings and t.kind == "send":  # only rings send in these phases
            rings[t.phase] += s
            on = ring_links.setdefault(cls, dict.fromkeys(rings, 0.0))
            on[t.phase] += s
        elif t.phase in ("forward", "backward") and t.prefetched:
            if t.phase == "forward":
                load.gathers_forward += s
            else:
                load.gathers_backward += s
        elif t.phase in ("forward", "backward", "recompute"):
            out["blocking"] += s  # tensor/sequence/context parallel: compute waits for it
        elif t.phase == "p2p":
            out["p2p"] += s
        elif t.phase == "grad sync" and t.kind != "allgather":
            load.reduce += s
            buckets = max(buckets, t.calls)
        else:  # ZeRO-1/2 gathers after the update, grad norm, loss, tied sums
            out["after"] += s
    ring_mm = work.ring_seconds(profile, precision) * m
    again = work.again.ring_seconds(profile, precision) * m if work.again else 0.0
    windows = {"forward": ring_mm, "backward": BACKWARD_FACTOR * ring_mm, "recompute": again}
    # the matmuls hide the profile's share of what they could: the shorter of the two
    hidden = {k: profile.ring_overlap * min(rings[k], w) for k, w in windows.items()}
    out["blocking"] += sum(rings[k] - hidden[k] for k in windows)
    out["rings"] = (sum(rings.values()), sum(hidden.values()))
    for cls, on in ring_links.items():
        # each link holds its share of the part the matmuls hide (the rest blocks, above)
        share = {k: hidden[k] * on[k] / rings[k] if rings[k] else 0.0 for k in windows}
        links[cls].rings_forward += share["forward"]
        links[cls].rings_backward += share["backward"] + share["recompute"]
    # the windows overlap hides in (attention's recomputed scores are backward's)
    forward = (compute - work.rescore_seconds(profile, precision) * m) / (1 + BACKWARD_FACTOR)
    backward = compute - forward
    window = backward if ZeroStage.of(est.zero).shards_grads else backward / m
    per_link = [exposed_on_link(x, forward, backward, window, buckets) for x in links.values()]
    # links run side by side: the step waits for the busiest (its gathers first: compute
    # waits for them; the reduction trails)
    out["zero3"] = max((g for g, _ in per_link), default=0.0)
    out["reduce"] = max(max((g + r for g, r in per_link), default=0.0) - out["zero3"], 0.0)
    out["busy"] = compute + out["zero3"] + out["blocking"]
    out["per_axis"] = per_axis
    return out


def optimizer_seconds(est: Estimate, profile: Profile) -> float:
    """The update's memory traffic: per local state element, read and write its parameter
    (fp32), gradient (fp32) and state."""
    per = OPTIMIZER_STATE.get(est.optimizer, 8)
    elems = est.optimizer_bytes / per
    return 2 * elems * (4 + 4 + per) / profile.memory_bandwidth


def step_time(est: Estimate, work: list[Work], profile: Profile,
              precision: str = "fp32") -> StepTime:
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
        key = (tuple((x.phase, x.kind, x.axis, x.calls, x.bytes, x.prefetched) for x in t), w)
        if key not in seen:
            seen[key] = _rank_time(t, w, est, profile, precision)
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
                    comm_per_axis=busiest["per_axis"], param_gathers=busiest["zero3"],
                    ring_sends=busiest["rings"][0], ring_hidden=busiest["rings"][1])
