"""The CUDA path for real: skipped without a CUDA GPU and cupy's NCCL (`pip install
'soapstone[gpu]'`). With one GPU: the sharded init on the GPU equals the CPU's bit for bit,
golden records reproduce at world size 1 over NCCL, training's loss falls; with two or more:
tensor, data and pipeline layouts (grouped NCCL p2p) reproduce their records over NCCL."""

from __future__ import annotations

import re

import pytest
import torch
from mpirun import run_mpi

from soapstone.comm import nccl_available

CLI = ["-m", "soapstone.dsl.cli"]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(not nccl_available(),
                                reason="needs CUDA and cupy's NCCL: pip install 'soapstone[gpu]'")


def test_sharded_init_on_the_gpu_equals_the_cpus():
    from soapstone.shard.plan.layout import Layout
    from soapstone.shard.plan.program import ParamSpec
    from soapstone.shard.runtime.init.param_init import init_full, init_shard

    for init in ("normal(0.02)", "uniform(0.1)"):
        p = ParamSpec("w", "f32", ("a", "b"), (300, 70), init, Layout(()), (300, 70))
        cpu = init_full(p, 4)
        assert torch.equal(init_full(p, 4, "cuda").cpu(), cpu)
        box = (slice(10, 200), slice(35, 70))
        assert torch.equal(init_shard(p, 4, box, "cuda").cpu(), cpu[box])


@pytest.mark.parametrize("spec", ["mlp", "gpt"])
def test_golden_check_on_one_gpu_over_nccl(spec):
    r = run_mpi(1, [*CLI, "golden", "check", f"examples/{spec}.par",
                    f"tests/golden/runs/{spec}.npz", "--device", "cuda"], timeout=300)
    assert r.ok, r.report()


def test_training_on_the_gpu_lowers_the_loss():
    r = run_mpi(1, [*CLI, "run", "examples/gpt.par", "--steps", "40", "--quiet", "--device",
                    "cuda"], timeout=300)
    assert r.ok and "(cuda)" in r.stderr, r.report()
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first, r.stdout


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["dp2", "tp2", "sp2"])
def test_golden_check_two_gpus(layout):
    r = run_mpi(2, [*CLI, "golden", "check", "examples/gpt2.par", "tests/golden/runs/gpt2.npz",
                    "--parallel", layout, "--device", "cuda"], timeout=300)
    assert r.ok, r.report()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("spec,layout,record", [
    ("examples/gpt2.par", "pp2", "gpt2"),  # 1F1B
    ("tests/specs/pipe_layouts.par", "pp2inter", "gpt"),  # interleaved: the `pairs` groups
    ("tests/specs/zb_layouts.par", "pp2zb", "gpt"),  # zb1p
])
def test_pipeline_on_gpus_reproduces_its_record_with_grouped_nccl_p2p(spec, layout, record):
    """Pipelines on CUDA issue their p2p in p2p_groups' groups (batch_p2p: one NCCL group
    each); never run yet: the CPU proof is tests/shard/pipeline/test_pipeline.py's grouped cases."""
    r = run_mpi(2, [*CLI, "golden", "check", spec, f"tests/golden/runs/{record}.npz",
                    "--parallel", layout, "--device", "cuda"], timeout=300)
    assert r.ok, r.report()
