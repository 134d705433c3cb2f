"""Golden numerics of pipelined layouts: every schedule reproduces the single-rank run.

Run on every rank by tests/support/mpirun.py (see tests/shard/pipeline/test_pipeline.py). For each
pipeline layout of tests/specs/pipe_layouts.par (and of tests/specs/pipe_residual.par: dropout in
every block, and a stage receiving a replicated tensor that feeds tensor-parallel work), 3 AdamW
steps with global-norm clipping (0.5, so it clips): the loss of each step matches the single-rank
run with the same global batch at rtol 1e-5 in fp32, and in float64 the loss, the clipped global
gradient norm and the final parameters match at rtol 1e-5 (fp32 final params after Adam differ by
rounding; see numerics_cases.py).

Run as a script (`python tests/shard/pipeline/pipe_cases.py mismatch`) it is the shape-mismatch job:
a stage graph whose boundary shape disagrees with what the stage computes must end the job
with ShapeMismatch, not hang.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import attrs
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests/support"), str(ROOT / "bench")]  # bench: the memory measure

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.lower import lower  # noqa: E402
from soapstone.dsl.compile.stages import lower_pipeline, resolve_ties  # noqa: E402
from soapstone.dsl.model import ir  # noqa: E402
from soapstone.shard.data.tasks import random_inputs  # noqa: E402
from soapstone.shard.runtime import trace as tr  # noqa: E402
from soapstone.shard.runtime.executor import Executor  # noqa: E402
from soapstone.shard.runtime.sharded_model import ShardedModel  # noqa: E402

W = init("mpi")
# 3 steps: the first update makes the optimizer state, two more reuse it (later steps
# repeat the second's path)
SEED, STEPS, RTOL, LR, CLIP = 7, 3, 1e-5, 1e-3, 0.5
SPEC = dsl.load(ROOT / "tests/specs/pipe_layouts.par")
RES = dsl.load(ROOT / "tests/specs/pipe_residual.par")


def synthetic_inputs(model, step: int) -> dict[str, torch.Tensor]:
    """The deterministic global batch of `step` (ids below the dims they index)."""
    return random_inputs(lower(model, None), step)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=RTOL, atol=RTOL * scale + 1e-12), \
        f"{what}: max abs diff {float((got - want).abs().max()):.3e} (scale {scale:.3e})"


def rel(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * abs(want), f"{what}: {got!r} vs single-rank {want!r}"


def golden(model, par, optimizer: str = "torch") -> None:
    """Train the pipeline layout and the single-rank model side by side and compare."""
    assert par.world_size == W.size, \
        f"{par.name} needs {par.world_size} ranks, not {W.size} (@ranks)"
    mesh = Mesh(W, **dict(par.mesh))
    graph = lower_pipeline(model, par)
    single = lower(resolve_ties(model), None)
    for dtype in (torch.float32, torch.float64):
        ref = ShardedModel(single, None, seed=SEED, dtype=dtype)
        pm = Executor(graph, mesh, seed=SEED, dtype=dtype)
        if optimizer == "zero1":
            # build_optimizer updates on fp32 flat buffers, where Adam's per-element division
            # turns rounding into visible differences (numerics_cases.py): SGD, checked in both
            opt_ref = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
            pm.use_optimizer(name="sgd", lr=LR, momentum=0.9, zero=1)
        else:
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)
            pm.use_optimizer(name="adamw", lr=LR, weight_decay=0.01, grad_clip=CLIP, zero=0)
        for step in range(STEPS):
            batch = synthetic_inputs(model, step)
            want = ref(batch)["loss"]
            want.backward()
            if optimizer != "zero1":
                want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            got = pm.train_step(batch)  # forward, backward and the optimizers' step
            rel(got, float(want.detach()), f"{par.name} step {step} loss ({dtype})")
            if optimizer != "zero1" and dtype == torch.float64:
                rel(pm.grad_norm, want_norm, f"{par.name} step {step} grad norm")
            opt_ref.step()
            opt_ref.zero_grad()
        if dtype == torch.float64 or optimizer == "zero1":
            state = pm.full_state_dict()
            assert set(state) == set(ref.params), "the pipeline holds other params"
            for name, full in state.items():
                close(full, ref.params[name].detach(),
                      f"{par.name}: {name} after {STEPS} {optimizer} steps ({dtype})")


def layout(name: str) -> None:
    golden(SPEC.model(), SPEC.parallel(name))


@ranks(2)
def case_pp2_gpipe_mb4():
    layout("pp2gpipe")


@ranks(2)
def case_pp2_1f1b_mb8():
    layout("pp2f1b")


@ranks(2)
def case_pp2_interleaved_mb4():
    layout("pp2inter")


def tied_model():
    """gpt with the output projection tied to the embedding table: the head reads a param
    `head.table` [vocab, hidden] with tied_to = embedding0.table (no syntax for it yet)."""
    m = SPEC.model()
    table = next(p for p in m.params if p.name == "embedding0.table")
    head = attrs.evolve(table, name="head.table", tied_to=table.name)
    params = tuple(p for p in m.params if p.name != "linear0.weight") + (head,)
    ops = tuple(attrs.evolve(op, args=tuple("head.table" if a == "linear0.weight" else a
                                            for a in op.args)) for op in m.ops)
    return attrs.evolve(m, params=params, ops=ops)


@ranks(2)
def case_pp2_tied_embedding():
    model = tied_model()
    par = SPEC.parallel("pp2f1b")
    graph = lower_pipeline(model, par)
    assert graph.shared == (("embedding0.table", (0, 1)),), graph.shared
    golden(model, par)


@ranks(2)
def case_pp2_trace():
    """A traced step: Chrome trace JSON with every F and B of both ranks, a measured bubble."""
    par = SPEC.parallel("pp2f1b")
    pm = Executor(lower_pipeline(SPEC.model(), par), Mesh(W, **dict(par.mesh)), trace=True)
    pm.train_step(synthetic_inputs(SPEC.model(), 0))
    measured, theory = pm.bubble()
    assert 0.0 <= measured < 1.0 and abs(theory - 1 / 9) < 1e-12, (measured, theory)
    timeline = pm.events()  # collective: every rank gathers every rank's timeline
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        pm.write_chrome_trace(path)
        if W.rank == 0:
            events = json.loads(path.read_text())["traceEvents"]
            work = [e for e in events if e.get("cat") in ("forward", "backward")]
            assert len(work) == 2 * 2 * 8, len(work)
            assert {e["tid"] for e in work} == {0, 1}
            png = Path(d) / "trace.png"  # matplotlib comes with the dev extra
            assert tr.write_png(png, timeline) and png.read_bytes()[:4] == b"\x89PNG"


@ranks(4)
def case_pp4_1f1b_mb8():
    layout("pp4f1b")


@ranks(4)
def case_pp4_gpipe_mb4():
    layout("pp4gpipe")


@ranks(4)
def case_pp2_dp2_1f1b():
    layout("pp2dp2")


@ranks(4)
def case_pp2_sp2_interleaved():
    layout("pp2tp2")


@ranks(8)
def case_gpt8_pipe_data_model_zero1():
    """gpt.par's gpt8: pipe 2 x data 2 x model (tensor + sequence) 2, 1F1B, ZeRO-1 through
    build_optimizer (its own gradient reduction; every microbatch but the last in no_sync),
    SGD with momentum, final params at rtol 1e-5 in fp32 and float64."""
    golden(SPEC.model(), SPEC.parallel("gpt8"), optimizer="zero1")


@ranks(2)
def case_pp2_dropout_mb4():
    """Dropout (p = 0.25) in every block, 4 microbatches: each microbatch's mask is its rows
    of the single-rank run's mask, not one mask drawn at the microbatch's size for all."""
    golden(RES.model(), RES.parallel("pp2drop"))


@ranks(4)
def case_pp2_dp2_dropout():
    """Dropout with the microbatch split again over data: rows mb * 4 + coord * 2, ..."""
    golden(RES.model(), RES.parallel("pp2dp2drop"))


@ranks(4)
def case_pp2_tp2_received_residual():
    """A stage receives the replicated residual stream and feeds it into h2-split work: its
    CopyTo sums the gradient over `model` before it is sent back (formerly refused)."""
    golden(RES.model(), RES.parallel("pp2tp2res"))


@ranks(2)
def case_pp2_memory_flat_in_microbatches_under_1f1b():
    """A pipe rank's peak memory over one step, at a fixed microbatch size (2 rows of
    gpt.par, seq 16, hidden 64): flat under 1F1B at m = 4, 16, 64 (each stage holds at most
    p - s microbatches: their stored values go at B, sends as they complete), linear under
    GPipe at m = 4, 8, 16 (all m held until the backwards), and explain's figure within 6%
    of it on both; flat too, and explained as closely, under zb1p and interleaved (2 chunks)
    at m = 4, 8; explained as closely under the V schedules zbv and dualpipev at m = 4 (a
    split backward's B and W each with its own working set: activations.py's Phases).

    The measure is shard/runtime/memory.py's LiveBytes (bench/bench_pipe_memory.py's `measure`): the
    bytes of tensor storage the step allocates and still holds, at their high-water mark.
    Every op's outputs pass a dispatch mode that counts a new storage until CPython frees it,
    so it sees what the executor keeps (activations autograd saves, stored boundaries,
    receive and send buffers, gradients in flight) whoever holds it, with no timing and no
    allocator or resident-memory noise (RSS would add MPI's and the allocator's own memory, and
    CPU torch reports no allocator statistics). Only a send's lifetime depends on when MPI
    completes it: at most one boundary tensor here, well inside the bounds."""
    from bench_pipe_memory import measure

    peaks: dict[str, list[int]] = {}
    for kind, ms in (("1f1b", (4, 16, 64)), ("gpipe", (4, 8, 16)), ("zb1p", (4, 8)),
                     ("interleaved", (4, 8)), ("zbv", (4,)), ("dualpipev", (4,))):
        for m in ms:
            row = measure(W, kind, m, {"seq": 16}, chunks=2 if kind == "interleaved" else 1)
            peaks.setdefault(kind, []).append(row["peak_bytes"])
            err = row["explain_bytes"] / row["peak_bytes"] - 1
            # explain's peak is per action: what is held then + that action's working set
            # (on interleaved's last rank, the loss's logits-sized working set comes when
            # fewer of stage 1's microbatches are held: in_flight.py)
            assert abs(err) < 0.06, f"{kind} m={m} rank {W.rank}: explain {err:+.1%} ({row})"
    for kind in ("1f1b", "zb1p", "interleaved"):
        flat = peaks[kind]
        assert max(flat) <= 1.10 * min(flat), f"{kind} peaks grow with m on rank {W.rank}: {flat}"
    p4, p8, p16 = peaks["gpipe"]
    # linear: the same bytes per microbatch from 4 to 8 as from 8 to 16
    low, high = (p8 - p4) / 4, (p16 - p8) / 8
    assert abs(high / low - 1) < 0.10 and p16 > 3 * p4, (peaks, W.rank)


def mismatch_main() -> None:
    """Stage 0 computes [mb, seq, hidden] but the graph says seq is 1 shorter: stage 0 must
    refuse to send (ShapeMismatch), and the failure handler must end the whole job."""
    par = SPEC.parallel("pp2f1b")
    graph = lower_pipeline(SPEC.model(), par)
    edge = graph.edges[0]
    b = edge.tensors[0]
    bad = attrs.evolve(b, local_shape=(b.local_shape[0], b.local_shape[1] - 1,
                                       b.local_shape[2]))
    graph = attrs.evolve(graph, edges=(attrs.evolve(edge, tensors=(bad,)),))
    pm = Executor(graph, Mesh(W, **dict(par.mesh)))
    pm.train_step(synthetic_inputs(SPEC.model(), 0))
    print("no error raised", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["mismatch"]:
    mismatch_main()
_ = ir  # the IR module is what tied_model edits (kept imported for readers)
