"""Multi-node placement: which mesh axes stay inside a node (shard/plan/analysis/placement.py),
what explain and plan print for a number of devices per node, and the launch's nodes under real
mpiexec with SOAPSTONE_RANKS_PER_NODE simulating them (comm/launch/nodes.py): the mapping `run`
prints, the warning for a tensor-parallel axis across nodes, and unequal nodes (exit 2 on
every rank, with the numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

from soapstone.shard.plan.analysis.placement import Span, block_nodes, place, tp_warnings

ROOT = Path(__file__).resolve().parents[3]
CLI = ["-m", "soapstone.dsl.cli"]
ENV = "SOAPSTONE_RANKS_PER_NODE"
# tensor parallel outermost: its groups cross nodes of 2 (the layout the warning is for)
TP_OUTER = f"""include "{ROOT / 'examples/gpt.par'}"

parallel tpout for gpt on mesh(model = 2, data = 2) {{
  sample    batch -> data
  parameter heads, ffn, vocab -> model
}}
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *CLI, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_innermost_axes_inside_a_node():
    mesh = (("pipe", 2), ("data", 4), ("model", 8))
    placed = {p.axis: p for p in place(mesh, block_nodes(64, 8))}
    assert placed["model"].span is Span.INSIDE and placed["model"].nodes == 1
    assert placed["data"].span is Span.ACROSS and placed["data"].nodes == 4
    assert placed["pipe"].span is Span.ACROSS and placed["pipe"].nodes == 2
    # 16 per node: data x model fits one node, pipe crosses
    placed = {p.axis: p.span for p in place(mesh, block_nodes(64, 16))}
    assert placed == {"pipe": Span.ACROSS, "data": Span.ACROSS, "model": Span.INSIDE}
    placed = {p.axis: p.span for p in place(mesh, block_nodes(64, 32))}
    assert placed == {"pipe": Span.ACROSS, "data": Span.INSIDE, "model": Span.INSIDE}
    # a round-robin launch (rank r on node r mod 2) puts even the innermost axis across
    cyclic = [r % 2 for r in range(4)]
    assert place((("data", 2), ("model", 2)), cyclic)[1].span is Span.ACROSS


def test_tensor_axis_across_nodes_warns_with_the_fix():
    from soapstone import dsl

    spec = dsl.load(ROOT / "examples/gpt.par")
    good = spec.parallel("dp2tp2")  # mesh(data = 2, model = 2)
    assert tp_warnings(good, place(good.mesh, block_nodes(4, 2)), 2) == []
    (w,) = tp_warnings(good, place(good.mesh, block_nodes(4, 1)), 1)
    assert "tensor-parallel axis model (2 ranks) crosses 2 nodes of 1 ranks" in w
    assert "give it a size that divides 1" in w


def test_explain_prints_placement_for_devices_per_node(tmp_path):
    spec = tmp_path / "tpout.par"
    spec.write_text(TP_OUTER)
    r = cli("explain", str(spec), "--parallel", "tpout", "--devices-per-node", "2")
    assert r.returncode == 0, r.stderr
    assert ("placement (2 ranks per node, --devices-per-node): model=2 across nodes (2), "
            "data=2 inside a node") in r.stdout
    assert r.stderr.count("warning: layout tpout: tensor-parallel axis model") == 1, r.stderr
    assert "make it the last (innermost) axis: mesh(data = 2, model = 2)" in r.stderr
    # the profile's devices per node (8 on an H100 node): all inside, no warning
    r = cli("explain", "examples/gpt.par", "--parallel", "gpt8", "--profile", "h100-80gb",
            "--json")
    data = json.loads(r.stdout)["placement"]
    assert data["devices_per_node"] == 8
    assert [a["span"] for a in data["axes"]] == ["inside"] * 3
    # nothing asked: no placement line (the output as before)
    r = cli("explain", "examples/gpt.par", "--parallel", "dp2tp2")
    assert r.returncode == 0 and "placement" not in r.stdout
    r = cli("explain", "examples/gpt.par", "--parallel", "dp2tp2", "--devices-per-node", "0")
    assert r.returncode == 2 and "--devices-per-node 0: give at least 1" in r.stderr


def test_plan_prints_the_winners_placement():
    r = cli("plan", "examples/gpt.par", "--world", "16", "--profile", "h100-80gb",
            "--devices-per-node", "4")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("placement"))
    assert line.startswith("placement (4 ranks per node, --devices-per-node): ")
    assert "across nodes" in line, line


def test_run_prints_the_node_mapping_of_simulated_nodes(tmp_path):
    spec = tmp_path / "tpout.par"
    spec.write_text(TP_OUTER)
    r = run_mpi(4, [*CLI, "run", str(spec), "--parallel", "tpout", "--steps", "1", "--quiet"],
                timeout=120, env={ENV: "2"})
    assert r.ok, r.report()
    assert r.stderr.count("placement (2 ranks per node, 2 nodes, simulated: "
                          "SOAPSTONE_RANKS_PER_NODE): model=2 across nodes (2), "
                          "data=2 inside a node") == 1, r.report()
    assert r.stderr.count("warning: layout tpout: tensor-parallel axis model") == 1, r.report()
    # the example's order: model innermost, inside a node; no warning
    r = run_mpi(4, [*CLI, "run", "examples/gpt.par", "--parallel", "dp2tp2", "--steps", "1",
                    "--quiet"], timeout=120, env={ENV: "2"})
    assert r.ok, r.report()
    assert "data=2 across nodes (2), model=2 inside a node" in r.stderr, r.report()
    assert "warning" not in r.stderr, r.report()


@pytest.mark.parametrize("per_node,needles", [
    ("3", ["SOAPSTONE_RANKS_PER_NODE=3: 4 ranks do not fill nodes of 3 (they hold 3, 1)"]),
    ("two", ["SOAPSTONE_RANKS_PER_NODE = 'two': give the ranks of one simulated node"]),
])
def test_unequal_or_bad_nodes_exit_2_on_every_rank(per_node, needles):
    r = run_mpi(4, [*CLI, "run", "examples/gpt.par", "--parallel", "dp2tp2", "--steps", "1"],
                timeout=120, env={ENV: per_node})
    assert r.returncode == 2, r.report()
    for needle in needles:
        assert r.stderr.count(needle) == 1, r.report()
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stdout + r.stderr, r.report()
