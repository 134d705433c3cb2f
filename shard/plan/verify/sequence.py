"""Every rank's expected communication, in order: what the runtime will call, before launch.

`rank_sequences(graph)` walks a StageGraph the way the runtime runs it and lists, for every
world rank, each collective and p2p call it makes in one training step: its kind, the
communicator (mesh axes and world ranks), the tensor it passes (shape, dtype), the bytes it
sends in the comm layer's `stats` convention (so the sums are explain's figures), the phase,
virtual stage and microbatch, and the spec step that produced it. Order, per rank:

- the schedule's actions (schedules.Schedule.with_comm; with p2p="grouped" the groups of
  p2p_groups.rank_plan, each group's messages posted together once the group before is
  waited for, and waited for by the compute reading one of them, as executor.py's grouped
  mode does): receives posted (RA/RG), forward (F:
  the stage Program's redistributions and distributed statistics in step order; ZeRO-3's
  bucket gathers at their first use), backward (B: the same in reverse order, each step's
  transposed collective; a gradient bucket starts once its parameters' gradients have all
  arrived, i.e. at the earliest step using one of them, strictly in bucket order, the rest at
  the end of backward; ZeRO-3 regathers a bucket where backward unpacks a weight a kernel
  saved, prefetching the bucket before it in forward order; zb1p splits it: B the steps on
  the path to the stage's float inputs, W the rest with every bucket), sends (SA/SG); then
  the loss report (each microbatch's loss gathered over the axes it is partial or split on,
  then summed over the pipe axis);
- the optimizer step: weights tied across stages summed over the pipe axis, per stage the
  buckets still pending and the ZeRO allreduces over the non-data axes, the grad-norm pieces,
  the norm over the pipe axis, the ZeRO-1/2 parameter gathers.

That is the order of shard/runtime/executor.py, shard/parallel/data_parallel.py,
shard/parallel/zero.py and
shard/ops/kernels.py: the explain cases (tests/cases/run_cases.py) compare it call by call with the
flight recorder of a real step for every example and test layout they run (ZeRO 0-3,
pipelines, branches, accumulation). It rests on autograd running backward in reverse creation
order and on which weights each kernel keeps, so a new kernel that keeps other tensors needs
its rule here. Communicators of one rank are left out: nothing can diverge on them. Pure
data: no torch.
"""

from __future__ import annotations

import functools
import math

import attrs

from soapstone.comm.accounting import bus_bytes
from soapstone.shard.parallel.bucket_plan import plan_buckets
from soapstone.shard.parallel.dispatch_plan import kernel_calls
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan import p2p_groups, schedules
from soapstone.shard.plan.analysis.activations import _saved
from soapstone.shard.plan.collectives import backward_bytes, backward_op, forward_bytes, forward_op
from soapstone.shard.plan.layout import P, Split
from soapstone.shard.plan.program import DIST_STATS, Compute, CopyTo, Program, Redistribute
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.verify import p2p_proof
from soapstone.shard.runtime.fusion_plan import find_fusions

F64 = "f64"


