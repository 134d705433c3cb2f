"""Layouts on ranks that exchange through host memory (`--device cuda --comm mpi`,
comm/backends/staged.py), host tensors standing in for the GPU's
(tests/comm/backends/test_comm_staged.py): a layout trained on a mesh of staged communicators takes
the same steps, to the bit, as on plain MPI communicators: data, tensor + sequence and pipeline
(grouped p2p, as on a GPU) parallel, AdamW, 3 steps."""

from __future__ import annotations

from pathlib import Path

from mpi4py import MPI
from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.comm.backends.staged import StagedMPICommunicator
from soapstone.dsl.app.build import single_program
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.runtime.executor import Executor

ROOT = Path(__file__).resolve().parents[3]
W = init("mpi")
STAGED = StagedMPICommunicator(MPI.COMM_WORLD, device_type="cpu")


def _losses(world, spec: str, layout: str, p2p: str | None = None) -> list[float]:
    s = dsl.load(ROOT / spec)
    par = s.parallel(layout)
    model = s.model(par.model)
    graph = lower_graph(model, par)
    mesh = Mesh(world, **dict(par.mesh))
    try:
        ex = Executor(graph, mesh, seed=3, p2p=p2p)
        ex.use_optimizer(name="adamw", lr=1e-2)
        task = SyntheticTask(single_program(model, graph), seed=3)
        return [ex.train_step(task.batch(i), step=i) for i in range(3)]
    finally:
        mesh.free()


def _same_steps(spec: str, layout: str, p2p: str | None = None) -> None:
    plain = _losses(W, spec, layout, p2p)
    staged = _losses(STAGED, spec, layout, p2p)
    assert staged == plain, f"{spec} {layout}: staged {staged} vs MPI {plain}"


@ranks(2)
def case_data_parallel_staged_equals_mpi():
    _same_steps("examples/gpt2.par", "dp2")  # ZeRO-3: gathers and reduce-scatters


@ranks(2)
def case_tensor_sequence_parallel_staged_equals_mpi():
    _same_steps("examples/gpt.par", "sp2")


@ranks(2)
def case_pipeline_grouped_p2p_staged_equals_mpi():
    _same_steps("examples/gpt2.par", "pp2", p2p="grouped")
