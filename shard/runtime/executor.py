"""The executor: every layout is a StageGraph (no stages = one stage), run by one schedule.

    graph = soapstone.dsl.compile.stages.lower_graph(model, parallel)   # any layout, or None: one
    rank
    ex = Executor(graph, mesh, seed=0)                          # mesh: None on one rank
    ex.use_optimizer(name="adamw", lr=1e-3, grad_clip=1.0)      # shard/train/optim.py per stage
    for i, batch in enumerate(data):     # full global batches, the same on every rank
        loss = ex.train_step(batch, step=i)   # every microbatch's forward and backward, then
                                              # gradient sync, clipping, update; the loss of
                                              # the whole batch (mean over microbatches)
    ex.write_chrome_trace("trace.json")  # the last step's timeline, every rank (collective)

Each virtual stage this rank runs is a `ShardedModel` of its stage Program on the mesh without
the pipe axis, so collectives inside a stage are those of the single-program runtime. Without a
pipe axis there is one stage and no p2p; its microbatches (`schedule ..., microbatches = k`)
are gradient accumulation, by the same code as a pipeline's. The schedule
(shard/plan/schedules/) is a list of actions, and its p2p runs in one of two modes:

- `ahead` (the default on CPU): receives are posted ahead as non-blocking irecvs into buffers
  of the compile-time boundary shapes, sends are non-blocking isends, each let go once it
  completes (tested between actions), so a rank computes while its messages travel. Every
  message has a tag naming (direction, edge, microbatch, tensor), so matching never depends
  on arrival order.
- `grouped` (always on CUDA; `p2p="grouped"` or SOAPSTONE_P2P=grouped on CPU): NCCL has no
  tags and runs a rank's p2p in issue order, so each rank issues its sends and receives in
  the groups of shard/plan/p2p_groups.py (one `batch_p2p` each, a receive at the compute
  reading it), proven deadlock-free and FIFO-paired by its rendezvous simulation. A group
  starts once the one before it is complete, and the compute reading a receive waits for the
  whole group, as on NCCL's single side stream. Messages pair by order alone (one tag); on
  MPI the sends are synchronous (Issend), which complete only when matched, as NCCL's do: a
  CPU run then has NCCL's blocking structure.

Before sending, the actual tensor is checked against the stage graph (ShapeMismatch, which
aborts the MPI job through the failure handler instead of leaving the receiver hanging); the
messages themselves are shard/runtime/pipe_p2p.py's. Memory: a microbatch's stored values go at the
last part of its backward, sends as they complete (forward_backward).

Gradients take one path: each stage's optimizer (build_optimizer: buckets, ZeRO, overlap)
reduces them; weights tied across stages are its deferred parameters, summed over the pipe axis
first; clipping uses the norm over every stage and axis. The loss of a microbatch is a mean
over it; the last stage backpropagates loss / microbatches, so the accumulated gradients are
those of the mean over the whole batch, as on one rank. `train_step([b0, b1, ...])` goes on
accumulating over several full batches before one update (`run --accumulate`). `infer` runs
the schedule's forward actions only (evaluation, generation).
"""

from __future__ import annotations

import contextlib
import math
import numbers

import attrs
import torch

from soapstone.shard.data.batch_check import check_batch, check_ranges, index_ranges
from soapstone.shard.data.errors import DataError
from soapstone.shard.plan import p2p_groups, schedules
from soapstone.shard.plan.program import Value
from soapstone.shard.plan.schedules import ActionKind
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.verify import p2p_proof
from soapstone.shard.runtime import trace as tr
from soapstone.shard.runtime.float8 import check_graph
from soapstone.shard.runtime.p2p_mode import P2PModeError, check_device, p2p_mode
from soapstone.shard.runtime.pipe_p2p import PipeP2P
from soapstone.shard.runtime.sharded_model import ShardedModel, check_mesh
from soapstone.shard.runtime.split_backward import WeightPass, backward_input
from soapstone.shard.runtime.sub_mesh import SubMesh
from soapstone.shard.train.errors import SettingError