@attrs.frozen
class Op:
    """One communication call of one rank (see the module doc)."""

    kind: str  # allreduce | reduce_scatter | allgather | alltoall | broadcast | send | recv |
    # wait (completing a posted send or receive, the same peer and tag; no call of its own)
    axes: tuple[str, ...]  # the communicator's mesh axes
    ranks: tuple[int, ...]  # its world ranks, in its own rank order
    shape: tuple[int, ...]  # the tensor passed to the call (-1: rows the routing decides)
    dtype: str
    bytes: int  # what this rank sends, in the comm layer's stats convention
    phase: str  # forward | backward | grad sync | grad norm | loss | tied sum | p2p
    stage: int | None = None  # virtual stage (None: the whole rank's step)
    mb: int | None = None  # microbatch
    source: str = ""  # what made it: the spec's value, a bucket, the loss
    peer: int = -1  # p2p: the other side's world rank
    tag: tuple = ()  # p2p: (direction A|G, edge, microbatch, tensor index)
    waits: str = ""  # a wait: the kind of the call it completes (send | recv)
    # the communicator as the flight recorder names it: `data+model[0,1,2,3]`
    key: str = attrs.field(init=False, eq=False, repr=False)

    @key.default
    def _key(self) -> str:
        return _comm_key(self.axes, self.ranks)

    @property
    def is_p2p(self) -> bool:
        """A send, a receive, or a wait on one."""
        return self.kind in ("send", "recv", "wait")

    @property
    def is_call(self) -> bool:
        """A call the flight recorder numbers (a wait completes an earlier one)."""
        return self.kind != "wait"

    def signature(self) -> tuple:
        """What every member of a collective must agree on: kind, shape, dtype."""
        return (self.kind, self.shape, self.dtype)

    def describe(self) -> str:
        """One line: `allreduce (8, 16, 32) f32 on model[0,1] (forward, stage 0, mb 1, from x)`."""
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        peer = ""
        if self.is_p2p:
            peer = (" to" if self.kind == "send" else " from" if self.kind == "recv" else
                    " on the message with") + f" rank {self.peer}"
        where = [self.phase]
        if self.stage is not None:
            where.append(f"stage {self.stage}")
        if self.mb is not None:
            where.append(f"microbatch {self.mb}")
        src = f", from {self.source}" if self.source else ""
        return f"{self.kind}{peer} {shape} {self.dtype} on {self.key} ({', '.join(where)}{src})"

    def to_data(self) -> dict:
        """JSON-ready: what the watchdog is handed (comm must not import the plan)."""
        from soapstone.shard.plan.dtypes import DTYPES

        dtype = DTYPES[self.dtype].torch_name if self.dtype in DTYPES else self.dtype
        return {"op": self.kind, "key": self.key, "shape": list(self.shape),
                "dtype": dtype, "bytes": self.bytes, "peer": self.peer,
                "what": self.describe()}


@functools.lru_cache(maxsize=4096)
def _comm_key(axes: tuple[str, ...], ranks: tuple[int, ...]) -> str:
    return f"{'+'.join(axes)}[{','.join(map(str, ranks))}]"


