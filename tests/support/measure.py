"""Measuring one real training step against explain, for the mpiexec cases: the bytes every
communicator's counters record equal explain's figures, its flight recorder holds the planned
sequence, and param/grad/optimizer memory is within 10% of the tensors held; under a
`precision` (bf16), against explain of the same precision."""

from __future__ import annotations

import math
from pathlib import Path

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.plan.analysis.explain import estimate
from soapstone.shard.plan.verify.sequence import expected_by_comm, rank_sequence
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
W = init("mpi")
PLUGIN = str(ROOT / "examples/custom_layer.py")


def load_spec(name: str):
    """An example by name ("gpt"), or any spec by its path from the repo root."""
    dsl.custom.load_plugin(PLUGIN)
    return dsl.load(ROOT / (name if name.endswith(".par") else f"examples/{name}.par"))


P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}


def recorder_marks(mesh) -> dict:
    """Each recording communicator of the mesh by its key, with its (collective, p2p) counts."""
    comms = {c.flight.key.split("#")[0]: c for c in (mesh._comms.values() if mesh else ())
             if c.size > 1 and c.flight.recording}
    return {k: (c, c.flight.seq, c.flight.p2p_seq) for k, c in comms.items()}


def wild(row: tuple, plan: tuple) -> tuple:
    """A recorded (op, shape, dtype) with the sizes the plan leaves open (-1) set to -1."""
    op, shape, dtype = row
    if len(shape) != len(plan[1]):
        return row
    return op, tuple(-1 if w == -1 else g for g, w in zip(shape, plan[1], strict=True)), dtype


def assert_sequence(graph, marks: dict, layout: str, p2p: str = "ahead") -> None:
    """The calls each communicator recorded since `marks` are the plan's for this rank (its
    p2p in the executor's mode `p2p`)."""
    want = expected_by_comm(rank_sequence(graph, W.rank, p2p=p2p))
    assert set(want) <= set(marks) or not marks, f"{layout}: plan names {sorted(want)}"
    for key, (c, seq0, p2p0) in marks.items():
        got = {"collective": [], "p2p": []}
        for e in c.flight.snapshot()["entries"]:
            if e["seq"] > (seq0 if e["kind"] == "collective" else p2p0):
                op = e["op"] if e["kind"] == "collective" else P2P[e["op"]]
                got[e["kind"]].append((op, tuple(e["shape"]), e["dtype"]))
        for what, rows in got.items():
            plan = want.get(key, {}).get(what, [])
            exp = [(o["op"], tuple(o["shape"]), o["dtype"]) for o in plan]
            # a plan's -1 is a size the routing decides (moe's alltoallv rows): any matches
            rows = [wild(r, e) for r, e in zip(rows, exp, strict=False)] + rows[len(exp):]
            if rows == exp:
                continue
            j = next((i for i, (a, b) in enumerate(zip(rows, exp, strict=False)) if a != b),
                     min(len(rows), len(exp)))
            raise AssertionError(
                f"{layout} rank {W.rank}: {what} calls on {key}: {len(rows)} recorded, "
                f"{len(exp)} planned; call {j + 1}: recorded "
                f"{rows[j] if j < len(rows) else None}, planned "
                f"{plan[j]['what'] if j < len(plan) else None}")


def measure(spec: str, layout: str, optimizer: str, precision: str = "fp32") -> None:
    """One step of `spec`'s `layout` under `precision` against explain of the same precision
    (module doc): the counters and the recorded sequence (dtypes included) exactly, the
    param/grad/optimizer memory within 10%."""
    from soapstone.shard.plan.analysis.precision import graph_as_run
    from soapstone.shard.runtime.memory import memory_report

    s = load_spec(spec)
    par = s.parallel(layout)
    run_graph = lower_graph(s.model(par.model), par)
    graph = graph_as_run(run_graph, precision)  # what the run keeps and moves
    program = graph.program
    mesh = Mesh(W, **dict(par.mesh)) if program.world_size > 1 else None
    custom = {n: c.fn for n, c in dsl.custom.registered().items()}
    t = Trainer(run_graph, mesh, task=SyntheticTask(run_graph.program, 1), seed=1,
                custom=custom, optimizer=optimizer, lr=1e-3, precision=precision)
    t.step(0)  # warm up: first-use communicators, buckets, optimizer state
    comms = dict(mesh._comms) if mesh is not None else {}
    for c in comms.values():
        c.reset_stats()
    marks = recorder_marks(mesh)
    t.step(1)
    assert_sequence(graph, marks, f"{spec}/{layout}")
    measured: dict[tuple[str, str], tuple[int, int]] = {}
    for axes, c in comms.items():
        for op, st in c.stats.items():
            if st.bytes:
                calls, nbytes = measured.get((",".join(axes), op), (0, 0))
                measured[(",".join(axes), op)] = (calls + st.calls, nbytes + st.bytes)
    est = estimate(program, zero=par.zero, optimizer=optimizer)
    predicted = {k: cb for k, cb in est.comm_by().items() if cb[1]}
    routed_bytes(t.executor.models[0], program, predicted)
    assert measured == predicted, f"{spec}/{layout}: counters {sorted(measured.items())} vs " \
        f"explain {sorted(predicted.items())}"
    # memory, right after a step (gradients of the step still held)
    m, opt = t.executor.models[0], t.executor.optimizers[0]
    out = m(t.task.batch(2), provider=opt.param_provider)
    out[program.loss.name].backward()
    opt.reducer.finish()
    mem = memory_report(m, opt)
    for what, want in (("params", est.param_bytes), ("grads", est.grad_bytes),
                       ("optimizer", est.optimizer_bytes)):
        got = mem[what]
        assert abs(got - want) <= 0.1 * want, \
            f"{spec}/{layout}: {what} measured {got} B, explain says {want} B"


