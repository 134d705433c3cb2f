"""Checkpoints under mpiexec (tests/shard/checkpoint/test_checkpoint.py), on
tests/specs/ckpt_layouts.par.

- bit-exact resume (2 ranks): per layout, 6 steps straight vs 3 steps, save, a fresh executor
  resumed from the files, 3 more: the losses of steps 4-6, the fp32 master weights and the
  optimizer state (moments, step count) on every rank are bitwise equal.
- reshard (4 ranks): saved under data x tensor parallel with ZeRO-1 after 3 of 6 steps, then
  resumed on each half of the world under dp2 ZeRO-3 and two pipelines, on the whole world
  under pipe x data (ZeRO-2) and pipe x tensor x sequence (interleaved), and on each rank
  alone, each rank reading at least the bytes of the boxes it holds and at most the pieces
  they overlap (in the saved layout: exactly its boxes; and the saved parameters rebuild
  exactly from index.json and safetensors' numpy reader alone, their checksums from zlib):
  steps 4-6 match the uninterrupted run within the golden tolerances (losses rtol 1e-5;
  parameters 1e-5 of their scale plus 1% of an AdamW update per step).
- damage (2 ranks): the rank cases of tests/shard/checkpoint/ckpt_damage.py through `soapstone run`
on every rank: exit 2 everywhere, rank 0 naming the damage, no rank left waiting.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import attrs
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests/support"), str(Path(__file__).parent)]  # ckpt_damage beside it

from mpirun import ranks  # noqa: E402

from soapstone import dsl  # noqa: E402
from soapstone.comm import Mesh, init  # noqa: E402
from soapstone.dsl.compile.stages import lower_graph, lower_pipeline  # noqa: E402
from soapstone.shard.checkpoint import resume, save  # noqa: E402
from soapstone.shard.checkpoint.boxes import Box  # noqa: E402
from soapstone.shard.checkpoint.holdings import holdings  # noqa: E402
from soapstone.shard.checkpoint.index import OPTIMIZER_KINDS  # noqa: E402
from soapstone.shard.data.tasks import SyntheticTask  # noqa: E402
from soapstone.shard.plan.analysis.checkpoint_size import checkpoint_bytes  # noqa: E402
from soapstone.shard.train.trainer import Trainer  # noqa: E402

W = init("mpi")


def tied(model):
    """The output projection tied to the embedding table (as in pipe_optim_cases.py)."""
    table = next(p for p in model.params if p.name == "embedding0.table")
    head = attrs.evolve(table, name="head.table", tied_to=table.name)
    params = tuple(p for p in model.params if p.name != "linear0.weight") + (head,)
    ops = tuple(attrs.evolve(op, args=tuple("head.table" if a == "linear0.weight" else a
                                            for a in op.args)) for op in model.ops)
    return attrs.evolve(model, params=params, ops=ops)

SPEC = dsl.load(ROOT / "tests/specs/ckpt_layouts.par")
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp")  # the launch's shared dir
LR, RTOL = 1e-2, 1e-5
FULL = lower_graph(SPEC.model("gpt"), None).program  # the data: full batches


def trainer(layout: str | None, world=W, precision: str = "fp32", tie: bool = False,
            optimizer: str = "adamw") -> Trainer:
    par = SPEC.parallel(layout) if layout else None
    graph = lower_pipeline(tied(SPEC.model("gpt")), par) if tie else \
        lower_graph(SPEC.model("gpt"), par)
    mesh = Mesh(world, **dict(par.mesh)) if par is not None else None
    return Trainer(graph, mesh, task=SyntheticTask(FULL, seed=0), seed=0,
                   precision=precision, lr=LR, optimizer=optimizer)


def written_as_explain_says(t: Trainer, d: Path, optimizer: str = "adamw") -> None:
    """The tensor bytes each rank's file holds are what explain's checkpoint_bytes says."""
    index = json.loads((d / "index.json").read_text())
    got = [0] * W.size
    for meta in index["tensors"].values():
        for p in meta["pieces"]:
            got[int(p["file"][4:9])] += 4 * math.prod(p["shape"])
    assert got == checkpoint_bytes(t.graph, optimizer), (got, checkpoint_bytes(t.graph))


def bitwise(layout: str, precision: str = "fp32", **how) -> None:
    d = OUT / f"bitwise-{layout}-{precision}-{sorted(how.items())}"
    straight = trainer(layout, precision=precision, **how)
    want = [m.loss for m in straight.run(6)]
    first = trainer(layout, precision=precision, **how)
    list(first.run(3))
    save(first.executor, d, 3, 0, {"accumulate": 1})
    written_as_explain_says(first, d / "step-00000003", how.get("optimizer", "adamw"))
    again = trainer(layout, precision=precision, **how)
    index = resume(again.executor, d)
    # in the layout it was saved from each box a rank holds is one saved piece: it reads
    # exactly those bytes (each checked against its checksums)
    states = 1 + len(OPTIMIZER_KINDS[how.get("optimizer", "adamw")])
    held = sum(b.numel for h in holdings(again.executor) for b in h.boxes) * 4 * states
    assert index["bytes_read"] == held, (index["bytes_read"], held)
    got = [m.loss for m in again.run(3, 3)]
    assert got == want[3:], (layout, got, want[3:])
    a, b = holdings(straight.executor), holdings(again.executor)
    assert [(h.name, h.boxes) for h in a] == [(h.name, h.boxes) for h in b]
    for x, y in zip(a, b, strict=True):
        for kind in x.views:
            assert torch.equal(x.views[kind], y.views[kind]), (layout, x.name, kind)
    steps = {o.steps for t in (straight, again) for o in t.executor.optimizers.values()}
    assert steps == {6}, steps


@ranks(2)
def case_resume_bitwise_dp2():
    bitwise("dp2")


@ranks(2)
def case_resume_bitwise_tp2():
    bitwise("tp2")


@ranks(2)
def case_resume_bitwise_dp2_zero3():
    bitwise("dp2z3")


@ranks(2)
def case_resume_bitwise_pipeline():
    bitwise("pp2f1b")


@ranks(2)
def case_resume_bitwise_tp2_bf16():
    bitwise("tp2", "bf16")


@ranks(2)
def case_resume_bitwise_pipeline_tied_weights_sgd():
    """The output projection tied to the embedding across the two stages (saved by the first
    stage, loaded into both copies), SGD momentum."""
    bitwise("pp2f1b", tie=True, optimizer="sgd")


@ranks(2)
def case_damaged_tp2_checkpoint_exits_2_on_every_rank():
    """The rank cases of tests/shard/checkpoint/ckpt_damage.py, each on a copy of the tp2 checkpoint
    case_resume_bitwise_tp2 saved: `soapstone run --parallel tp2 --resume` returns 2 on every
    rank, none waits on another, rank 0 prints the damage (what only rank 1 read included);
    `soapstone ckpt verify` names it too."""
    import contextlib
    import io
    import shutil

    from ckpt_damage import RANK_CASES

    from soapstone.dsl.cli import main

    # main() is called inside this rank, which has MPI already: the supervisor does not fork
    # there (comm/launch/supervisor.py), so no setting is needed

    def cli(argv: list[str]) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            return main(argv), out.getvalue()

    saved = OUT / "bitwise-tp2-fp32-[]" / "step-00000003"
    for name, damage in RANK_CASES:
        d = OUT / f"damaged-{name}" / saved.name
        fragment = ""
        if W.rank == 0:
            shutil.copytree(saved, d)
            fragment = damage(d)
        W.barrier()
        rc, text = cli(["run", "tests/specs/ckpt_layouts.par", "--parallel", "tp2", "--quiet",
                        "--steps", "4", "--resume", str(d.parent)])
        assert rc == 2, (name, text)
        if W.rank == 0:
            assert fragment in text and "Traceback" not in text, (name, fragment, text)
            rc, text = cli(["ckpt", "verify", str(d.parent)])
            assert rc == 2 and fragment.removeprefix("rank 1: ") in text, (name, text)
        W.barrier()


# --- reshard: one save under dp2tp2z1, resumed under other layouts ----------------------------
RESHARD = OUT / "reshard"
STRAIGHT: dict = {}


@ranks(4)
def case_reshard_save_under_tp2_zero1():
    t = trainer("dp2tp2z1")
    losses = []
    for m in t.run(6):
        losses.append(m.loss)
        if m.step == 2:
            d = save(t.executor, RESHARD, 3, 0, {"accumulate": 1})
            written_as_explain_says(t, d)
            full = t.full_state_dict()
            if W.rank == 0:
                read_without_soapstone(d, full)
    STRAIGHT["loss"], STRAIGHT["params"] = losses, t.full_state_dict()


def read_without_soapstone(d: Path, full: dict) -> None:
    """index.json + any safetensors reader (numpy here) rebuild every parameter exactly, and
    the standard library's zlib.crc32 checks every piece's bytes."""
    import zlib

    from safetensors.numpy import load_file

    index = json.loads((d / "index.json").read_text())
    files = {name: load_file(str(d / name)) for name in index["files"]}
    chunk = index["chunk_bytes"]
    for name, t in index["tensors"].items():
        out = np.full(t["shape"], np.nan, dtype=np.float32)
        for p in t["pieces"]:
            data = files[p["file"]][p["key"]]
            raw = data.tobytes()
            assert p["crc32"] == [zlib.crc32(raw[i:i + chunk])
                                  for i in range(0, len(raw), chunk)], (name, p["key"])
            where = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"], strict=True))
            out[where] = data
        if t["kind"] != "param":
            continue
        assert np.array_equal(out, full[t["param"]].numpy()), name


def resumed_matches(layout: str | None, world) -> Trainer:
    t = trainer(layout, world)
    index = resume(t.executor, RESHARD)
    assert index["parallel"] == "dp2tp2z1" and index["step"] == 3
    # what this rank holds (its boxes of each master and both moments) and no more than the
    # saved pieces those boxes overlap: it reads whole rows of a piece, to check their
    # checksums
    held = sum(b.numel for h in holdings(t.executor) for b in h.boxes) * 4 * 3
    most = sum(4 * math.prod(p["shape"]) for h in holdings(t.executor) for k in h.views
               for b in h.boxes for p in index["tensors"][f"{k}/{h.name}"]["pieces"]
               if Box(tuple(p["offset"]), tuple(p["shape"])).intersect(b) is not None)
    assert held <= index["bytes_read"] <= most, (index["bytes_read"], held, most)
    got = [m.loss for m in t.run(3, 3)]
    for i, (g, w) in enumerate(zip(got, STRAIGHT["loss"][3:], strict=True)):
        assert abs(g - w) <= RTOL * abs(w), f"{layout}: step {4 + i} loss {g!r} vs {w!r}"
    state = t.full_state_dict()
    for name, want in STRAIGHT["params"].items():
        scale = float(want.abs().max())
        tol = RTOL * scale + 0.01 * LR * 3
        diff = float((state[name] - want).abs().max())
        assert diff <= tol, f"{layout}: {name} differs by {diff:.3e} (tolerance {tol:.3e})"
    return t


def half():
    return W.split(W.rank // 2, W.rank)


@ranks(4)
def case_reshard_to_dp2_zero3():
    resumed_matches("dp2z3", half())


@ranks(4)
def case_reshard_to_pipeline():
    resumed_matches("pp2f1b", half())


@ranks(4)
def case_reshard_to_interleaved_pipeline():
    resumed_matches("pp2inter", half())


@ranks(4)
def case_reshard_to_pipe_x_data_zero2():
    resumed_matches("pp2dp2z2", W)


@ranks(4)
def case_reshard_to_pipe_x_tensor_x_sequence():
    resumed_matches("pp2tp2", W)


@ranks(4)
def case_reshard_to_one_rank():
    resumed_matches(None, None)


@ranks(4)
def case_reshard_to_data_x_context_zero3_and_back():
    """Resumed under data x context parallel with ZeRO-3 (its shards cut over data x cp), then
    saved there: each rank alone loads that save to the same parameters, and its next step
    matches the sharded one's."""
    t = resumed_matches("dp2cp2z3", W)
    assert all(b.dp == ("data", "cp") for o in t.executor.optimizers.values()
               for b in o.reducer.buckets)
    d = save(t.executor, OUT / "reshard-cp", 6, 0, {"accumulate": 1})
    written_as_explain_says(t, d)
    alone = trainer(None, None)
    resume(alone.executor, OUT / "reshard-cp")
    state = alone.full_state_dict()
    for name, want in t.full_state_dict().items():
        assert torch.equal(state[name], want), f"{name} after the one-rank load"
    want, got = [m.loss for m in t.run(1, 6)], [m.loss for m in alone.run(1, 6)]
    assert abs(got[0] - want[0]) <= RTOL * abs(want[0]), (got, want)