def _coords(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(sizes):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def _rank_of(coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    r = 0
    for c, n in zip(coords, sizes, strict=True):
        r = r * n + c
    return r


class _Mesh:
    """Row-major world ranks of a mesh, and the ranks of each communicator (as comm/mesh.py)."""

    def __init__(self, mesh: tuple[tuple[str, int], ...]):
        self.axes = tuple(a for a, _ in mesh)
        self.sizes = tuple(n for _, n in mesh)
        self.shape = dict(mesh)
        self._groups: dict[tuple, tuple[tuple[str, ...], tuple[int, ...]]] = {}

    def group(self, rank: int, axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(axes in mesh order, world ranks of the communicator over them holding `rank`)."""
        axes = tuple(axes)
        got = self._groups.get((rank, axes))
        if got is None:
            got = self._groups[(rank, axes)] = self._group(rank, axes)
        return got

    def _group(self, rank: int, axes: tuple[str, ...]):
        axes = tuple(a for a in self.axes if a in set(axes))
        mine = _coords(rank, self.sizes)
        ranks = []
        for i in range(math.prod(self.shape[a] for a in axes)):
            c = list(mine)
            for a in reversed(axes):
                k = self.axes.index(a)
                i, c[k] = divmod(i, self.shape[a])
            ranks.append(_rank_of(tuple(c), self.sizes))
        return axes, tuple(ranks)

    def moved(self, rank: int, axis: str, coord: int) -> int:
        """The world rank `rank` would be at coordinate `coord` of `axis`."""
        key = (rank, axis, coord)
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = self._moved(rank, axis, coord)
        return got

    def _moved(self, rank: int, axis: str, coord: int) -> int:
        c = list(_coords(rank, self.sizes))
        c[self.axes.index(axis)] = coord
        return _rank_of(tuple(c), self.sizes)


def _shape(program: Program, name: str) -> tuple[tuple[int, ...], str]:
    v = program.value(name)
    return v.local_shape, v.dtype


@functools.lru_cache(maxsize=256)
def _consumers(program: Program) -> dict[int, str]:
    """Step index -> the spec value a collective step is for: the contraction that made a
    partial sum it reduces, else the Compute that reads its result (through further
    redistributions), else the one its input comes from."""
    made = {s.out: i for i, s in enumerate(program.steps)}
    reader: dict[str, int] = {}
    for i, s in enumerate(program.steps):
        for a in s.args if isinstance(s, Compute) else (s.src,):
            reader.setdefault(a, i)
    out = {}
    for i, s in enumerate(program.steps):
        if isinstance(s, Compute):
            out[i] = s.source or s.out
            continue
        k = made.get(s.src)
        if isinstance(s, Redistribute) and s.frm == P and k is not None and isinstance(
                program.steps[k], Compute):
            out[i] = program.steps[k].source or s.src
            continue
        j, seen = i, 0
        while j is not None and not isinstance(program.steps[j], Compute) and seen < 64:
            j, seen = reader.get(program.steps[j].out), seen + 1
        if j is not None and isinstance(program.steps[j], Compute):
            out[i] = program.steps[j].source or program.steps[j].out
        else:
            k = made.get(s.src)
            out[i] = (program.steps[k].source or s.src) if k is not None and isinstance(
                program.steps[k], Compute) else s.src
    return out


class _StageOps:
    """One virtual stage's per-microbatch collectives on one rank (forward, backward, buckets)."""

    def __init__(self, graph: StageGraph, index: int, mesh: _Mesh, rank: int,
                 locate=None):
        st = graph.stages[index]
        self.graph, self.index, self.mesh, self.rank = graph, index, mesh, rank
        self.program = p = st.program
        self.locate = locate or (lambda name: "")
        self.zero = ZeroStage.of(p.zero)
        shared = {n for n, _ in graph.shared}
        self.buckets = plan_buckets(p, p.zero, p.data_axes,
                                    tuple(n for n in shared if n in {x.name for x in p.params}))
        self.sources = _consumers(p)
        fused = find_fusions(p)
        runs_at = {i: f.at for f in fused.values() for i in f.covered}
        first: dict[str, int] = {}
        params = {x.name for x in p.params}
        for i, s in enumerate(p.steps):
            for a in s.args if isinstance(s, Compute) else ():
                if a in params:
                    first.setdefault(a, runs_at.get(i, i))
        self.first_use = first
        # a bucket is complete once its earliest-used parameter has its gradient
        self.fill_at = [min((first[n] for n in b.names if n in first), default=-1)
                        for b in self.buckets]
        self.arrive_at = [max((first[n] for n in b.names if n in first), default=-1)
                          for b in self.buckets]
        # the steps that communicate, so each microbatch walks only them
        self.fwd_steps = [i for i, s in enumerate(p.steps) if _forward_comm(p, s)]
        self.bwd_steps = [i for i, s in enumerate(p.steps) if _backward_comm(p, s)]
        self.order, self.unpacks = self._zero3_plan(fused, runs_at) if self.zero.shards_params \
            else ([], {})
        # recompute: a range's forward collectives run again where backward first unpacks a
        # tensor the range saved (the backward of its last step that keeps one)
        params_set = {x.name for x in p.params}
        self.again: dict[int, tuple[int, int]] = {}
        for a, b in p.recompute:
            keeps = [i for i in range(a, b) if i not in runs_at
                     and any(_saved(p, i, fused, params_set))]
            self.again[keeps[-1] if keeps else b - 1] = (a, b)
        # a split backward (zb1p): the steps whose backward runs in B, the rest in W
        self.on_path = _on_path(p, st.recv)

    def _zero3_plan(self, fused: dict, runs_at: dict) -> tuple[list[int], dict]:
        """ZeRO-3 (shard/parallel/zero.py): the sharded buckets in forward order, and per run index
        the buckets whose parameters that step's kernel saves for backward, in the order its
        backward unpacks them (each unpack gathers the bucket again and prefetches the one
        before it in forward order)."""
        p = self.program
        owner = {n: k for k, b in enumerate(self.buckets) if self.sharded(b) for n in b.names}
        first: dict[int, int] = {}
        for i, s in enumerate(p.steps):
            at = runs_at.get(i, i)
            for a in s.args if isinstance(s, Compute) else (s.src,):
                if a in owner:
                    first[owner[a]] = min(first.get(owner[a], at), at)
        unpacks: dict[int, list[int]] = {}
        for i, s in enumerate(p.steps):
            if i in runs_at or not isinstance(s, Compute):
                continue
            f = fused.get(i)
            if f is not None:  # a fused linear keeps its weight (addmm), attention none
                args = (f.w,) if hasattr(f, "w") else ()
            elif s.kind in ("einsum", "mul", "layernorm", "rmsnorm") or \
                    s.kind.startswith("custom:"):
                args = s.args  # the kernels keep their weights (an embedding keeps ids)
            elif s.kind == "moe":  # backward meets the experts' matmuls first, the router last
                args = tuple(reversed(s.args[1:]))
            else:
                args = ()
            for a in args:
                if a in owner and owner[a] not in unpacks.get(i, []):
                    unpacks.setdefault(i, []).append(owner[a])
        return sorted(first, key=first.get), unpacks

    # -- helpers ---------------------------------------------------------------------------
    def op(self, kind, axes, shape, dtype, payload, phase, mb, source) -> Op | None:
        """The op on this rank's communicator over `axes` (None when it has one rank)."""
        axes, ranks = self.mesh.group(self.rank, axes)
        if len(ranks) <= 1:
            return None
        where = self.locate(source)
        src = f"{source} ({where})" if where else source
        return Op(kind, axes, ranks, tuple(shape), dtype, bus_bytes(kind, payload, len(ranks)),
                  phase, self.index, mb, src)

    def _n(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def _padded(self, b) -> int:
        n = self._n(b.dp)
        return -(-b.numel // n) * n

    def _master(self) -> str:
        floats = [x for x in self.program.params if x.dtype in ("f32", "f64", "bf16", "f16")]
        return "f64" if floats and floats[0].dtype == "f64" else "f32"

    def _item(self, b) -> tuple[str, int]:
        from soapstone.shard.plan.dtypes import DTYPE_BYTES

        dt = self.program.value(b.names[0]).dtype
        return dt, DTYPE_BYTES[dt]

    def stage(self, b) -> ZeroStage:
        """The ZeRO stage bucket b runs (0 over a single data rank)."""
        return self.zero.on(self._n(b.dp))

    def sharded(self, b) -> bool:
        """Whether bucket b is reduce-scattered (ZeRO >= 1 over more than one rank)."""
        return self.stage(b).shards_optimizer

    # -- forward ---------------------------------------------------------------------------
    def forward(self, mb: int) -> list[Op]:
        """The stage's forward collectives for one microbatch, in step order."""
        p, out = self.program, []
        gather_at: dict[int, list[int]] = {}
        if self.zero.shards_params:
            for k in self.order:  # the buckets first used at one step, in forward order
                gather_at.setdefault(self.fill_at[k], []).append(k)
        issued: set[int] = set()
        for i in sorted(set(self.fwd_steps) | set(gather_at)):
            for k in gather_at.get(i, ()):
                # zero.py gathers k (unless a prefetch has) and prefetches the next bucket
                # at once, before this step's own collectives
                at = self.order.index(k)
                for g in self.order[at:at + 2]:
                    if g not in issued:
                        issued.add(g)
                        out.append(self._zero3_gather(g, "forward", mb))
            out.extend(self._forward_step(i, p.steps[i], mb))
        return [o for o in out if o is not None]

    def _forward_step(self, i, s, mb) -> list[Op | None]:
        p, src = self.program, self.sources[i]
        if isinstance(s, Redistribute | CopyTo):
            kind = forward_op(s)
            if not kind:
                return []
            shape, dtype = _shape(p, s.src)
            return [self.op(kind, (s.axis,), shape, dtype, forward_bytes(p, s), "forward",
                            mb, src)]
        if isinstance(s, Compute) and s.dist:
            return [self.op("allreduce", (axis,), shape, dtype, nbytes, "forward", mb, src)
                    for shape, dtype, nbytes, _ in self._stats(s) for axis in s.dist] + [
                self.op(c.kind, c.axes, c.shape, c.dtype, c.payload, "forward", mb, src)
                for c in kernel_calls(p, s) if c.phase == "forward"]
        return []

    def _stats(self, s: Compute) -> list[tuple[tuple[int, ...], str, int, bool]]:
        """(shape, dtype, bytes, reduced back in backward) of each statistic a distributed op
        allreduces (shard/ops/kernels.py: keepdim reductions; cross_entropy's sums drop the dim)."""
        from soapstone.shard.plan.dtypes import DTYPE_BYTES

        x = self.program.value(s.args[0])
        over = str(s.attr("over"))
        item = DTYPE_BYTES.get(x.dtype, 4)
        keep = tuple(1 if d == over else n for d, n in zip(x.dims, x.local_shape, strict=True))
        lead = tuple(n for d, n in zip(x.dims, x.local_shape, strict=True) if d != over)
        out = []
        for k, (_red, back) in enumerate(DIST_STATS.get(s.kind, ())):
            shape = keep if s.kind != "cross_entropy" else lead + (1,) if k == 0 else lead
            out.append((shape, x.dtype, math.prod(shape) * item, back))
        return out

    def _zero3_gather(self, k: int, phase: str, mb: int) -> Op | None:
        b = self.buckets[k]
        dt, item = self._item(b)
        padded = self._padded(b)
        return self.op("allgather", b.dp, (padded // self._n(b.dp),), dt, padded * item, phase,
                       mb, f"bucket {k} ({b.names[0]}{', ...' if len(b.names) > 1 else ''})")

    # -- backward --------------------------------------------------------------------------
    def backward(self, mb: int, state: dict, weights: bool = False) -> list[Op]:
        """Backward collectives of one microbatch in reverse step order, with the gradient
        buckets' reductions where they start; `state` carries pending buckets across
        microbatches (ZeRO-2's scatters complete at the next microbatch's first gradient).
        weights: a split backward's W, without the steps B ran (backward_input)."""
        p, out = self.program, []
        last = mb == self.graph.microbatches - 1
        nb = len(self.buckets)
        arrive: dict[int, list[int]] = {}
        fill: dict[int, list[int]] = {}
        for k in range(nb):
            arrive.setdefault(self.arrive_at[k], []).append(k)
            fill.setdefault(self.fill_at[k], []).append(k)
        full = [False] * nb
        nxt = 0
        gathered: set[int] = set()  # ZeRO-3: buckets gathered (or prefetched) in backward
        for i in sorted(set(self.bwd_steps) | set(arrive) | set(fill) | set(self.unpacks)
                        | set(self.again) | {-1}, reverse=True):
            if i in self.again:
                a, b = self.again[i]
                out.extend(o for j in range(a, b) for o in self._forward_step(j, p.steps[j], mb)
                           if o is not None)
            for k in self.unpacks.get(i, ()):  # saved weights unpacked: gather, prefetch
                prev = self.order.index(k) - 1
                for g in (k, self.order[prev]) if prev >= 0 else (k,):
                    if g not in gathered:
                        gathered.add(g)
                        out.append(self._zero3_gather(g, "backward", mb))
            for k in arrive.get(i, ()):  # the bucket's first gradient of this backward
                if k in state["pending"]:
                    state["pending"].discard(k)
                    out.append(self._rest(k, mb))
            for k in fill.get(i, ()):
                full[k] = True
                gathered.discard(k)  # all its gradients are in: freed (zero.py grad_done)
            while nxt < nb and full[nxt]:
                out.extend(self._launch(nxt, mb, last, state))
                nxt += 1
            if i >= 0 and not (weights and i in self.on_path):
                out.extend(self._backward_step(i, p.steps[i], mb))
        for k in range(nxt, nb):  # the end-of-backward callback: what is left
            out.extend(self._launch(k, mb, last, state))
        return [o for o in out if o is not None]

    def backward_input(self, mb: int) -> list[Op]:
        """A split backward's B (shard/runtime/split_backward.py): the collectives of the steps on
        the path to the stage's float inputs, in reverse step order; no parameter gets its
        gradient yet, so no bucket moves."""
        out = []
        for i in sorted(self.on_path & set(self.bwd_steps), reverse=True):
            out.extend(self._backward_step(i, self.program.steps[i], mb))
        return [o for o in out if o is not None]

    def _backward_step(self, i, s, mb) -> list[Op | None]:
        p, src = self.program, self.sources[i]
        if isinstance(s, Redistribute | CopyTo):
            kind = backward_op(s)
            if not kind or not p.value(s.src).is_float:
                return []
            shape, dtype = _shape(p, s.out)
            return [self.op(kind, (s.axis,), shape, dtype, backward_bytes(p, s), "backward",
                            mb, src)]
        if isinstance(s, Compute) and s.dist:
            return [self.op(c.kind, c.axes, c.shape, c.dtype, c.payload, "backward", mb, src)
                    for c in kernel_calls(p, s) if c.phase == "backward"] + [
                self.op("allreduce", (axis,), shape, dtype, nbytes, "backward", mb, src)
                for shape, dtype, nbytes, back in reversed(self._stats(s)) if back
                for axis in reversed(s.dist)]
        return []

    def _launch(self, k: int, mb: int, last: bool, state: dict) -> list[Op | None]:
        b = self.buckets[k]
        if b.deferred:
            state["dirty"].add(k)
            return []
        if not self.stage(b).shards_grads and not last:
            state["dirty"].add(k)  # no_sync: reduced with the last microbatch
            return []
        state["dirty"].discard(k)
        return self._reduce(k, mb, state)

    def _reduce(self, k: int, mb: int | None, state: dict) -> list[Op | None]:
        b = self.buckets[k]
        padded = self._padded(b)
        what = f"bucket {k} ({b.names[0]}{', ...' if len(b.names) > 1 else ''})"
        master = self._master()
        width = 8 if master == "f64" else 4
        if not self.sharded(b):
            return [self.op("allreduce", b.sync, (padded,), master, padded * width,
                            "grad sync", mb, what)] if b.sync else []
        state["pending"].add(k)
        return [self.op("reduce_scatter", b.dp, (padded,), master, padded * width, "grad sync",
                        mb, what)]

    def _rest(self, k: int, mb: int | None) -> Op | None:
        b = self.buckets[k]
        rest = tuple(a for a in b.sync if a not in b.dp)
        if not rest:
            return None
        padded = self._padded(b)
        master = self._master()
        return self.op("allreduce", rest, (padded // self._n(b.dp),), master,
                       padded // self._n(b.dp) * (8 if master == "f64" else 4), "grad sync",
                       mb, f"bucket {k} ({b.names[0]}{', ...' if len(b.names) > 1 else ''})")

    # -- optimizer step --------------------------------------------------------------------
    def finish_and_norm(self, state: dict) -> list[Op]:
        """The optimizer's finish() (pending launches, then completions) and the grad-norm
        pieces, one float64 allreduce per set of axes the segments are pieces over."""
        out: list[Op | None] = []
        for k in sorted(state["dirty"]):
            out.extend(self._reduce(k, None, state))
        state["dirty"].clear()
        for k in range(len(self.buckets)):
            if k in state["pending"]:
                state["pending"].discard(k)
                out.append(self._rest(k, None))
        keys = set()
        for b in self.buckets:
            axes = set(b.split) | (set(b.dp) if self.sharded(b) else set())
            keys.add(tuple(sorted(axes)))
        for key in sorted(keys):
            if key:
                out.append(self.op("allreduce", key, (1,), F64, 8, "grad norm", None,
                                   "gradient norm"))
        return [o for o in out if o is not None]

    def publish(self) -> list[Op]:
        """ZeRO-1/2: every sharded bucket's updated parameters gathered over the data axes."""
        out = []
        for k, b in enumerate(self.buckets):
            if self.stage(b).publishes_params:
                dt, item = self._item(b)
                padded = self._padded(b)
                out.append(self.op("allgather", b.dp, (padded // self._n(b.dp),), dt,
                                   padded * item, "grad sync", None,
                                   f"bucket {k} ({b.names[0]}"
                                   f"{', ...' if len(b.names) > 1 else ''})"))
        return [o for o in out if o is not None]

    def loss(self, mb: int) -> list[Op]:
        """The microbatch's loss gathered over the axes it is partial or split on."""
        p = self.program
        lv = p.value(p.loss.value)
        out = []
        for axis, placement in lv.layout.placements:
            kind = "allreduce" if placement == P else (
                "allgather" if isinstance(placement, Split) else "broadcast")
            payload = lv.nbytes * (self.mesh.shape[axis] if kind == "allgather" else 1)
            out.append(self.op(kind, (axis,), lv.local_shape, lv.dtype, payload, "loss", mb,
                               p.loss.value))
        return [o for o in out if o is not None]


def _wait(o: Op) -> Op:
    """The wait completing posted send or receive `o` (attrs.evolve, without its cost)."""
    return Op("wait", o.axes, o.ranks, o.shape, o.dtype, o.bytes, o.phase, o.stage, o.mb,
              o.source, o.peer, o.tag, o.kind)


def _on_path(p: Program, recv: tuple[str, ...]) -> frozenset[int]:
    """The steps whose output depends, through float values, on a float value the stage
    receives: autograd reaches the stage's inputs through them, so a split backward's B runs
    their backward (shard/runtime/split_backward.py); a first stage, receiving token ids, has
    none."""
    dep = {n for n in recv if p.value(n).is_float}
    out = set()
    for i, s in enumerate(p.steps):
        args = s.args if isinstance(s, Compute) else (s.src,)
        if p.value(s.out).is_float and any(a in dep for a in args):
            dep.add(s.out)
            out.add(i)
    return frozenset(out)


def _forward_comm(p: Program, s) -> bool:
    return bool(forward_op(s)) if isinstance(s, Redistribute | CopyTo) else bool(
        isinstance(s, Compute) and s.dist)


def _backward_comm(p: Program, s) -> bool:
    if isinstance(s, Redistribute | CopyTo):
        return bool(backward_op(s)) and p.value(s.src).is_float
    return isinstance(s, Compute) and bool(s.dist)


def rank_sequence(graph: StageGraph, rank: int, schedule: schedules.Schedule | None = None,
                  locate=None, mesh: _Mesh | None = None, p2p: str = "ahead") -> tuple[Op, ...]:
    """World rank `rank`'s calls in one training step (the module doc's order). `schedule`:
    the pipeline schedule to play (default the graph's); `locate(name)`: a spec location for
    a value name ("" when unknown); `mesh`: shared by the calls for every rank; `p2p`: the
    executor's p2p mode (ahead | grouped)."""
    mesh = mesh or _Mesh(graph.mesh)
    sched = schedule or schedules.build(graph.schedule, graph.pipe, graph.microbatches,
                                        graph.chunks)
    axis = graph.axis
    pipe_rank = _coords(rank, mesh.sizes)[mesh.axes.index(axis)] if axis else 0
    stages = {s.index: _StageOps(graph, s.index, mesh, rank, locate)
              for s in graph.stages_of(pipe_rank)}
    states = {i: {"pending": set(), "dirty": set()} for i in stages}
    out: list[Op] = []
    last_stage = len(graph.stages) - 1
    rows: dict = {}  # (action kind, stage) -> its p2p ops but for the microbatch
    posted: dict[tuple, list[Op]] = {}  # (direction, stage, mb) -> receives to wait for
    sends: list[Op] = []
    inflight: list[Op] = []  # grouped: the last group's messages not yet waited for
    if p2p == "grouped":
        # an unproven schedule is played as consume: the simulation names its deadlock
        items = p2p_groups.rank_plan(sched, pipe_rank, False,
                                     p2p_proof.choose(sched) or "consume")
    else:
        items = sched.with_comm(pipe_rank)
    for a in items:
        if isinstance(a, p2p_groups.Group):  # the group before is complete first
            out.extend(_wait(o) for o in inflight)
            inflight = []
            for x in a.ops:
                ops = _p2p(graph, mesh, rank, x.action, rows, locate)
                out.extend(ops)
                inflight.extend(ops)
                if not x.sending:
                    posted[(x.direction, x.action.stage, x.action.mb)] = ops
        elif not a.kind.compute:
            ops = _p2p(graph, mesh, rank, a, rows, locate)
            out.extend(ops)
            if a.kind.sending:
                sends.extend(ops)
            else:
                posted[(a.kind.direction, a.stage, a.mb)] = ops
        elif not a.kind.messages:  # a split backward's weight half (W): it reads no message
            out.extend(stages[a.stage].backward(a.mb, states[a.stage], weights=True))
        else:  # F, B
            # the compute waits for the receives it reads (executor._wait)
            got = posted.pop((a.kind.direction, a.stage, a.mb), [])
            out.extend(_wait(o) for o in got)
            if got and inflight:  # grouped: the whole group, as on NCCL
                out.extend(_wait(o) for o in inflight if not any(o is g for g in got))
                inflight = []
            st = stages[a.stage]
            if a.kind is schedules.ActionKind.F:
                out.extend(st.forward(a.mb))
            else:
                out.extend(st.backward_input(a.mb) if sched.split
                           else st.backward(a.mb, states[a.stage]))
    # the step's end waits for its sends
    out.extend(_wait(o) for o in inflight + sends)
    if last_stage in stages:
        for mb in range(graph.microbatches):
            out.extend(stages[last_stage].loss(mb))
    pipe = _pipe_op(graph, mesh, rank)
    if pipe:
        out.append(pipe("loss", (1,), 8, "the loss"))
        tied = sum(math.prod(graph.stages[w[0]].program.value(n).local_shape)
                   for n, w in graph.shared)
        if graph.shared:
            out.append(pipe("tied sum", (tied,), 8 * tied,
                            "tied weights " + ", ".join(n for n, _ in graph.shared)))
    for i, st in stages.items():
        out.extend(st.finish_and_norm(states[i]))
    if pipe:
        out.append(pipe("grad norm", (1,), 8, "gradient norm"))
    for st in stages.values():
        out.extend(st.publish())
    return tuple(out)


def _pipe_op(graph: StageGraph, mesh: _Mesh, rank: int):
    """A maker of float64 allreduces over the pipe axis (None without one)."""
    if graph.axis is None or graph.pipe <= 1:
        return None
    axes, ranks = mesh.group(rank, (graph.axis,))

    def make(phase, shape, payload, source):
        return Op("allreduce", axes, ranks, shape, F64, bus_bytes("allreduce", payload,
                                                                  len(ranks)), phase,
                  source=source)
    return make


def _p2p(graph: StageGraph, mesh: _Mesh, rank: int, a: schedules.Action,
         cache: dict, locate) -> list[Op]:
    """The sends or receives of one communication action: one per boundary tensor, its shape
    taken from this side's own stage Program (the other side's is checked against it)."""
    rows = cache.get((a.kind, a.stage))
    if rows is None:
        rows = cache[(a.kind, a.stage)] = _p2p_rows(graph, mesh, rank, a, locate)
    return [Op(kind, axes, ranks, shape, dtype, nbytes, "p2p", here, a.mb, what, peer,
               (direction, src, a.mb, i))
            for kind, axes, ranks, shape, dtype, nbytes, here, what, peer, direction, src, i
            in rows]


def _p2p_rows(graph: StageGraph, mesh: _Mesh, rank: int, a: schedules.Action,
              locate) -> list[tuple]:
    """What _p2p's ops share across microbatches (all but the microbatch)."""
    axis = graph.axis
    edge, direction = graph.edges[a.kind.edge(a.stage)], a.kind.direction
    forward = direction is schedules.Direction.A
    tensors = edge.tensors if forward else tuple(t for t in edge.tensors if t.is_float)
    sending = a.kind.sending
    # activations go src -> dst, gradients dst -> src
    frm, to = (edge.src, edge.dst) if forward else (edge.dst, edge.src)
    here, there = (frm, to) if sending else (to, frm)
    program = graph.stages[here].program
    peer = mesh.moved(rank, axis, graph.stages[there].rank)
    axes, ranks = mesh.group(rank, (axis,))
    # the edge's source stage sends (and gets gradients for) one of its outputs; the
    # destination stage receives an input of that name
    outputs = {o.name: o.value for o in program.outputs} if here == edge.src else {}
    rows = []
    for i, t in enumerate(tensors):
        try:
            shape, dtype = _shape(program, outputs.get(t.name, t.name))
        except KeyError:
            shape, dtype = (), "missing"
        nbytes = math.prod(shape) * _width(dtype) if sending else 0
        where = locate(t.name) if locate else ""
        rows.append(("send" if sending else "recv", axes, ranks, shape, dtype, nbytes, here,
                     f"{direction.noun} {t.name}" + (f" ({where})" if where else "")
                     + f" of edge {edge.src} -> {edge.dst}", peer, direction, edge.src, i))
    return rows


def _width(dtype: str) -> int:
    from soapstone.shard.plan.dtypes import DTYPE_BYTES

    return DTYPE_BYTES.get(dtype, 0)


def rank_sequences(graph: StageGraph, schedule: schedules.Schedule | None = None,
                   locate=None, ranks=None, p2p: str = "ahead") -> dict[int, tuple[Op, ...]]:
    """Every world rank's sequence (rank_sequence for each; `ranks`: only those)."""
    mesh = _Mesh(graph.mesh)
    return {r: rank_sequence(graph, r, schedule, locate, mesh, p2p)
            for r in (range(graph.world_size) if ranks is None else ranks)}


def expected_by_comm(ops: tuple[Op, ...]) -> dict[str, dict[str, list[dict]]]:
    """One rank's sequence as the watchdog takes it: communicator key -> {"collective": [...],
    "p2p": [...]}, each op as plain data (Op.to_data), in call order."""
    out: dict[str, dict[str, list[dict]]] = {}
    for o in ops:
        if not o.is_call:
            continue
        row = out.setdefault(o.key, {"collective": [], "p2p": []})
        row["p2p" if o.is_p2p else "collective"].append(o.to_data())
    return out
