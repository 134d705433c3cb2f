"""A pipe rank's messages: tags, receive buffers, checked sends, grouped issue, and the sends
in flight (shard/runtime/executor.py's module doc describes the two p2p modes).

    wire = PipeP2P(graph, pipe_comm, device, compute_dtype)
    pending[(A, mb, stage)] = wire.post_recv(mb, stage - 1, A)    # ahead: irecv early
    wire.sends.add(wire.send(bounds, tensors, dst, edge, A, mb, stage))
    wire.sends.poll()        # between actions: completed sends let go of their buffers
    got = wire.received(pending.pop(...))

Memory: a send's buffer lives only as long as its Work (the backend keeps it until the send
completes); `Outbox.poll` tests the works in flight as the schedule goes and drops those
complete, so a rank holds the sends the network has not taken yet, not every send of the step.
"""

from __future__ import annotations

import attrs
import torch

from soapstone.shard.plan import p2p_groups
from soapstone.shard.plan.program import Value
from soapstone.shard.plan.schedules import Direction
from soapstone.shard.runtime.sharded_model import TORCH_DTYPES, ShapeMismatch

GROUPED_TAG = 0  # grouped mode pairs messages by order alone, as NCCL does


@attrs.define
class Outbox:
    """Sends in flight: their Works, each dropped (with the buffer it keeps) once complete."""

    works: list = attrs.Factory(list)

    def add(self, works) -> None:
        """Track `works` (sends just started)."""
        self.works.extend(works)

    def poll(self) -> None:
        """Drop every send that has completed, without blocking (MPI_Test, a CUDA event)."""
        if self.works:
            self.works = [w for w in self.works if not w.test()]

    def drain(self) -> None:
        """Wait for every send still in flight (the step's end)."""
        for w in self.works:
            w.wait()
        self.works.clear()


@attrs.frozen
class Handed:
    """A same-rank hand-off in place of a receive's Work (a V's turn: stage P-1 and stage P
    on one rank): complete from the start, `wait` gives the tensor."""

    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        """The handed tensor (nothing to wait for)."""
        return self.tensor


