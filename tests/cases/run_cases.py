"""Runtime cases under mpiexec (tests/test_run.py, tests/test_explain.py, tests/test_golden.py).

- explain vs a real step: for each example layout of this world size (pipelines too, plus
  pipeline layouts of tests/specs/pipe_layouts.par at 2 and 4 ranks), the bytes the
  communicators' `stats` counters record during one training step (forward, backward,
  optimizer step, loss report) equal `soapstone explain`'s figures per mesh axis and
  collective (calls and bytes; for pipelines bytes), ZeRO 2/3 layouts of
  tests/specs/zero_layouts.par included, and its param/grad/optimizer memory is within 10% of
  the measured tensors.
- the expected sequence (shard/plan/verify/sequence.py, what the static verifier proves): in the
  same step, every communicator's flight recorder holds exactly the collectives and p2p messages
  (op, shape, dtype) the plan lists for this rank, in its order.
- golden: every example layout of this world size, pipelines included, reproduces its record
  (tests/golden/runs/<spec>.npz) through `soapstone.dsl.testing.assert_matches_golden`.
"""

from __future__ import annotations

import math
from pathlib import Path

from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.compile.stages import lower_graph
from soapstone.dsl.testing import assert_matches_golden
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.plan.analysis.explain import estimate
from soapstone.shard.plan.verify.sequence import expected_by_comm, rank_sequence
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
W = init("mpi")
PLUGIN = str(ROOT / "examples/custom_layer.py")
EXAMPLES = tuple(p.stem for p in sorted((ROOT / "examples").glob("*.par")))


def _spec(name: str):
    """An example by name ("gpt"), or any spec by its path from the repo root."""
    dsl.custom.load_plugin(PLUGIN)
    return dsl.load(ROOT / (name if name.endswith(".par") else f"examples/{name}.par"))


def layouts(name: str, pipelines: bool = False) -> list[str]:
    """The example's layouts of this world size (pipeline layouts only if `pipelines`)."""
    s = _spec(name)
    return [p.name for p in s.parallels.values()
            if p.world_size == W.size and (pipelines or not p.operator)]


P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}


def _recorder_marks(mesh) -> dict:
    """Each recording communicator of the mesh by its key, with its (collective, p2p) counts."""
    comms = {c.flight.key.split("#")[0]: c for c in (mesh._comms.values() if mesh else ())
             if c.size > 1 and c.flight.recording}
    return {k: (c, c.flight.seq, c.flight.p2p_seq) for k, c in comms.items()}


def _wild(row: tuple, plan: tuple) -> tuple:
    """A recorded (op, shape, dtype) with the sizes the plan leaves open (-1) set to -1."""
    op, shape, dtype = row
    if len(shape) != len(plan[1]):
        return row
    return op, tuple(-1 if w == -1 else g for g, w in zip(shape, plan[1], strict=True)), dtype


def _assert_sequence(graph, marks: dict, layout: str, p2p: str = "ahead") -> None:
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
            rows = [_wild(r, e) for r, e in zip(rows, exp, strict=False)] + rows[len(exp):]
            if rows == exp:
                continue
            j = next((i for i, (a, b) in enumerate(zip(rows, exp, strict=False)) if a != b),
                     min(len(rows), len(exp)))
            raise AssertionError(
                f"{layout} rank {W.rank}: {what} calls on {key}: {len(rows)} recorded, "
                f"{len(exp)} planned; call {j + 1}: recorded "
                f"{rows[j] if j < len(rows) else None}, planned "
                f"{plan[j]['what'] if j < len(plan) else None}")


def _measure(spec: str, layout: str, optimizer: str) -> None:
    from soapstone.shard.runtime.memory import memory_report

    s = _spec(spec)
    par = s.parallel(layout)
    graph = lower_graph(s.model(par.model), par)
    program = graph.program
    mesh = Mesh(W, **dict(par.mesh)) if program.world_size > 1 else None
    custom = {n: c.fn for n, c in dsl.custom.registered().items()}
    t = Trainer(graph, mesh, task=SyntheticTask(program, 1), seed=1, custom=custom,
                optimizer=optimizer, lr=1e-3)
    t.step(0)  # warm up: first-use communicators, buckets, optimizer state
    comms = dict(mesh._comms) if mesh is not None else {}
    for c in comms.values():
        c.reset_stats()
    marks = _recorder_marks(mesh)
    t.step(1)
    _assert_sequence(graph, marks, f"{spec}/{layout}")
    measured: dict[tuple[str, str], tuple[int, int]] = {}
    for axes, c in comms.items():
        for op, st in c.stats.items():
            if st.bytes:
                calls, nbytes = measured.get((",".join(axes), op), (0, 0))
                measured[(",".join(axes), op)] = (calls + st.calls, nbytes + st.bytes)
    est = estimate(program, zero=par.zero, optimizer=optimizer)
    predicted = {k: cb for k, cb in est.comm_by().items() if cb[1]}
    _routed_bytes(t.executor.models[0], program, predicted)
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


