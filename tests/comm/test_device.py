"""--device (soapstone.comm.launch.device): cpu, cuda and auto on `run` and `golden`, and the device
argument of the Python API. Without a GPU only the CPU side can run: the CUDA errors a CPU
machine reaches (exit 2 on every rank, with the fix), `auto` falling back to the CPU, and the
per-node GPU count rule. The CUDA runs themselves are tests/comm/test_gpu.py (skipped here)."""

from __future__ import annotations

import pytest
import torch
from mpirun import run_mpi

from soapstone.comm.launch.device import DeviceError, gpus_per_node_error, resolve

CLI = ["-m", "soapstone.dsl.cli"]
NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("n,args", [
    (2, ["run", "examples/mlp.par", "--parallel", "dp2", "--steps", "1", "--device", "cuda"]),
    # before the launch is checked: the device is the first thing a rank settles
    (1, ["golden", "check", "examples/mlp.par", "tests/golden/runs/mlp.npz", "--parallel",
         "tp2", "--device", "cuda"]),
])
def test_device_cuda_without_cuda_is_exit_2_on_every_rank(n, args):
    r = run_mpi(n, [*CLI, *args], timeout=90)
    assert r.returncode == 2, r.report()
    assert "--device cuda" in r.stderr and "soapstone[gpu]" in r.stderr, r.report()
    assert "--device cpu" in r.stderr, r.report()
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stdout + r.stderr, r.report()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_golden_record_device_cuda_without_cuda(tmp_path):
    r = run_mpi(1, [*CLI, "golden", "record", "examples/mlp.par", "-o",
                    str(tmp_path / "r.npz"), "--device", "cuda"], timeout=60)
    assert r.returncode == 2 and "soapstone[gpu]" in r.stderr, r.report()
    assert not (tmp_path / "r.npz").exists()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_device_auto_without_a_gpu_is_the_cpu():
    from soapstone.comm.launch.device import pick

    assert resolve("auto") == "cpu"
    assert pick("auto") == torch.device("cpu")  # no MPI call: nothing to agree on


def test_more_ranks_than_gpus_names_both_numbers():
    msg = gpus_per_node_error(8, 4, host="node7")
    assert "8 ranks on node node7 but 4 GPUs" in msg and "NCCL refuses two ranks" in msg
    assert gpus_per_node_error(4, 4, host="node7") is None
    assert "1 GPU;" in gpus_per_node_error(2, 1, host="h")
    assert "no GPU" in gpus_per_node_error(1, 0, host="h")


def test_unknown_device_is_a_user_error():
    with pytest.raises(DeviceError, match="use one of cpu, cuda, auto"):
        resolve("tpu")


def test_python_api_device_argument():
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.data.tasks import random_inputs
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.runtime.sharded_model import ShardedModel

    graph = lower_graph(dsl.load("examples/mlp.par").model(), None)
    losses = []
    for device in (None, "cpu", torch.device("cpu")):
        ex = Executor(graph, device=device, seed=3)
        assert all(p.device == torch.device("cpu") for p in ex.parameters())
        ex.use_optimizer(name="sgd", lr=0.1)
        losses.append([ex.train_step(random_inputs(graph.program, i), step=i)
                       for i in range(2)])
    assert losses[0] == losses[1] == losses[2]
    if NO_CUDA:  # the API says what the CLI says
        with pytest.raises(DeviceError, match=r"soapstone\[gpu\]"):
            ShardedModel(graph.program, device="cuda")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_bench_comm_nccl_without_a_gpu_is_exit_2():
    r = run_mpi(1, [*CLI, "bench", "comm", "--backend", "nccl"], timeout=60)
    assert r.returncode == 2, r.report()
    assert "bench comm --backend nccl" in r.stderr and "--backend mpi" in r.stderr, r.report()
    assert "Traceback" not in r.stderr, r.report()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("bench", ["bench_dp", "bench_tp", "bench_pipe"])
def test_peer_bench_device_cuda_without_a_gpu_is_exit_2(bench):
    """The benches against DDP/FSDP2, DTensor and pipelining refuse --device cuda on every rank
    with the fix, before any model is built (so in seconds) and before any NCCL call."""
    r = run_mpi(2, [f"bench/{bench}.py", "--device", "cuda"], timeout=60)
    assert r.returncode == 2, r.report()
    assert r.stderr.count("error: --device cuda:") == 1, r.report()
    assert "soapstone[gpu]" in r.stderr and "--device cpu" in r.stderr, r.report()
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == "", r.report()


def test_pipelines_run_on_cuda_where_their_grouped_p2p_is_proven(monkeypatch):
    """check_device lets a pipeline onto CUDA when p2p_proof proves its grouped p2p (every
    pipeline layout of the examples and test specs); otherwise a DeviceError (exit 2) that
    names the layout and schedule and offers the CPU."""
    from pathlib import Path

    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.verify import p2p_proof
    from soapstone.shard.runtime.p2p_mode import check_device

    piped = 0
    for path in sorted([*Path("examples").glob("*.par"), *Path("tests/specs").glob("*.par")]):
        if "operator" not in path.read_text():
            continue
        dsl.custom.load_plugin("examples/custom_layer.py")
        spec = dsl.load(path)
        for par in spec.parallels.values():
            graph = lower_graph(spec.model(par.model), par)
            if graph.pipe > 1:
                check_device(graph, torch.device("cuda"))
                piped += 1
    assert piped >= 10, piped
    spec = dsl.load("examples/gpt2.par")
    pipe = lower_graph(spec.model(), spec.parallel("pp2"))
    check_device(pipe, torch.device("cpu"))
    monkeypatch.setattr(p2p_proof, "unproven",  # a schedule no grouping is proven for
                        lambda sched: "consume: p2p deadlock under NCCL's in-order rendezvous")
    with pytest.raises(DeviceError) as e:
        check_device(pipe, torch.device("cuda"))
    text = str(e.value)
    assert text.startswith("layout pp2: schedule 1f1b (pipe = 2, microbatches = ") and \
        "cannot run on --device cuda" in text and "--device cpu" in text, text
    assert "(consume: p2p deadlock under NCCL's in-order rendezvous)" in text, text


def test_p2p_mode_choice_and_bad_values(monkeypatch):
    from soapstone.comm.errors import UserError
    from soapstone.shard.runtime.p2p_mode import P2PModeError, p2p_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("SOAPSTONE_P2P", raising=False)
    assert (p2p_mode(None, cpu), p2p_mode(None, cuda)) == ("ahead", "grouped")
    assert p2p_mode("grouped", cpu) == "grouped"
    monkeypatch.setenv("SOAPSTONE_P2P", "grouped")
    assert p2p_mode(None, cpu) == "grouped" and p2p_mode("ahead", cpu) == "ahead"
    assert issubclass(P2PModeError, UserError)  # exit 2
    with pytest.raises(P2PModeError, match="cannot run on --device cuda.*use grouped"):
        p2p_mode("ahead", cuda)
    monkeypatch.setenv("SOAPSTONE_P2P", "eager")
    with pytest.raises(P2PModeError, match="SOAPSTONE_P2P = 'eager': unknown p2p mode; use "
                                           "one of ahead, grouped"):
        p2p_mode(None, cpu)
