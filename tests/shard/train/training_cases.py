"""Training as people run it, under mpiexec (tests/shard/train/test_training.py):

- accumulation over several batches per step (beyond a layout's microbatches) equals one step
  on their concatenation on one rank: data parallel, ZeRO-2, a 1F1B pipeline;
- evaluation: the eval loss equals the loss a single-rank model loaded with the trained
  parameters computes on the same held-out batches, and evaluating changes nothing;
- memory-mapped token files: each rank reads exactly its rows (data parallel, pipeline, data
  parallel x microbatches), those rows equal the single-rank batch's, training on them
  reproduces the single-rank losses, and a file larger than the process's memory limit trains
  without being read whole.
"""

from __future__ import annotations

import os
import resource
import tempfile
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.app.build import single_program
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.data.token_memmap import TokenMemmap
from soapstone.shard.runtime.executor import Executor
from soapstone.shard.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
W = init("mpi")


def _layout(spec: str, layout: str | None, **dims):
    s = dsl.load(ROOT / spec, dims=dims)
    par = s.parallel(layout) if layout else None
    model = s.model(par.model if par else None)
    graph = lower_graph(model, par)
    mesh = Mesh(W, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    return model, graph, mesh


def _close(a: dict, b: dict, rtol: float = 1e-5, what: str = "") -> None:
    for k in a:
        scale = float(b[k].abs().max()) or 1.0
        err = float((a[k] - b[k]).abs().max())
        assert err <= rtol * scale, f"{what}{k}: max diff {err:.3g} (scale {scale:.3g})"


def _accumulation(spec: str, layout: str, batch: int) -> None:
    model, graph, mesh = _layout(spec, layout, batch=batch)
    ex = Executor(graph, mesh, seed=3)
    ex.use_optimizer(name="sgd", lr=0.1, momentum=0.0)
    task = SyntheticTask(single_program(model, graph), seed=3)
    _, ref_graph, _ = _layout(spec, None, batch=2 * batch)
    ref = Executor(ref_graph, None, seed=3)
    ref.use_optimizer(name="sgd", lr=0.1, momentum=0.0)
    for step in range(2):
        pair = [task.batch(2 * step), task.batch(2 * step + 1)]
        loss = ex.train_step(pair, step=step)
        joined = {k: torch.cat([pair[0][k], pair[1][k]]) for k in pair[0]}
        want = ref.train_step(joined, step=step)
        assert abs(loss - want) <= 1e-5 * abs(want), (step, loss, want)
    _close(ex.full_state_dict(), ref.full_state_dict(), what=f"{layout} after 2 steps: ")


@ranks(2)
def case_accumulate_dp2():
    _accumulation("examples/gpt.par", "dp2", 8)


@ranks(2)
def case_accumulate_zero2():
    _accumulation("tests/specs/zero_layouts.par", "dp2z2", 8)


@ranks(2)
def case_accumulate_pipeline():
    _accumulation("tests/specs/pipe_layouts.par", "pp2f1b", 8)


def _eval_matches(spec: str, layout: str) -> None:
    model, graph, mesh = _layout(spec, layout)
    task = SyntheticTask(single_program(model, graph), seed=2)
    t = Trainer(graph, mesh, task=task, seed=2, lr=1e-2, check_memory=False)
    *_, m = t.run(3)
    before = t.full_state_dict()
    e = t.evaluate(3, step=m.step)
    again = t.evaluate(3, step=m.step)
    after = t.full_state_dict()
    assert e.loss == again.loss, (e.loss, again.loss)
    assert all(torch.equal(before[k], after[k]) for k in before), "evaluation moved a weight"
    assert e.perplexity is not None and abs(e.perplexity - np.exp(e.loss)) < 1e-9
    # the same held-out batches, without training: a fresh single-rank model holding the
    # trained weights, through its training forward (no optimizer, gradients discarded)
    _, ref_graph, _ = _layout(spec, None)
    ref = Executor(ref_graph, None, seed=99)
    ref.models[0].load_full_state_dict(before)
    want = sum(ref.forward_backward(task.eval_batch(j)) for j in range(3)) / 3
    assert abs(e.loss - want) <= 1e-5 * abs(want), (layout, e.loss, want)
    held_out = task.eval_batch(0)["tokens"]
    assert not any(torch.equal(held_out, task.batch(i)["tokens"]) for i in range(3))


@ranks(2)
def case_eval_tp2():
    _eval_matches("examples/gpt.par", "tp2")


@ranks(2)
def case_eval_pipeline():
    _eval_matches("tests/specs/pipe_layouts.par", "pp2f1b")


@ranks(2)
def case_eval_zero3():
    _eval_matches("tests/specs/zero_layouts.par", "dp2z3")


def _token_file() -> str:
    """A shared file of 20000 uint16 ids below 64 (rank 0 writes it)."""
    path = None
    if W.rank == 0:
        fd, path = tempfile.mkstemp(suffix=".bin")
        os.close(fd)
        ids = (np.arange(20000) * 7 + np.arange(20000) // 13) % 64
        ids.astype("<u2").tofile(path)
    return MPI.COMM_WORLD.bcast(path, root=0)


def _rows(spec: str, layout: str, want: dict[str, list[int]]) -> None:
    path = _token_file()
    model, graph, mesh = _layout(spec, layout)
    task = TokenMemmap(single_program(model, graph), path, seed=5)
    t = Trainer(graph, mesh, task=task, seed=5, lr=1e-2, check_memory=False)
    full = TokenMemmap(single_program(model, graph), path, seed=5)  # reads every row
    rows = sorted(set().union(*want.values()))
    for step in (0, 1):
        b, ref = task.batch(step), full.batch(step)
        assert task.last_read == rows, (W.rank, task.last_read, rows)
        for name in ("tokens", "targets"):
            mine = want.get(name, [])
            assert torch.equal(b[name][mine], ref[name][mine]), name
            others = [r for r in range(ref[name].shape[0]) if r not in rows]
            assert not b[name][others].any(), f"{name}: rows {others} were filled"
    ref_t = Trainer(lower_graph(model, None), None, task=full, seed=5, lr=1e-2,
                    check_memory=False)
    for m, r in zip(t.run(2), ref_t.run(2), strict=True):
        assert abs(m.loss - r.loss) <= 1e-5 * r.loss, (m.loss, r.loss)
    W.barrier()
    if W.rank == 0:
        os.unlink(path)


@ranks(2)
def case_memmap_rows_dp2():
    rows = [4 * W.rank + i for i in range(4)]  # batch 8 split over 2
    _rows("examples/gpt.par", "dp2", {"tokens": rows, "targets": rows})


@ranks(2)
def case_memmap_rows_pipeline():
    # stage 0 reads the ids, stage 1 the targets; every row of every microbatch
    _rows("tests/specs/pipe_layouts.par", "pp2f1b",
          {"tokens": list(range(8))} if W.rank == 0 else {"targets": list(range(8))})


@ranks(2)
def case_memmap_rows_data_microbatches():
    # mesh(data=2), 2 microbatches of 4 rows: data coordinate d reads 2 rows of each
    rows = [4 * mb + 2 * W.rank + i for mb in range(2) for i in range(2)]
    _rows("tests/specs/training_layouts.par", "dp2mb2", {"tokens": rows, "targets": rows})


def _vm_data() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmData in /proc/self/status")


@ranks(2)
def case_memmap_file_larger_than_memory_limit():
    """3 GiB of tokens (a sparse file: no disk used) under a data limit of what the rank
    already holds + 512 MiB: reading it whole fails, training from it works."""
    path = None
    if W.rank == 0:
        fd, path = tempfile.mkstemp(suffix=".bin")
        os.truncate(fd, 3 << 30)
        os.close(fd)
    path = MPI.COMM_WORLD.bcast(path, root=0)
    model, graph, mesh = _layout("examples/gpt.par", "dp2")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data() + (512 << 20)
    assert limit < Path(path).stat().st_size
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        try:
            np.fromfile(path, dtype=np.uint16)
            raise AssertionError("the whole file was read: the limit does not bite")
        except MemoryError:
            pass
        task = TokenMemmap(single_program(model, graph), path, seed=1)
        t = Trainer(graph, mesh, task=task, seed=1, lr=1e-2, check_memory=False)
        losses = [m.loss for m in t.run(2)]
        e = t.evaluate(2, step=1)
        assert all(np.isfinite(losses)) and np.isfinite(e.loss)
        assert task.last_read == [4 * W.rank + i for i in range(4)]
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        W.barrier()
        if W.rank == 0:
            os.unlink(path)