def _routed_bytes(model, program, predicted: dict) -> None:
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


def _measure_pipeline(path: Path, layout: str, optimizer: str) -> None:
    """A pipeline (or accumulating) layout: every rank's comm counters over one step equal
    explain's figures for its pipe rank (p2p sends, pipe-axis allreduces and each stage's
    collectives x microbatches), and its param/grad/optimizer memory is within 10% of the
    tensors its stages hold."""
    from soapstone.dsl.app.build import single_program
    from soapstone.shard.data.tasks import make_task
    from soapstone.shard.plan.analysis.explain import estimate_pipeline
    from soapstone.shard.runtime.memory import memory_report

    s = dsl.load(path)
    par = s.parallel(layout)
    model = s.model(par.model)
    graph = lower_graph(model, par)
    mesh = Mesh(W, **dict(par.mesh))
    task = make_task(single_program(model, graph), 1)
    t = Trainer(graph, mesh, task=task, seed=1, optimizer=optimizer, lr=1e-3)
    t.step(0)
    comms = dict(mesh._comms)
    for c in comms.values():
        c.reset_stats()
    marks = _recorder_marks(mesh)
    t.step(1)
    _assert_sequence(graph, marks, layout, t.executor.p2p)
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
    # memory as _measure takes it: after a step's backward, its gradients reduced and held
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


PIPE_SPEC = ROOT / "tests/specs/pipe_layouts.par"
PIPE_LAYOUTS = {2: ("pp2f1b", "pp2inter"), 4: ("pp2dp2",)}
# branches: broadcasts and owned ops (br2 and dp2br2 are examples/towers.par's, measured above)
BRANCH_SPEC = "tests/specs/branch_layouts.par"
BRANCH_LAYOUTS = {2: ("gated_br2",), 4: ("br2tp2",)}
ZERO_SPEC = "tests/specs/zero_layouts.par"  # ZeRO 1-3: per-bucket scatters and gathers
ZERO_LAYOUTS = {2: ("dp2z1", "dp2z2", "dp2z3"), 4: ("dp2tp2z3",)}
# every distributed form (layernorm, rmsnorm, softmax, cross-entropy split over the dim they
# reduce): the statistics allreduces the kernels run are the ones their records' dist_stats list
OPS_SPEC = "tests/specs/ops_layouts.par"
OPS_LAYOUTS = {2: ("hid2", "cls2"), 4: ("dp2hid2",)}
# gradient accumulation: a one-stage graph's microbatches (ZeRO 2 scatters each one)
ACC_SPEC = ROOT / "tests/specs/accumulate_layouts.par"
ACC_LAYOUTS = {2: ("dp2acc2", "tp2acc2")}


def _explain_all(optimizer: str) -> None:
    ran = [(spec, layout) for spec in EXAMPLES for layout in layouts(spec, pipelines=True)]
    pipes = PIPE_LAYOUTS.get(W.size, ())
    assert ran or pipes, f"no layout of {W.size} ranks to measure (@ranks)"
    for spec, layout in ran:
        if _spec(spec).parallel(layout).operator:
            _measure_pipeline(ROOT / f"examples/{spec}.par", layout, optimizer)
        else:
            _measure(spec, layout, optimizer)
    for layout in pipes:
        _measure_pipeline(PIPE_SPEC, layout, optimizer)
    for layout in BRANCH_LAYOUTS.get(W.size, ()):
        _measure(BRANCH_SPEC, layout, optimizer)
    for layout in ZERO_LAYOUTS.get(W.size, ()):
        _measure(ZERO_SPEC, layout, optimizer)
    for layout in OPS_LAYOUTS.get(W.size, ()):
        _measure(OPS_SPEC, layout, optimizer)
    for layout in ACC_LAYOUTS.get(W.size, ()):
        _measure_pipeline(ACC_SPEC, layout, optimizer)


@ranks(2, 4, 8)
def case_explain_matches_counters_adamw():
    _explain_all("adamw")


@ranks(2, 4, 8)
def case_explain_matches_counters_sgd():
    _explain_all("sgd")


@ranks(1, 2, 4, 8)
def case_golden_examples():
    """Every runnable example layout of this size reproduces its single-rank record."""
    ran = 0
    for spec in EXAMPLES:
        record = ROOT / f"tests/golden/runs/{spec}.npz"
        for layout in layouts(spec, pipelines=True):
            assert_matches_golden(str(ROOT / f"examples/{spec}.par"), layout, str(record),
                                  plugins=(PLUGIN,))
            ran += 1
    assert ran, f"no example layout of {W.size} ranks (@ranks)"
