"""Sharded initialisation under mpiexec (tests/shard/runtime/test_param_init.py): every rank draws
only its own slices, and they equal the same slices of the single-rank model's parameters bit for
bit.

Layouts: data parallel, tensor parallel, sequence parallel, context parallel and a two-stage
pipeline (examples/gpt2.par), and ZeRO-3 (tests/specs/ckpt_layouts.par), whose rank keeps only
its part of each flat bucket: compared where the bucket is gathered back.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests/support"))

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.stages import lower_graph  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402
from soapstone.shard.runtime.init.param_init import init_full  # noqa: E402

W = init("mpi")
SEED = 5


def _compare(path: str, layout: str, zero3: bool = False) -> int:
    """Assert every local parameter equals the single-rank init's slice; how many compared."""
    spec = dsl.load(ROOT / path)
    graph = lower_graph(spec.model(), spec.parallel(layout))
    single = {p.name: p for s in lower_graph(spec.model(), None).stages for p in s.program.params}
    ex = Executor(graph, Mesh(W, **dict(graph.mesh)), seed=SEED)
    if zero3:
        ex.use_optimizer(name="adamw", lr=1e-3)
    n = 0
    for i, model in ex.models.items():
        with ex.optimizers[i].gathered() if zero3 else contextlib.nullcontext():
            for name, p in model.params.items():
                want = init_full(single[name], SEED)[model.ctx.local_slices(
                    model.program.value(name))]
                assert torch.equal(p.detach(), want), f"{layout} rank {W.rank}: {name}"
                n += 1
    assert n > 0
    return n


@ranks(2)
def case_init_equals_single_rank_slices():
    """dp2, tp2, sp2, cp2 and a two-stage pipeline (gpt2.par) and ZeRO-3 over dp2."""
    counts = {layout: _compare("examples/gpt2.par", layout)
              for layout in ("dp2", "tp2", "sp2", "cp2", "pp2")}
    counts["dp2z3"] = _compare("tests/specs/ckpt_layouts.par", "dp2z3", zero3=True)
    return counts
