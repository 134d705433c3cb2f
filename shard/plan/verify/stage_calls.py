"""One virtual stage's communication calls on one rank, per microbatch: forward, backward,
gradient buckets, ZeRO, the loss (sequence.py plays them in the schedule's order; its doc
says what the order rests on). Pure data: no torch.
"""

from __future__ import annotations

import functools
import math

from soapstone.comm.accounting import bus_bytes
from soapstone.shard.ops.registry import record_of
from soapstone.shard.parallel.bucket_plan import plan_buckets
from soapstone.shard.parallel.regather_plan import first_backward_reader, gather_step
from soapstone.shard.parallel.ring_plan import (
    find_rings,
    float8_gathers_beside_rings,
    float8_rings,
    ring_chunk,
    ring_sends,
)
from soapstone.shard.parallel.zero_stage import ZeroStage
from soapstone.shard.plan.analysis.activations import step_saves
from soapstone.shard.plan.collectives import backward_bytes, backward_op, forward_bytes, forward_op
from soapstone.shard.plan.dtypes import DTYPE_BYTES, is_float
from soapstone.shard.plan.layout import P, RedistributeKind, Split
from soapstone.shard.plan.program import Compute, CopyTo, Program, Redistribute
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.verify.calls import F64, MeshRanks, Op
from soapstone.shard.runtime.fusion_plan import find_fusions


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


