"""Golden runs from a spec: `record_run` trains a model on one rank and writes the record;
`check_run` trains a layout as a record says and compares step by step (the library behind
`soapstone golden` and dsl/testing.py; the record format and tolerances: shard/train/golden.py).

Bad input (spec, launch, record file, data) raises a UserError: SpecError, BadInput,
golden.GoldenError or DataError, alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from soapstone.dsl.app.build import (
    check_memory,
    compile_layout,
    custom_layers,
    default_lr,
    load_plugins,
    pick_device,
    single_program,
    world,
)
from soapstone.dsl.lang.errors import BadInput

DEFAULT_STEPS = 5


def _trainer(graph, mesh, header: dict, model, device=None):
    """The Trainer a record's header describes, for `graph` (a StageGraph of ir.Model
    `model`), on `device` (default cpu)."""
    from soapstone.shard.data.source import make_task
    from soapstone.shard.train.trainer import Trainer

    task = make_task(single_program(model, graph), header["seed"], header.get("data"))
    return Trainer(graph, mesh, task=task, seed=header["seed"], custom=custom_layers(),
                   precision=header["precision"], optimizer=header["optimizer"],
                   lr=header["lr"], device=device)


def record_run(spec_path: str, output: str, *, model: str | None = None,
               dims: dict | None = None, plugins: tuple[str, ...] = (),
               steps: int = DEFAULT_STEPS, seed: int = 0, optimizer: str = "sgd",
               lr: float | None = None, precision: str = "fp32", data: str | None = None,
               device: str = "cpu", parallel: str | None = None, comm: str = "auto"):
    """Train `model` on one rank (on `device`: cpu, cuda or auto; `comm`: --comm) and write
    the record;
    returns the Record.

    `parallel`: a one-rank layout to train instead of the plain model, e.g. gradient
    accumulation over microbatches, the reference of a pipeline whose layers count each
    microbatch's tokens (moe's capacity)."""
    from soapstone.dsl.lang.spec import load
    from soapstone.shard.data.source import make_task
    from soapstone.shard.train import golden

    load_plugins(list(plugins))
    spec = load(spec_path, dims=dims, filename=spec_path)
    par = spec.parallel(parallel) if parallel else None
    m = spec.model(par.model if par else model)
    graph = compile_layout(m, par)
    if graph.world_size != 1:
        raise BadInput(f"--parallel {parallel}: a record is of one rank, and this layout "
                       f"needs {graph.world_size}; name a layout on mesh(data = 1)")
    program = graph.program
    lr = default_lr(optimizer) if lr is None else lr
    make_task(single_program(m, graph), seed, data)  # bad data: bad input before training
    header = {"spec": Path(spec_path).name, "model": m.name, "parallel": parallel,
              "dims": dict(dims or {}),
              "steps": steps, "seed": seed, "optimizer": optimizer, "lr": lr,
              "precision": precision, "data": data}
    comm = world(pick_device(device, comm), comm)
    trainer = _trainer(graph, None, header, model=m, device=comm.device)
    rec = golden.Recorder(header, [p.name for p in program.params])
    for metrics in trainer.run(steps):
        rec.add(metrics.loss, trainer.full_state_dict())
    record = rec.finish(trainer.full_state_dict())
    golden.save(record, output)
    return record


def check_run(spec_path: str, parallel: str | None, record_file: str, *,
              plugins: tuple[str, ...] = (), tol=None,
              on_step: Callable[[int, float, float], None] | None = None,
              device: str = "cpu", comm: str = "auto"):
    """Train `parallel` (on this process's MPI world) as the record says and compare.

    Returns the first Mismatch, or None when every step matches. Bad input raises a UserError
    (SpecError, BadInput or golden.GoldenError; all ranks alike) before training starts."""
    return prepare_check(spec_path, parallel, record_file, plugins=plugins,
                         device=device, comm=comm).run(tol, on_step)


class GoldenCheck:
    """A layout set up to train as a record says; `run` trains it and compares each step."""

    def __init__(self, record, trainer):
        self.record, self.trainer = record, trainer

    def run(self, tol=None, on_step: Callable[[int, float, float], None] | None = None):
        """The first Mismatch, or None; `on_step(step, loss, recorded loss)` after each
        matching step. Collective: every rank calls it."""
        from soapstone.shard.train import golden

        record, trainer = self.record, self.trainer
        tol = tol or golden.Tolerance.for_record(record.header)
        for m in trainer.run(record.steps):
            state = trainer.full_state_dict()
            bad = golden.compare_step(record, m.step, m.loss, state, tol)
            if bad is None and m.step == record.steps - 1:
                bad = golden.compare_final(record, state, tol)
            if bad is not None:
                return bad
            if on_step:
                on_step(m.step, m.loss, float(record.loss[m.step]))
        return None


def prepare_check(spec_path: str, parallel: str | None, record_file: str, *,
                  plugins: tuple[str, ...] = (), device: str = "cpu",
                  comm: str = "auto") -> GoldenCheck:
    """Read the record and build `parallel` on this process's world (MPI, or NCCL for
    `device` cuda, or MPI through host memory for `comm` mpi on cuda), untrained.

    Every bad input is found here (a UserError, alike on all ranks), so a caller can stop all
    ranks with exit 2; a failure while training is a bug and aborts the job instead."""
    from soapstone.comm import Mesh
    from soapstone.dsl.compile.layout_proof import prove_layout
    from soapstone.dsl.lang.spec import load
    from soapstone.shard.runtime.p2p_mode import check_device
    from soapstone.shard.train import golden

    comm = world(pick_device(device, comm), comm)
    record = golden.load(record_file)
    header = record.header
    load_plugins(list(plugins))
    spec = load(spec_path, dims=header.get("dims") or None, filename=spec_path)
    par = spec.parallel(parallel) if parallel else None
    if par is None and header["model"] not in spec.models:
        raise golden.GoldenError(f"{record_file}: recorded model '{header['model']}', but "
                                 f"{spec_path} defines {', '.join(spec.models) or 'none'}")
    model = spec.model(par.model if par else header["model"])
    if model.name != header["model"]:
        raise golden.GoldenError(f"{record_file}: recorded model '{header['model']}', but "
                                 f"layout '{parallel}' is for model '{model.name}'")
    graph = compile_layout(model, par)
    check_device(graph, comm.device)  # before any NCCL call
    if comm.size != graph.world_size:
        what = f"layout '{par.name}'" if par else f"model '{model.name}' on one rank"
        raise BadInput(f"{what} needs {graph.world_size} ranks, but this run has "
                       f"{comm.size}: launch it with `mpiexec -n {graph.world_size} ...`")
    shapes = {p.name: tuple(p.shape) for s in graph.stages for p in s.program.params}
    names = set(shapes)
    if names != set(header["params"]):
        raise golden.GoldenError(f"{record_file}: the record's parameters differ from the "
                                 f"model's (e.g. {sorted(names ^ set(header['params']))[:1]})")
    golden.check_shapes(record, shapes, record_file)  # a record that fits the model, or exit 2
    prove_layout(model, graph, header["optimizer"])  # every rank's calls match, statically
    check_memory(model, graph, comm, header["optimizer"], spec_path, header["precision"])
    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    trainer = _trainer(graph, mesh, header, model=model, device=comm.device)
    if mesh is not None:  # the watchdog's reports say where each rank should be
        from soapstone.comm.observe import expected
        from soapstone.dsl.compile.layout_proof import expected_calls
        from soapstone.shard.plan.analysis.precision import graph_as_run

        # in the record's precision: the dtypes its calls carry
        expected.expect(expected_calls(graph_as_run(graph, header["precision"]), comm.rank,
                                       model))
    return GoldenCheck(record, trainer)