def routed_bytes(model, program, predicted: dict) -> None:
    """Replace explain's expected alltoallv bytes (at the capacity bound) by what the step's
    routing sent: per moe op, its dispatch and combine rows off this rank, each moved once
    forward, once back in backward and, in a recomputed range, once more forward (shard/ops/moe.py
    records them)."""
    routed = getattr(model.ctx, "moe", {})
    again = {i for a, b in program.recompute for i in range(a, b)}
    sent: dict[tuple[str, str], int] = {}
    for i, s in enumerate(program.steps):
        if getattr(s, "exchange", ()):
            x = program.value(s.args[0])
            row = x.nbytes // math.prod(x.local_shape[:-1])
            rows = routed[s.out]["sent"] + routed[s.out]["returned"]
            key = (s.exchange[0], "alltoallv")
            sent[key] = sent.get(key, 0) + (3 if i in again else 2) * rows * row
    for key, nbytes in sent.items():
        predicted[key] = (predicted[key][0], nbytes)


def measure_pipeline(path: Path, layout: str, optimizer: str, precision: str = "fp32") -> None:
    """A pipeline (or accumulating) layout: every rank's comm counters over one step equal
    explain's figures for its pipe rank (p2p sends, pipe-axis allreduces and each stage's
    collectives x microbatches), and its param/grad/optimizer memory is within 10% of the
    tensors its stages hold."""
    from soapstone.dsl.app.build import single_program
    from soapstone.shard.data.source import make_task
    from soapstone.shard.plan.analysis.explain import estimate_pipeline
    from soapstone.shard.plan.analysis.precision import graph_as_run
    from soapstone.shard.runtime.memory import memory_report

    s = dsl.load(path)
    par = s.parallel(layout)
    model = s.model(par.model)
    run_graph = lower_graph(model, par)
    graph = graph_as_run(run_graph, precision)  # what the run keeps and moves
    mesh = Mesh(W, **dict(par.mesh))
    task = make_task(single_program(model, run_graph), 1)
    t = Trainer(run_graph, mesh, task=task, seed=1, optimizer=optimizer, lr=1e-3,
                precision=precision)
    t.step(0)
    comms = dict(mesh._comms)
    for c in comms.values():
        c.reset_stats()
    marks = recorder_marks(mesh)
    t.step(1)
    assert_sequence(graph, marks, layout, t.executor.p2p)
    measured: dict[tuple[str, str], int] = {}
    for axes, c in comms.items():
        for op, st in c.stats.items():
            if st.bytes:
                key = (",".join(axes), op)
                measured[key] = measured.get(key, 0) + st.bytes
    rank = mesh.coord(graph.axis) if graph.axis else 0
    est = estimate_pipeline(graph, zero=par.zero, optimizer=optimizer, rank=rank)
    predicted = {k: b for k, (_, b) in est.comm_by().items() if b}
    assert measured == predicted, f"{layout} pipe rank {rank}: counters " \
        f"{sorted(measured.items())} vs explain {sorted(predicted.items())}"
    # memory as measure takes it: after a step's backward, its gradients reduced and held
    t.executor.forward_backward(task.batch(2), step=2)
    for opt in t.executor.optimizers.values():
        opt.reducer.finish()
    mem = {"params": 0, "grads": 0, "optimizer": 0}
    for i, m in t.executor.models.items():
        got = memory_report(m, t.executor.optimizers[i])
        for k in mem:
            mem[k] += got[k]
    for what, want in (("params", est.param_bytes), ("grads", est.grad_bytes),
                       ("optimizer", est.optimizer_bytes)):
        assert abs(mem[what] - want) <= 0.1 * want, \
            f"{layout} pipe rank {rank}: {what} measured {mem[what]} B, explain says {want} B"


def assert_live_as_explained(spec: str, dims: dict, layout: str, precision: str = "bf16",
                             within: float = 0.06) -> dict:
    """A step's tensors alive under `layout` (bench/bench_memory.py's measure, on this world)
    are explain's within `within`; the measured row."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_memory import measure as memory
    finally:
        sys.path.remove(str(ROOT / "bench"))
    row = memory(spec, dims, layout, W, precision)
    assert abs(row["live_error"]) < within, row
    return row