# the compute kinds the step loops dispatch on, read once: an enum member read through its
# class costs ~0.2 us on Python 3.11, and the loops ask for every action of every step
FORWARD, BACKWARD, WEIGHTS = ActionKind.F, ActionKind.B, ActionKind.W


@attrs.define
class _Step:
    """What one forward_backward holds, keyed (microbatch, virtual stage), each only until
    its last use: a rank's memory follows the microbatches its schedule has in flight."""

    mbs: list  # the microbatches' inputs (views of the batch)
    step: int
    scale: int
    sync: bool
    stored: dict = attrs.Factory(dict)  # F's inputs (received) and outputs, until its B
    back: dict = attrs.Factory(dict)  # B's input gradients, until SG sends them
    weights: dict = attrs.Factory(dict)  # split backward: B done, its WeightPass until W
    pending: dict = attrs.Factory(dict)  # posted receives, until the compute reading them
    inflight: list = attrs.Factory(list)  # grouped: the works of the last group issued
    losses: dict = attrs.Factory(dict)  # detached scalars


class Executor:
    """This rank's share of a layout (see the module doc for the training loop)."""

    def __init__(self, graph: StageGraph, mesh=None, seed: int = 0, custom: dict | None = None,
                 dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 trace: bool = False, device: torch.device | str | None = None,
                 p2p: str | None = None, draw: bool = True, float8: bool = False):
        if graph.world_size > 1:
            check_mesh(mesh, graph.mesh, f"layout {graph.model}/{graph.parallel}")
        if float8:
            check_graph(graph)
        self.graph = graph
        self.mesh = mesh
        # every stage's, not this rank's: each rank then refuses a bad batch alike
        self.index_ranges = index_ranges([s.program for s in graph.stages])
        # where parameters, activations and every buffer sent between ranks live
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        check_device(graph, self.device)
        self.compute_dtype = compute_dtype or dtype
        self.trace = trace
        piped = graph.axis is not None
        self.pipe_rank = mesh.coord(graph.axis) if piped else 0
        self.pipe_comm = mesh.comm(graph.axis) if piped else None
        sub = SubMesh(mesh, graph.axis) if piped else mesh
        self.stages = {s.index: s for s in graph.stages_of(self.pipe_rank)}
        self.models = {i: ShardedModel(s.program, sub, seed=seed, custom=custom, dtype=dtype,
                                       compute_dtype=compute_dtype, device=self.device,
                                       draw=draw, float8=float8)
                       for i, s in self.stages.items()}
        self.schedule = schedules.build(graph.schedule, graph.pipe, graph.microbatches,
                                        graph.chunks)
        # p2p: "ahead" or "grouped" (the module doc; p2p_mode picks it when None)
        self.p2p = p2p_mode(p2p, self.device)
        self.wire = PipeP2P(graph, self.pipe_comm, self.device, self.compute_dtype)
        # a V's turn: the edges joining two stages of this rank, handed over in memory
        self.turns = {e.src for e in graph.edges
                      if e.src_rank == e.dst_rank == self.pipe_rank}
        if self.p2p == "grouped":
            grouping = p2p_proof.choose(self.schedule)
            if grouping is None:
                raise P2PModeError(f"layout {graph.parallel}: p2p = grouped, but "
                                   + (p2p_proof.unproven(self.schedule) or ""))
            self.actions = p2p_groups.rank_plan(self.schedule, self.pipe_rank, False, grouping)
            self._infer_actions = p2p_groups.rank_plan(self.schedule, self.pipe_rank, True,
                                                       grouping)
        else:
            self.actions = self.schedule.with_comm(self.pipe_rank)
            self._infer_actions = self.actions
        self.timeline = tr.Timeline(self.pipe_rank)
        self.last_loss: float | None = None
        self.optimizers: dict[int, object] = {}
        self.grad_norm: float | None = None  # the global norm of the last step

    # --- parameters ------------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every local parameter shard of every virtual stage on this rank (a shared param has
        one copy per stage holding it; the copies get equal gradients and stay equal)."""
        return [p for m in self.models.values() for p in m.parameters()]

    def named_parameters(self):
        """(stage index, qualified name, local shard) triples."""
        for i, m in self.models.items():
            for n, p in m.named_parameters():
                yield i, n, p

    def use_optimizer(self, **settings) -> None:
        """Give each stage its own optimizer: build_optimizer(stage model, **settings)
        (shard/train/optim.py: name, lr, weight_decay, grad_clip, zero, ...). It reduces gradients
        itself, so every microbatch's backward but the last runs in its `no_sync()`. Weights
        tied across stages are its deferred parameters: summed over the pipe axis before their
        data-axis reduction. grad_clip clips by the norm over every stage and axis."""
        from soapstone.shard.train.optim import build_optimizer

        shared = {n for n, _ in self.graph.shared}
        for i, m in self.models.items():
            deferred = tuple(n for n in m.params if n in shared)
            self.optimizers[i] = build_optimizer(m, deferred=deferred, **settings)

    def set_lr(self, lr: float) -> None:
        """Every stage's optimizer updates at rate `lr` from now on (an LR schedule's step)."""
        for opt in self.optimizers.values():
            opt.set_lr(lr)

    def step(self, loss: float | None = None, step: int | None = None) -> None:
        """The optimizers' step: sum tied weights' gradients over the pipe axis, reduce, clip
        by the global norm over every stage (collective over the pipe axis), update, clear
        gradients. The norm before clipping is left in `self.grad_norm`. A non-finite norm
        (or `loss`, the step's) updates nothing and raises NonFinite on every rank alike
        (shard/train/nonfinite.py)."""
        opts = self.optimizers
        if self.graph.shared:
            self._sum_shared(lambda i, name: opts[i].unreduced_grad(name))
        copies = {n: 1.0 / len(w) for n, w in self.graph.shared}
        total = 0.0
        for opt in opts.values():
            total += opt.grad_norm_sq(copies)
        if self.graph.pipe > 1:
            t = torch.tensor([total], dtype=torch.float64, device=self.device)
            self.pipe_comm.allreduce(t)
            total = float(t)
        self.grad_norm = total ** 0.5
        if not math.isfinite(self.grad_norm) or (loss is not None and not math.isfinite(loss)):
            from soapstone.shard.train.nonfinite import check_step

            check_step(self, loss, step)  # raises, the update undone before it was made
        for opt in opts.values():
            opt.step(grad_norm=self.grad_norm)
            opt.zero_grad()

    def _sum_shared(self, local_grad) -> None:
        """Sum each shared param's gradient over the pipe axis in place: local_grad(stage,
        name) is a holder's gradient tensor (every pipe rank takes part, zeros where it holds
        none; a rank holding several copies adds them once and writes the sum to each)."""
        pieces, holders = [], []
        for name, where in self.graph.shared:
            shape = self.graph.stages[where[0]].program.value(name).local_shape
            local = [local_grad(v, name) for v in where if v in self.models]
            g = torch.zeros(math.prod(shape), dtype=torch.float64, device=self.device)
            for t in local:
                g += t.reshape(-1)
            pieces.append(g)
            holders.append(local)
        flat = torch.cat(pieces)
        if self.graph.pipe > 1:
            self.pipe_comm.allreduce(flat)
        offset = 0
        for piece, local in zip(pieces, holders, strict=True):
            n = piece.numel()
            for t in local:
                t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model as its full tensor, on every rank (collective)."""
        mine = {}
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers.values():  # ZeRO-3: the full values, for the moment
                stack.enter_context(opt.gathered())
            for m in self.models.values():
                for name, full in m.full_state_dict().items():
                    mine.setdefault(name, full)
        out = {}
        for stage in self.graph.stages:
            for spec in stage.program.params:
                if spec.name in out:
                    continue
                if stage.rank == self.pipe_rank:
                    t = mine[spec.name].contiguous()
                else:
                    t = torch.empty(spec.shape, dtype=self.wire.float_dtype(spec.dtype),
                                    device=self.device)
                if self.graph.pipe > 1:
                    self.pipe_comm.broadcast(t, src=stage.rank)
                out[spec.name] = t
        return out

    # --- one training step -----------------------------------------------------------------

    def microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Cut full inputs into the schedule's microbatches along the batch dim."""
        g = self.graph
        dims = {}
        for s in g.stages:
            for n in s.data_inputs:
                dims[n] = s.program.value(n).dims
        check_batch(g, batch)  # keys, types, dtypes and full shapes, on every rank alike
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(g.microbatches)]
        for n, d in dims.items():
            t = batch[n]
            if not t.is_floating_point() and t.dtype != torch.int64:
                t = t.long()  # torch's embedding and cross-entropy index with int64 only
            if g.batch_dim in d:
                k = d.index(g.batch_dim)
                for i, piece in enumerate(t.chunk(g.microbatches, k)):
                    out[i][n] = piece
            else:
                for piece in out:
                    piece[n] = t
        check_ranges(self.index_ranges, batch)
        return out

    def input_rows(self) -> dict[str, list[int] | None]:
        """Input name -> the rows of the full global batch (indices along the batch dim) this
        rank reads, over every microbatch; None: every row (the input has no batch dim). An
        input no stage on this rank reads is absent. A data loader reads only these."""
        g = self.graph
        out: dict[str, list[int] | None] = {}
        for i, s in self.stages.items():
            for n in s.data_inputs:
                v = s.program.value(n)
                if g.batch_dim is None or g.batch_dim not in v.dims:
                    out[n] = None
                    continue
                mine = self.models[i].ctx.local_slices(v)[v.dims.index(g.batch_dim)]
                out[n] = sorted({mb * g.microbatch + r for mb in range(g.microbatches)
                                 for r in range(mine.start, mine.stop)} | set(out.get(n) or ()))
        return out

    def train_step(self, batch: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
                   step: int = 0) -> float:
        """One training step on a full global batch: forward and backward of every microbatch,
        then, with use_optimizer(), the optimizers' step(); returns the loss of the whole batch
        (the mean over microbatches) on every rank. `step` seeds dropout (the masks are a
        function of seed, step and value, never of the layout). Without an optimizer the
        gradients are left accumulated, unreduced, in each parameter's .grad.

        A list of k batches is gradient accumulation beyond the layout's microbatches: one
        update from the mean gradient of all k (each backpropagates its loss / k, gradients are
        reduced once, after the last); the loss returned is their mean; batch j's dropout
        masks use step k * step + j."""
        batches = batch if isinstance(batch, list) else [batch]
        k = len(batches)
        if not k:
            raise DataError("train_step([]): give a batch, or a non-empty list of batches")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):  # seeds dropout
            raise SettingError(f"train_step(step={step!r}): step is an int (the step's number)")
        step = int(step)
        for j, b in enumerate(batches):  # all before any runs: no half-accumulated update
            check_batch(self.graph, b, f"batch {j} of {k}" if k > 1 else "batch")
        loss = sum(self.forward_backward(b, k * step + j, scale=k, sync=j == k - 1)
                   for j, b in enumerate(batches)) / k
        if self.optimizers:
            self.step(loss, step)
        return loss

    def forward_backward(self, batch: dict[str, torch.Tensor], step: int = 0, scale: int = 1,
                         sync: bool = True) -> float:
        """Forward and backward of every microbatch by the schedule; the whole batch's loss.
        Gradients are of loss / scale; sync=False reduces none of them (more batches follow).
        A microbatch's stored values go at its backward's last part (B, or W where the
        backward is split), sends as they complete: a rank holds what its schedule keeps in
        flight, not every microbatch of the step."""
        st = _Step(self.microbatches(batch), step, scale, sync)
        if self.trace and self.pipe_comm is not None:
            self.pipe_comm.barrier()
        self.timeline.begin()
        wire = self.wire
        for a in self.actions:
            if isinstance(a, p2p_groups.Group):
                wire.issue(a, lambda x: self._outgoing(x, st), st.pending, st.inflight)
            elif a.kind.receiving:
                st.pending[(a.kind.direction, a.mb, a.stage)] = wire.post_recv(
                    a.mb, a.kind.edge(a.stage), a.kind.direction)
            elif a.kind is FORWARD:
                self._forward(a, st)
            elif a.kind is BACKWARD:
                self._backward(a, st)
            elif a.kind is WEIGHTS:
                self._weights(a, st)
            elif a.kind.sending:
                wire.sends.add(wire.send(*self._outgoing(a, st), a.kind.direction, a.mb,
                                         a.stage))
            wire.sends.poll()
        for w in st.inflight:
            w.wait()
        wire.sends.drain()
        for model in self.models.values():  # what a recompute in backward cast last
            if model.float8_last is not None:
                model.float8_last.release()
        self.last_loss = self._loss(st.losses)
        return self.last_loss

    def _forward(self, a, st: _Step) -> None:
        """F: run the stage on microbatch a.mb; keep its inputs and outputs for its B."""
        g = self.graph
        got = self._wait(st.pending.pop((a.kind.direction, a.mb, a.stage), None), a)
        t0 = self.timeline.now()
        stage = self.stages[a.stage]
        leaves = {b.name: t.requires_grad_() if b.is_float else t for b, t in got}
        model = self.models[a.stage]
        # this microbatch's rows of the global batch: dropout draws its mask for the
        # whole batch and slices them, as on one rank (backward reuses the saved mask)
        window = {g.batch_dim: (a.mb * g.microbatch, g.batch)} if g.microbatches > 1 else None
        opt = self.optimizers.get(a.stage)
        model.ctx.loss_scale = 1.0 / (g.microbatches * st.scale)
        outs = model.forward(st.mbs[a.mb], local=leaves, rng_step=st.step, window=window,
                             provider=opt.param_provider if opt else None)
        if stage.is_last:
            loss = outs[model.program.loss.name]
            st.losses[a.mb] = loss.detach()
            st.stored[(a.mb, a.stage)] = (leaves, [loss])
        else:
            st.stored[(a.mb, a.stage)] = (leaves, [outs[n] for n in stage.send])
            if a.stage in self.turns:  # the next stage is this rank's: no message
                st.pending[(a.kind.direction, a.mb, a.stage + 1)] = self.wire.hand_off(
                    g.edges[a.stage].tensors, st.stored[(a.mb, a.stage)][1],
                    a.kind.direction, a.mb, a.stage)
        self.timeline.record("F", a.mb, a.stage, t0, self.timeline.now())

    def _backward(self, a, st: _Step) -> None:
        """B: the whole backward of microbatch a.mb through its stage, or (split) the input
        gradient only, its W to follow. The stored inputs and outputs go here; what SG sends
        upstream (the float inputs' gradients) stays until sent."""
        g = self.graph
        got = self._wait(st.pending.pop((a.kind.direction, a.mb, a.stage), None), a)
        t0 = self.timeline.now()
        leaves, outs = st.stored.pop((a.mb, a.stage))
        opt = self.optimizers.get(a.stage)
        last_mb = a.mb == g.microbatches - 1 and st.sync
        ctx = opt.no_sync() if opt is not None and not last_mb else contextlib.nullcontext()
        if self.schedule.split:  # the input gradient only; W follows (its WeightPass holds
            # the part of the graph W needs, nothing else of this microbatch)
            st.weights[(a.mb, a.stage)] = self._backward_input(a, leaves, outs, got, st.scale)
        else:
            with ctx:
                if self.stages[a.stage].is_last:
                    (outs[0] / (g.microbatches * st.scale)).backward()
                else:
                    pairs = [(o, t) for o, (b, t) in zip(
                        self._float_outs(a.stage, outs), got, strict=True) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [t for _, t in pairs])
        if a.stage > 0:
            st.back[(a.mb, a.stage)] = [
                leaves[b.name].grad if leaves[b.name].grad is not None
                else torch.zeros_like(leaves[b.name])
                for b in g.edges[a.stage - 1].tensors if b.is_float]
            if a.stage - 1 in self.turns:  # the stage before is this rank's: no message
                st.pending[(a.kind.direction, a.mb, a.stage - 1)] = self.wire.hand_off(
                    [b for b in g.edges[a.stage - 1].tensors if b.is_float],
                    st.back.pop((a.mb, a.stage)), a.kind.direction, a.mb, a.stage)
        self.timeline.record("B", a.mb, a.stage, t0, self.timeline.now())

    def _weights(self, a, st: _Step) -> None:
        """W (split backward): the parameters' gradients of microbatch a.mb; its graph goes."""
        t0 = self.timeline.now()
        opt = self.optimizers.get(a.stage)
        with contextlib.ExitStack() as stack:
            if opt is not None:
                if not (a.mb == self.graph.microbatches - 1 and st.sync):
                    stack.enter_context(opt.no_sync())
                stack.enter_context(opt.one_backward())
            st.weights.pop((a.mb, a.stage)).run()
        self.timeline.record("W", a.mb, a.stage, t0, self.timeline.now())

    def _outgoing(self, a, st: _Step) -> tuple[list, list, int, int]:
        """What send action `a` (SA | SG) of a training step sends: (boundary values,
        tensors, destination pipe rank, edge index); SG lets go of the gradients it sends."""
        g = self.graph
        at = a.kind.edge(a.stage)
        edge = g.edges[at]
        if a.kind is ActionKind.SA:
            _, outs = st.stored[(a.mb, a.stage)]
            return edge.tensors, outs, edge.dst_rank, at
        floats = [b for b in edge.tensors if b.is_float]
        return floats, st.back.pop((a.mb, a.stage)), edge.src_rank, at

    def _backward_input(self, a, leaves: dict, outs: list, got: list,
                        scale: int) -> WeightPass:
        """A split backward's B (shard/runtime/split_backward.py): the float inputs' gradients into
        their .grad, for SG to send; the WeightPass that gives the parameters theirs."""
        g = self.graph
        if self.stages[a.stage].is_last:
            roots, grads = [outs[0] / (g.microbatches * scale)], [None]
        else:
            pairs = [(o, t) for o, (_, t) in zip(self._float_outs(a.stage, outs), got,
                                                 strict=True) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [t for _, t in pairs]
        inputs = [t for t in leaves.values() if t.requires_grad]
        got_in, later = backward_input(roots, grads, inputs,
                                       list(self.models[a.stage].params.values()))
        for t, d in zip(inputs, got_in, strict=True):
            t.grad = d
        return later

    def infer(self, batch: dict[str, torch.Tensor], step: int = 0,
              gather: tuple[str, ...] = ()) -> tuple[float, dict[str, torch.Tensor]]:
        """Forward only (no autograd, dropout off, ZeRO-3 parameters gathered) on a full
        global batch by the schedule's forward actions: the whole batch's loss and the full
        values of the last stage's outputs named in `gather` (the whole batch), on every rank
        (collective). Parameters, gradients and optimizer state are left as they were."""
        g = self.graph
        wire = self.wire
        outputs = [o.name for o in g.stages[-1].program.outputs]  # known to every rank
        if isinstance(gather, str) or not set(gather) <= set(outputs):
            raise DataError(f"infer(gather={gather!r}): give a tuple of the last stage's "
                            f"output names: {', '.join(outputs)}")
        mbs = self.microbatches(batch)
        pending: dict[tuple[str, int, int], list] = {}
        kept: dict[tuple[int, int], list] = {}
        inflight: list = []
        losses: dict[int, torch.Tensor] = {}
        pieces: dict[str, list[torch.Tensor]] = {n: [] for n in gather}
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for opt in self.optimizers.values():
                stack.enter_context(opt.gathered())
            for m in self.models.values():
                m.ctx.training = False
                stack.callback(setattr, m.ctx, "training", True)
            for a in self._infer_actions:
                if isinstance(a, p2p_groups.Group):
                    wire.issue(a, lambda x: self._outgoing_infer(x, kept), pending, inflight)
                elif a.kind is ActionKind.RA:  # infer skips backward actions
                    pending[(a.kind.direction, a.mb, a.stage)] = wire.post_recv(
                        a.mb, a.kind.edge(a.stage), a.kind.direction)
                elif a.kind is FORWARD:
                    got = wire.received(pending.pop((a.kind.direction, a.mb, a.stage), []))
                    model, stage = self.models[a.stage], self.stages[a.stage]
                    window = {g.batch_dim: (a.mb * g.microbatch, g.batch)} \
                        if g.microbatches > 1 else None
                    outs = model.forward(mbs[a.mb], local={b.name: t for b, t in got},
                                         rng_step=step, window=window)
                    if stage.is_last:
                        losses[a.mb] = outs[model.program.loss.name]
                        for n in gather:
                            out = next(o for o in model.program.outputs if o.name == n)
                            pieces[n].append(model.gather(outs[n],
                                                          model.program.value(out.value)))
                    elif a.stage in self.turns:  # handed to this rank's next stage
                        pending[(a.kind.direction, a.mb, a.stage + 1)] = wire.hand_off(
                            g.edges[a.stage].tensors, [outs[n] for n in stage.send],
                            a.kind.direction, a.mb, a.stage)
                    else:
                        kept[(a.mb, a.stage)] = [outs[n] for n in stage.send]
                elif a.kind is ActionKind.SA:
                    wire.sends.add(wire.send(*self._outgoing_infer(a, kept), a.kind.direction,
                                             a.mb, a.stage))
                wire.sends.poll()
            for w in inflight:
                w.wait()
            wire.sends.drain()
        return self._loss(losses), {n: self._from_last(n, p) for n, p in pieces.items()}

    def _outgoing_infer(self, a, kept: dict) -> tuple[list, list, int, int]:
        """What SA sends in infer (as _outgoing)."""
        at = a.kind.edge(a.stage)
        edge = self.graph.edges[at]
        return edge.tensors, kept.pop((a.mb, a.stage)), edge.dst_rank, at

    def _from_last(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """A last-stage output's full value (microbatches joined on the batch dim), sent from
        the last pipe rank to every pipe rank."""
        g = self.graph
        last = g.stages[-1].program
        value = last.value(next(o.value for o in last.outputs if o.name == name))
        k = value.dims.index(g.batch_dim) if g.batch_dim in value.dims else None
        if pieces:
            full = torch.cat(pieces, k) if k is not None else pieces[0]
        else:
            sizes = dict(last.dims)
            shape = [sizes[d] * (g.microbatches if i == k else 1)
                     for i, d in enumerate(value.dims)]
            full = torch.empty(shape, dtype=self.wire.float_dtype(value.dtype), device=self.device)
        if g.pipe > 1:
            full = full.contiguous()
            self.pipe_comm.broadcast(full, src=g.stages[-1].rank)
        return full

    def _float_outs(self, stage: int, outs: list) -> list:
        edge = self.graph.edges[stage]
        return [o for o, b in zip(outs, edge.tensors, strict=True) if b.is_float]

    def _wait(self, posted: list | None, a) -> list[tuple[Value, torch.Tensor]]:
        if not posted:
            return []
        t0 = self.timeline.now()
        got = self.wire.received(posted)
        self.timeline.record("R", a.mb, a.stage, t0, self.timeline.now())
        return got

    def _loss(self, losses: dict[int, torch.Tensor]) -> float:
        g = self.graph
        value = 0.0
        last = g.stages[-1]
        if last.index in self.models:
            m = self.models[last.index]
            name = m.program.loss.name
            value = sum(m.loss_value({name: losses[i]}) for i in range(g.microbatches))
            value /= g.microbatches
        if g.pipe > 1:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            self.pipe_comm.allreduce(t)
            value = float(t)
        return value

    # --- timeline ---------------------------------------------------------------------------

    def events(self) -> list[tr.Event]:
        """The last step's timeline of every pipe rank (collective over the pipe axis)."""
        return tr.gather(self.timeline, self.pipe_comm)

    def bubble(self) -> tuple[float, float]:
        """(measured idle fraction of the last step, theory (P-1)/(v*M+P-1)) (collective)."""
        return tr.bubble(self.events(), self.graph.pipe), self.schedule.theory_bubble()

    def write_chrome_trace(self, path) -> None:
        """Write the last step's timeline as a Chrome trace (collective; pipe rank 0 writes)."""
        events = self.events()
        if self.pipe_rank == 0 and self.mesh.rank == 0:
            tr.write_chrome_trace(path, events, f"{self.graph.model}/{self.graph.parallel}")