# --- --async-save's staging refuses a non-finite state, as save() does -----------------------
@ranks(2)
def case_async_save_refuses_a_non_finite_state_on_every_rank():
    """Rank 1 holds an infinity in a master value it writes: the writer thread finds it in
    its staging copy, and every rank raises the same NonFinite naming the parameter and rank 1
    where they agree (wait); nothing is published, the temp directory is gone."""
    from soapstone.shard.checkpoint.async_save import AsyncSaver
    from soapstone.shard.train.nonfinite import NonFinite

    t = trainer("tp2")
    list(t.run(1))
    root = OUT / "async-nonfinite"
    saver = AsyncSaver(t.executor, root)
    name = None
    if W.rank == 1:
        h = next(h for h in holdings(t.executor) if h.writer)
        name = h.name
        with torch.no_grad():
            h.views["param"][0] = float("inf")
    saver.start(1, 0, {"accumulate": 1})
    try:
        saver.wait()
    except NonFinite as e:
        assert e.where[1] == 1 and (name is None or e.where[0] == name), (e.where, name)
        assert "a non-finite parameter or optimizer state" in e.message(), e.message()
    else:
        raise AssertionError("a non-finite state was saved")
    W.barrier()
    assert not list(root.glob("step-*")), list(root.rglob("*"))
