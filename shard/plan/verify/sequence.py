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
the ops' kernels (shard/ops/): the explain cases (tests/shard/train/run_cases.py) compare it call
by call with the flight recorder of a real step for every example and test layout they run (ZeRO
0-3, pipelines, branches, accumulation). It rests on autograd running backward in reverse
creation order and on which weights each kernel keeps (its record's `keeps`, with its statistics
`dist_stats` and own calls `calls`). Communicators of one rank are left out: nothing can diverge on
them. Pure data: no torch.
"""

from __future__ import annotations

import math

from soapstone.comm.accounting import bus_bytes
from soapstone.shard.plan import p2p_groups, schedules
from soapstone.shard.plan.dtypes import DTYPE_BYTES
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.verify import p2p_proof
from soapstone.shard.plan.verify.calls import F64, MeshRanks, Op
from soapstone.shard.plan.verify.stage_calls import StageCalls


def rank_sequence(graph: StageGraph, rank: int, schedule: schedules.Schedule | None = None,
                  locate=None, mesh: MeshRanks | None = None, p2p: str = "ahead") -> tuple[Op, ...]:
    """World rank `rank`'s calls in one training step (the module doc's order). `schedule`:
    the pipeline schedule to play (default the graph's); `locate(name)`: a spec location for
    a value name ("" when unknown); `mesh`: shared by the calls for every rank; `p2p`: the
    executor's p2p mode (ahead | grouped)."""
    mesh = mesh or MeshRanks(graph.mesh)
    sched = schedule or schedules.build(graph.schedule, graph.pipe, graph.microbatches,
                                        graph.chunks)
    axis = graph.axis
    pipe_rank = mesh.coord(rank, axis) if axis else 0
    stages = {s.index: StageCalls(graph, s.index, mesh, rank, locate)
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
            out.extend(o.waited() for o in inflight)
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
            out.extend(o.waited() for o in got)
            if got and inflight:  # grouped: the whole group, as on NCCL
                out.extend(o.waited() for o in inflight if not any(o is g for g in got))
                inflight = []
            st = stages[a.stage]
            if a.kind is schedules.ActionKind.F:
                out.extend(st.forward(a.mb))
            else:
                out.extend(st.backward_input(a.mb) if sched.split
                           else st.backward(a.mb, states[a.stage]))
    # the step's end waits for its sends
    out.extend(o.waited() for o in inflight + sends)
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


def _pipe_op(graph: StageGraph, mesh: MeshRanks, rank: int):
    """A maker of float64 allreduces over the pipe axis (None without one)."""
    if graph.axis is None or graph.pipe <= 1:
        return None
    axes, ranks = mesh.group(rank, (graph.axis,))

    def make(phase, shape, payload, source):
        return Op("allreduce", axes, ranks, shape, F64, bus_bytes("allreduce", payload,
                                                                  len(ranks)), phase,
                  source=source)
    return make


def _p2p(graph: StageGraph, mesh: MeshRanks, rank: int, a: schedules.Action,
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


def _p2p_rows(graph: StageGraph, mesh: MeshRanks, rank: int, a: schedules.Action,
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
            v = program.value(outputs.get(t.name, t.name))
            shape, dtype = v.local_shape, v.dtype
        except KeyError:
            shape, dtype = (), "missing"
        nbytes = math.prod(shape) * _width(dtype) if sending else 0
        where = locate(t.name) if locate else ""
        rows.append(("send" if sending else "recv", axes, ranks, shape, dtype, nbytes, here,
                     f"{direction.noun} {t.name}" + (f" ({where})" if where else "")
                     + f" of edge {edge.src} -> {edge.dst}", peer, direction, edge.src, i))
    return rows


def _width(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 0)


def rank_sequences(graph: StageGraph, schedule: schedules.Schedule | None = None,
                   locate=None, ranks=None, p2p: str = "ahead") -> dict[int, tuple[Op, ...]]:
    """Every world rank's sequence (rank_sequence for each; `ranks`: only those)."""
    mesh = MeshRanks(graph.mesh)
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
