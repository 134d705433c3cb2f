"""`offload optimizer` (shard/parallel/offload.py, shard/parallel/offload_plan.py). On a CPU run it
is a no-op that says so (check, show, run) and trains exactly as without it; explain reports the
device
memory with and without it. The GPU path (host master copies and state, the update on the
CPU) is tested where CUDA is present and skipped elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.parallel.offload_plan import CPU_RUN_NOTE, NOTE, offload_figures
from soapstone.shard.plan.analysis.explain import estimate

SPEC = "tests/specs/selective_layouts.par"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_check_and_show_accept_it_and_say_what_it_does(capsys):
    from soapstone.dsl.cli import main

    for cmd in ("check", "show"):
        assert main([cmd, SPEC, "--parallel", "offload_dp2"]) == 0
        out = capsys.readouterr()
        assert out.err.count(NOTE) == 1, out.err
    assert main(["show", SPEC, "--parallel", "offload_dp2"]) == 0
    assert "  offload   optimizer" in capsys.readouterr().out  # the block as checked
    # offload of anything else: tests/bad_specs/offload_not_optimizer.par


def test_a_cpu_run_says_it_is_a_noop_and_trains_as_without(tmp_path):
    """`soapstone run` (one rank, its own process: run sets up the watchdog): the note once,
    and the loss of every step equal to that of the same layout without the statement."""
    rows = {}
    for layout in ("single", "offload_single"):
        metrics = tmp_path / f"{layout}.jsonl"
        r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "run", SPEC,
                            "--parallel", layout, "--steps", "2", "--quiet", "--metrics",
                            str(metrics)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert (r.stdout + r.stderr).count(CPU_RUN_NOTE) == (layout == "offload_single")
        rows[layout] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert rows["offload_single"] == rows["single"] and len(rows["single"]) == 2


def test_explain_moves_the_optimizer_state_to_host(capsys):
    spec = dsl.load(SPEC)
    program = lower_graph(spec.model("gpt"), spec.parallel("offload_dp2")).program
    assert program.offload
    est = estimate(program)
    f = offload_figures(est)
    assert f.device_bytes_without == est.total_bytes
    assert f.device_bytes == est.total_bytes - est.optimizer_bytes
    # AdamW: two fp32 moments an element, so a master copy and a gradient copy add as much
    assert f.host_bytes == 2 * est.optimizer_bytes
    from soapstone.dsl.cli import main

    assert main(["explain", SPEC, "--parallel", "offload_dp2"]) == 0
    assert "offload optimizer, on a GPU run" in capsys.readouterr().out
    assert main(["explain", SPEC, "--parallel", "offload_dp2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["offload"]["host_bytes"] == f.host_bytes


def test_on_cpu_the_optimizer_keeps_its_ordinary_path():
    from soapstone.shard.runtime.executor import Executor

    spec = dsl.load(SPEC)
    ex = Executor(lower_graph(spec.model("gpt"), spec.parallel("offload_single")), None)
    ex.use_optimizer(name="adamw", lr=1e-3)
    assert all(opt.host is None for opt in ex.optimizers.values())


@CUDA
def test_host_step_equals_the_device_update():
    """Segments on the GPU: the update through host memory (pinned copies, the CPU's fused
    AdamW) leaves the device masters where the same update on the device does, its state
    lives on the host, and a write to a master between steps (a resume) is picked up."""
    from soapstone.shard.parallel.data_parallel import Segment
    from soapstone.shard.parallel.offload import HostStep
    from soapstone.shard.train.optim import FlatAdamW

    g = torch.Generator().manual_seed(0)
    sizes = (1000, 4096, 17)
    dev = [Segment(torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda())
           for n in sizes]
    ref = [Segment(s.master.clone(), s.grad.clone()) for s in dev]
    rule = FlatAdamW(1e-2, weight_decay=0.1)
    host = HostStep(dev, rule)
    assert all(t.device.type == "cpu" for st in host.state for t in st.values())
    ref_state = [rule.init_state(s.master) for s in ref]
    for step in (1, 2, 3):
        if step == 3:  # an outside write, as a resumed checkpoint makes
            for s in (*dev, *ref):
                s.master.mul_(0.5)
        host.step(dev, rule, step)
        for s, st in zip(ref, ref_state, strict=True):
            rule.update(s.master, s.grad, st, step)
        for a, b in zip(dev, ref, strict=True):
            torch.testing.assert_close(a.master, b.master, rtol=1e-6, atol=1e-7)