class StageCalls:
    """One virtual stage's per-microbatch collectives on one rank (forward, backward, buckets)."""

    def __init__(self, graph: StageGraph, index: int, mesh: MeshRanks, rank: int,
                 locate=None):
        st = graph.stages[index]
        self.graph, self.index, self.mesh, self.rank = graph, index, mesh, rank
        self.program = p = st.program
        self.locate = locate or (lambda name: "")
        self.zero = ZeroStage.of(p.zero)
        shared = {n for n, _ in graph.shared}
        self.buckets = plan_buckets(p, p.zero, p.zero_axes,
                                    tuple(n for n in shared if n in {x.name for x in p.params}))
        self.sources = _consumers(p)
        self.rings = find_rings(p)
        self._ring_runs: dict[tuple, int] = {}
        fused = find_fusions(p)
        runs_at = {i: f.at for f in fused.values() for i in f.covered}
        runs_at.update({j: r.at for r in self.rings.values() for j in r.matmuls})
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
            # a ring saves its input (comm/collective_matmul.py: unpacking it runs the range)
            keeps = [i for i in range(a, b) if i in self.rings or (
                i not in runs_at and any(step_saves(p, i, fused, params_set)))]
            self.again[keeps[-1] if keeps else b - 1] = (a, b)
        # a split backward (zb1p): the steps whose backward runs in B, the rest in W
        self.on_path = _on_path(p, st.recv)
        # sequence parallelism: a gathered linear input gathered again before the backward
        # of its last reader (regather_plan.py)
        self.regather: dict[int, list[int]] = {}
        # --precision float8: the gathers that move e4m3 (einsum.float8_gathers)
        self.float8_gathers = float8_gathers_beside_rings(p, marked=True)
        # and the rings that move float8 chunks (ring_plan.float8_rings)
        self.float8_rings = float8_rings(p, marked=True)
        for n in p.regathered:
            at = first_backward_reader(p, n, runs_at)
            self.regather.setdefault(at, []).append(gather_step(p, n))

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
            else:  # what the kernel keeps, in the order backward unpacks it (its record)
                args = record_of(s.kind).keeps(s)
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
        floats = [x for x in self.program.params if is_float(x.dtype)]
        return "f64" if floats and floats[0].dtype == "f64" else "f32"

    def _item(self, b) -> tuple[str, int]:
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

    def _gather(self, j: int, phase: str, mb) -> list[Op | None]:
        """Step j's forward collective (in `phase`): under float8, a float8 gather is the
        amax's allreduce, then the e4m3 bytes gathered as uint8 (shard/runtime/float8.py)."""
        p, s, src = self.program, self.program.steps[j], self.sources[j]
        shape, dtype = _shape(p, s.src)
        if j in self.float8_gathers:
            return [self.op("allreduce", (s.axis,), (1,), "f32", 4, phase, mb, src),
                    self.op("allgather", (s.axis,), shape, "uint8",
                            math.prod(p.value(s.out).local_shape), phase, mb, src)]
        return [self.op(forward_op(s), (s.axis,), shape, dtype, forward_bytes(p, s), phase,
                        mb, src)]

    def _ring(self, i: int, phase: str, mb: int) -> list[Op]:
        """A collective matmul's p2p calls (comm/collective_matmul.py): per ring step a send to
        the next rank and a receive from the previous, posted together, then both waited.
        A float8 ring's chunks (a gather's forward, a scatter's backward: shard/runtime/
        float8.py) follow the amax's allreduce and travel as uint8, 1 byte an element."""
        ring, p = self.rings[i], self.program
        axes, ranks = self.mesh.group(self.rank, (ring.axis,))
        if len(ranks) <= 1:
            return []
        shape, dtype = _shape(p, ring_chunk(p, ring))
        at, n = ranks.index(self.rank), len(ranks)
        # a recomputed range runs the ring again: each run's messages are their own
        run = self._ring_runs[(phase, i, mb)] = self._ring_runs.get((phase, i, mb), -1) + 1
        out = []
        gather = ring.kind is RedistributeKind.ALLGATHER
        if i in self.float8_rings and gather == (phase == "forward"):
            out.append(self.op("allreduce", (ring.axis,), (1,), "f32", 4, phase, mb,
                               self.sources[i]))
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if out:
            dtype, nbytes = "uint8", math.prod(shape)
        for k in range(ring_sends(p, ring)):
            pair = [Op(kind, axes, ranks, shape, dtype, b, phase, self.index, mb,
                       self.sources[i], ranks[(at + d) % n], ("ring", phase, i, mb, run, k))
                    for kind, b, d in (("send", nbytes, 1), ("recv", 0, -1))]
            out += pair + [o.waited() for o in pair]
        return out

    def _forward_step(self, i, s, mb) -> list[Op | None]:
        p, src = self.program, self.sources[i]
        if i in self.rings:
            return self._ring(i, "forward", mb)
        if isinstance(s, Redistribute | CopyTo):
            return self._gather(i, "forward", mb) if forward_op(s) else []
        if isinstance(s, Compute) and s.dist:
            return [self.op("allreduce", (axis,), shape, dtype, nbytes, "forward", mb, src)
                    for shape, dtype, nbytes, _ in self._stats(s) for axis in s.dist] + [
                self.op(c.kind, c.axes, c.shape, c.dtype, c.payload, "forward", mb, src)
                for c in record_of(s.kind).calls(p, s) if c.phase == "forward"]
        return []

    def _stats(self, s: Compute) -> list[tuple[tuple[int, ...], str, int, bool]]:
        """(shape, dtype, bytes, reduced back in backward) of each statistic a distributed op
        allreduces, as its record's dist_stats lists them."""
        x = self.program.value(s.args[0])
        over = str(s.attr("over"))
        item = DTYPE_BYTES.get(x.dtype, 4)
        rec = record_of(s.kind)
        out = []
        for k, stat in enumerate(rec.dist_stats):
            shape = rec.stat_shape(k, x.dims, x.local_shape, over)
            out.append((shape, x.dtype, math.prod(shape) * item, stat.backward))
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
                        | set(self.again) | set(self.regather) | {-1}, reverse=True):
            if not (weights and i in self.on_path):
                out.extend(self._regather(i, mb))
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
        for i in sorted(self.on_path & (set(self.bwd_steps) | set(self.regather)), reverse=True):
            out.extend(self._regather(i, mb))
            out.extend(self._backward_step(i, self.program.steps[i], mb))
        return [o for o in out if o is not None]

    def _regather(self, i, mb) -> list[Op | None]:
        """The gathers of the linear inputs whose first backward reader runs at i, again."""
        return [o for j in self.regather.get(i, ()) for o in self._gather(j, "backward", mb)]

    def _backward_step(self, i, s, mb) -> list[Op | None]:
        p, src = self.program, self.sources[i]
        if i in self.rings:
            return self._ring(i, "backward", mb)
        if isinstance(s, Redistribute | CopyTo):
            kind = backward_op(s)
            if not kind or not p.value(s.src).is_float:
                return []
            shape, dtype = _shape(p, s.out)
            return [self.op(kind, (s.axis,), shape, dtype, backward_bytes(p, s), "backward",
                            mb, src)]
        if isinstance(s, Compute) and s.dist:
            return [self.op(c.kind, c.axes, c.shape, c.dtype, c.payload, "backward", mb, src)
                    for c in record_of(s.kind).calls(p, s) if c.phase == "backward"] + [
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