class PipeP2P:
    """The p2p of one layout's pipe rank over `comm` (the pipe axis' communicator):
    receives into buffers of the compiled boundary shapes, sends checked against them."""

    def __init__(self, graph, comm, device: torch.device,
                 compute_dtype: torch.dtype | None = None):
        self.graph = graph
        self.comm = comm
        self.device = device
        self.compute_dtype = compute_dtype
        self.ntensors = max([len(e.tensors) for e in graph.edges] + [1])
        self.sends = Outbox()

    def float_dtype(self, dtype: str) -> torch.dtype:
        """The torch dtype a value of spec dtype `dtype` has at run time (floats: the compute
        dtype where one is set)."""
        t = TORCH_DTYPES[dtype]
        return self.compute_dtype if self.compute_dtype is not None and t.is_floating_point \
            else t

    def tag(self, direction: Direction, mb: int, edge: int, i: int) -> int:
        """The MPI tag of tensor `i` of edge `edge`'s message for microbatch `mb` (A | G)."""
        g = self.graph
        d = 0 if direction is Direction.A else 1
        return ((d * max(len(g.edges), 1) + edge) * g.microbatches + mb) * self.ntensors + i

    def recv_buffers(self, edge_index: int, direction: Direction) -> tuple[list, int]:
        """Fresh buffers of the compiled boundary shapes for one receive: [(value, buffer)],
        and the source pipe rank (gradients: of the float values only)."""
        edge = self.graph.edges[edge_index]
        if direction is Direction.A:
            tensors, src = edge.tensors, edge.src_rank
        else:
            tensors, src = [b for b in edge.tensors if b.is_float], edge.dst_rank
        return [(b, torch.empty(b.local_shape, dtype=self.float_dtype(b.dtype),
                                device=self.device)) for b in tensors], src

    def post_recv(self, mb: int, edge_index: int, direction: Direction) -> list:
        """Ahead mode: irecv every tensor of one message; [(value, buffer, work)]."""
        bufs, src = self.recv_buffers(edge_index, direction)
        return [(b, buf, self.comm.irecv(buf, src, self.tag(direction, mb, edge_index, i)))
                for i, (b, buf) in enumerate(bufs)]

    def issue(self, group: p2p_groups.Group, outgoing, pending: dict, inflight: list) -> None:
        """Grouped mode: once the group before is complete (NCCL runs a rank's groups in
        order on one stream), issue `group` as one batch_p2p: each receive into fresh buffers,
        registered in `pending` for the compute reading it together with the group's sends
        (that compute waits for its receives and the group's sends; on NCCL every work of a
        group waits on one event after it, so this is the whole group there), and each send
        of what `outgoing(action)` gives (bounds, tensors, destination, edge). Leaves the
        group's works in `inflight`."""
        for w in inflight:
            w.wait()
        inflight.clear()
        ops, recvs, sent = [], [], []
        for o in group.ops:
            a = o.action
            # the message goes to the peer the proof paired it with (p2p_groups.P2P)
            if o.sending:
                bounds, tensors, dst, _ = outgoing(a)
                assert dst == o.peer, (a, dst, o.peer)
                for buf in self.checked(bounds, tensors, o.direction, a.mb, a.stage):
                    ops.append(("isend", buf, dst, GROUPED_TAG))
                    sent.append(len(ops) - 1)
            else:
                bufs, src = self.recv_buffers(o.edge, o.direction)
                assert src == o.peer, (a, src, o.peer)
                recvs.append(((o.direction, a.mb, a.stage), bufs, len(ops)))
                ops.extend(("irecv", buf, src, GROUPED_TAG) for _, buf in bufs)
        works = self.comm.batch_p2p(ops, synchronous=True)
        sends = [(None, None, works[i]) for i in sent]
        for key, bufs, at in recvs:
            pending[key] = [(b, buf, works[at + i]) for i, (b, buf) in enumerate(bufs)] + sends
        inflight.extend(works)

    @staticmethod
    def received(posted: list) -> list[tuple[Value, torch.Tensor]]:
        """Wait for posted receives (and, grouped, their group's sends: value None); the
        received (value, tensor) pairs."""
        got = [(b, w.wait()) for b, _, w in posted]
        return [(b, t) for b, t in got if b is not None]

    def hand_off(self, bounds, tensors, direction: Direction, mb: int, stage: int) -> list:
        """A message between two stages of this rank, as a posted receive's entries
        [(value, tensor, work)], already complete: checked as a send is, detached, no copy."""
        return [(b, t, Handed(t)) for b, t in
                zip(bounds, self.checked(bounds, tensors, direction, mb, stage), strict=True)]

    def send(self, bounds, tensors, dst: int, edge_index: int, direction: Direction, mb: int,
             stage: int) -> list:
        """Ahead mode: isend each checked tensor of one message; their Works."""
        return [self.comm.isend(buf, dst, self.tag(direction, mb, edge_index, i))
                for i, buf in enumerate(self.checked(bounds, tensors, direction, mb, stage))]

    def checked(self, bounds, tensors, direction: Direction, mb: int, stage: int) -> list:
        """The tensors to send, contiguous, after checking each against its compiled
        boundary shape and dtype (ShapeMismatch: the receiver allocates the compiled one)."""
        out = []
        for b, t in zip(bounds, tensors, strict=True):
            want = self.float_dtype(b.dtype)
            if tuple(t.shape) != b.local_shape or t.dtype != want:
                raise ShapeMismatch(
                    f"stage {stage} would send the {direction.noun} of {b.name} (microbatch "
                    f"{mb}) as {t.dtype} {list(t.shape)}, but the stage graph compiled {want} "
                    f"{list(b.local_shape)} (dims {', '.join(b.dims)}); the receiver allocates "
                    "the compiled shape, so this is refused before sending")
            out.append(t.detach().contiguous())
        return out
