"""cross_entropy a chunk of tokens at a time (shard/ops/loss/loss_kernels.py): bit-identical to the
unchunked forms forward and backward, and explain's count of its working set against a hand
computation and against a measured step (tests/specs/loss_layouts.par: a wide vocab over a
narrow hidden, so the loss is most of the step)."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest
import torch
import torch.nn.functional as F
from mpirun import ROOT, mpiexec

from soapstone import dsl
from soapstone.dsl.compile.lower import lower
from soapstone.shard.ops.kernels import Stats
from soapstone.shard.ops.loss.cross_entropy import RECORDS, chunk_rows
from soapstone.shard.ops.loss.loss_kernels import PlainLoss, SplitLoss
from soapstone.shard.ops.record import Reduce
from soapstone.shard.plan.analysis.activations import activation_figures
from soapstone.shard.plan.analysis.precision import program_as_run
from soapstone.shard.plan.program import Compute, Output
from soapstone.shard.runtime.fusion_plan import find_fusions
from soapstone.shard.runtime.overwrite_plan import overwritable

SPEC = "tests/specs/loss_layouts.par"
DTYPES = [torch.float32, torch.bfloat16]


def _logits(dtype, n=50, c=301):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(n, c, generator=g) * 4).to(dtype)
    return x, torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("classes", [301, 280])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_plain_form_is_f_cross_entropy_to_the_bit(dtype, classes, in_place):
    x, t = _logits(dtype)
    t = t % classes
    want_x = x.clone().requires_grad_()
    want = F.cross_entropy(want_x[:, :classes], t, reduction="sum") / 50
    (want * 0.37).backward()
    got_x = x.clone().requires_grad_()
    got = PlainLoss.apply(got_x * 1, t, classes, 7, in_place) / 50  # 8 chunks, one of 1 token
    (got * 0.37).backward()
    assert torch.equal(got.detach(), want.detach())
    assert torch.equal(got_x.grad, want_x.grad)


def _split_unchunked(x, t, lo, classes, stats):
    """The distributed form as it was before chunks (autograd differentiates it)."""
    n = x.shape[-1]
    if classes is not None:
        x = x.masked_fill(torch.arange(lo, lo + n) >= classes, float("-inf"))
    m = stats.reduce(x.detach().amax(-1, keepdim=True), Reduce.MAX)
    se = stats.reduce(torch.exp(x - m).sum(-1), Reduce.SUM)
    lse = torch.log(se) + m.squeeze(-1)
    inside = (t >= lo) & (t < lo + n)
    local = torch.where(inside, t - lo, torch.zeros_like(t))
    picked = stats.reduce(x[torch.arange(x.shape[0]), local] * inside.to(x.dtype), Reduce.SUM)
    return lse - picked


def _stats():
    """A Stats on one rank (no split axis: every reduction keeps the local statistic)."""
    step = Compute("loss", "cross_entropy", ("logits", "targets"), (("over", "vocab"),), ())
    return Stats(step, None, RECORDS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lo, classes", [(0, None), (150, None), (150, 420)])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_split_form_is_the_unchunked_one_to_the_bit(dtype, lo, classes, in_place):
    """One rank's share of the vocab-parallel form (its slice from `lo`; targets outside it
    and padded classes included), reductions over one rank."""
    x, t = _logits(dtype)
    want_x = x.clone().requires_grad_()
    want = _split_unchunked(want_x, t + lo // 2, lo, classes, _stats()).sum() / 50
    (want * 0.37).backward()
    got_x = x.clone().requires_grad_()
    got = SplitLoss.apply(got_x * 1, t + lo // 2, lo, classes, _stats(), 7, in_place,
                          (5, 10)).sum() / 50
    (got * 0.37).backward()
    assert torch.equal(got.detach(), want.detach())
    assert torch.equal(got_x.grad, want_x.grad)


def _program(layout: str, precision: str, chunk: int | None = None):
    text = (ROOT / SPEC).read_text()
    if chunk is not None:
        text = text.replace("chunk = 65536", f"chunk = {chunk}")
    spec = dsl.load(text)
    return program_as_run(lower(spec.model(), spec.parallel(layout)), precision)


@pytest.mark.parametrize("layout, classes", [("single", 8192), ("tp2", 4096)])
@pytest.mark.parametrize("precision, size", [("fp32", 4), ("bf16", 2)])
def test_explain_counts_one_chunk_and_the_gradient_over_the_logits(layout, classes,
                                                                   precision, size):
    """By hand (N = 256 tokens, h = 32): saved = the logits + the norm's input and output and
    its 2 statistics per token (+ the split form's max and sum per token). The working set
    above them peaks where the loss runs, forward or backward, with one chunk of every token;
    or, with small chunks, at the linear's backward:
    the logits' gradient (written over the logits, which were saved) + the weight's gradient
    + the norm output's gradient, less the logits no longer saved."""
    n, h = 256, 32
    split = layout == "tp2"
    logits = n * classes * size
    saved = logits + 2 * n * h * size + 2 * n * size + (2 * n * size if split else 0)
    small = _program(layout, precision)
    assert chunk_rows(small.steps[-1], small) == 65536 // classes
    assert overwritable(small, find_fusions(small)) == {"logits"}
    at_linear = logits + classes * h * size + n * h * size - logits
    if split:  # the split form's statistics are freed by then
        at_linear -= 2 * n * size
    assert activation_figures(small) == (saved, at_linear)
    whole = _program(layout, precision, chunk=n * classes)  # one chunk of every token
    # forward: its chunk temporaries (split: 2) + a float per token (split: 3) + the loss;
    # backward: 3 temporaries (split: 2) + 2 floats per token + the loss's gradient
    forward = (2 if split else 1) * logits + (3 if split else 1) * n * size + size
    at_loss = max(forward, (2 if split else 3) * logits + 2 * n * size + size)
    assert activation_figures(whole) == (saved, max(at_loss, at_linear))


def test_logits_another_step_reads_get_a_gradient_of_their_own():
    """Logits that are also an output of the model are never overwritten: explain counts a
    new gradient beside them (by hand, as above)."""
    p = _program("single", "fp32")
    shown = attrs.evolve(p, outputs=(*p.outputs, Output("logits", "logits", False)))
    assert overwritable(shown, find_fusions(shown)) == frozenset()
    # the peak moves to the loss's backward: the new gradient + 3 chunks of 8 tokens + 2
    # floats per token + the loss's gradient, above the saved logits
    assert activation_figures(shown)[1] == 256 * 8192 * 4 + 3 * 8 * 8192 * 4 + 2 * 256 * 4 + 4


def test_explain_matches_a_measured_tp2_step(tmp_path):
    """One training step of the vocab-parallel layout at fp32 and bf16 on each of 2 ranks
    (bench/bench_memory.py: the tensors alive, counted by shard/runtime/memory.LiveBytes):
    saved within 1%, peak within 3%. One rank is bench_memory's --small case, measured by
    tests/dsl/search/test_plan.py's two memory tests with the same bound."""
    out = tmp_path / "m.json"
    r = subprocess.run([mpiexec(), "-n", "2", sys.executable, "bench/bench_memory.py", "--spec",
                        SPEC, "--parallel", "tp2", "--precision", "fp32", "--precision", "bf16",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for row in rows:
        assert abs(row["saved_error"]) < 0.01, r.stdout
        assert abs(row["live_error"]) < 0.03, r.stdout
