"""`soapstone plan`'s probes (dsl/search/probes.py): the figures of a model of many alike blocks,
extrapolated from compiles of 1 and 2 blocks, are what compiling the whole layout gives (the
rest of plan: tests/dsl/search/test_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_models import gpt

from soapstone.dsl import load
from soapstone.shard.plan.analysis.hardware import load_profile


def test_probes_extrapolate_exactly_what_a_full_compile_estimates():
    """The probes (1 and 2 blocks, 1 and 2 samples, re-estimated per data degree and ZeRO
    stage) give the same explain figures and step time as compiling the whole model, for every
    candidate layout of a 12-block GPT on 8 devices."""
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import candidates

    model = load(gpt(12)).model()
    planner = Planner(model, load_profile("a100-40gb"))
    assert not planner.exact  # 12 alike blocks: probed
    cands = list(candidates(model, planner.dims, 8, planner.profile, []))
    assert {c.schedule for c in cands} == {"1f1b", "interleaved"} and any(c.sequence
                                                                          for c in cands)
    probed = [_assert_probed_is_full(planner, c) for c in cands[::2]]
    assert any(w.attention for r in probed for w in r.work)


def _activations(est) -> list[int]:
    """The activation bytes each stage saves per microbatch (the one rank's without a
    pipeline)."""
    return [b for x in est.pipe_ranks for _, b in sorted(
        x["activation_bytes_per_microbatch"].items())] or [est.activation_bytes]


def test_probes_under_bf16_are_the_bf16_compiles():
    """Under --precision bf16 the probes are retyped as the full compiles are: the same
    figures (bf16 activations and traffic, fp32 masters) and step time, on a sample of the
    candidates; and the bf16 step keeps and moves about half the bytes in its ops."""
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import candidates

    model = load(gpt(12)).model()
    planner = Planner(model, load_profile("a100-40gb"), precision="bf16")
    fp32 = Planner(model, load_profile("a100-40gb"))
    cands = list(candidates(model, planner.dims, 8, planner.profile, []))
    for c in cands[::7]:
        r = _assert_probed_is_full(planner, c)
        f = fp32.cost(c)
        # float saves halve; integer ones (the targets a loss keeps), bool masks and the
        # fused attention's fp32 statistics do not: a larger share once sequence parallelism
        # keeps its linears' inputs as shards. Stage by stage, per microbatch: a pipeline's
        # own figure is what its fullest rank holds at its peak action, and which rank and
        # action those are can change with the precision (bf16 z2 at pipe 2)
        assert [a * 2 for a in _activations(r.estimate)] == \
            pytest.approx(_activations(f.estimate), rel=0.02), c.label
        assert sum(w.other_bytes for w in r.work) * 2 == \
            pytest.approx(sum(w.other_bytes for w in f.work)), c.label


def test_probes_give_a_split_backward_its_b_and_w_working_sets():
    """zb1p, zbv and dualpipev split the backward into B and W, each with its own working set
    (activations.py's Phases); the probes give each stage all four, B's with the gradients
    it keeps for W of every block, so a split pipeline's peak is the full compile's (one
    backward working set for all was +0.3..+0.9% off at these sizes)."""
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import Candidate

    planner = Planner(load(gpt(12)).model(), load_profile("a100-40gb"))
    for c in (Candidate(2, 1, 2, schedule="zb1p", microbatches=2),
              Candidate(1, 2, 2, schedule="zbv", microbatches=4, chunks=2),
              Candidate(1, 2, 2, True, schedule="zbv", microbatches=8, chunks=2),
              Candidate(2, 1, 2, zero=3, schedule="dualpipev", microbatches=4, chunks=2)):
        r = _assert_probed_is_full(planner, c)
        assert r.estimate.total_bytes == planner.cost(c, exact=True).estimate.total_bytes


def _assert_probed_is_full(planner, c):
    probed, full = planner.cost(c, exact=False), planner.cost(c, exact=True)
    a, b = probed.estimate.to_data(), full.estimate.to_data()
    # the working set (transient) is a peak: the 2-block probe's, walked at the candidate's
    # samples per microbatch, plus ZeRO's buffers, which grow with the blocks
    # and the layout as the compiled graph has it (the probes' pipeline_shape, not compiled)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                "transient_bytes", "bubble", "comm_bytes_per_axis", "without_recompute",
                "recompute_flops", "model", "parallel", "world_size", "mesh", "schedule",
                "microbatches", "stages"):
        assert a.get(key) == b.get(key), (c.label, key, a.get(key), b.get(key))
    assert sorted(map(str, probed.estimate.traffic)) == \
        sorted(map(str, full.estimate.traffic)), c.label
    assert probed.time.total == pytest.approx(full.time.total, rel=1e-6), c.label
    # fused attention by keys attended (the attention rate's curve reads them)
    for p, f in zip(probed.work, full.work, strict=True):
        assert [e[0] for e in p.attention] == [e[0] for e in f.attention], c.label
        assert [x for e in p.attention for x in e[1:]] == \
            pytest.approx([x for e in f.attention for x in e[1:]]), c.label
    return probed


def test_the_working_set_under_recompute_is_the_full_compiles():
    """Under recompute the step's peak is the saved block inputs (which grow with the
    blocks) plus the working set of one block run again (which does not): the probes give
    explain's figures exactly, with and without recompute, on single-stage, accumulated,
    pipelined and ZeRO-2/3 layouts of a 12-block GPT on 8 devices (d4 t2 z2 rc: the case a
    linear extrapolation of the peak got 21% low)."""
    import attrs

    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import Candidate, candidates

    model = load(gpt(12)).model()
    planner = Planner(model, load_profile("a100-40gb"))
    assert planner.recompute == ("layer",)
    cands = list(candidates(model, planner.dims, 8, planner.profile, []))
    picked = [Candidate(4, 2, 1, False, 2)] + cands[1::13]
    assert {c.pipe for c in picked} >= {1, 2} and {c.zero for c in picked} >= {0, 2, 3}
    for c in picked:
        r = _assert_probed_is_full(planner, attrs.evolve(c, recompute="layer"))
        plain = planner.cost(c)
        saved, _ = r.estimate.without_recompute  # on the fullest pipe rank with recompute
        assert r.estimate.activation_bytes < saved, c.label
        if c.pipe == 1:
            assert saved == plain.estimate.activation_bytes, c.label
        assert r.time.total > plain.time.total, c.label  # the forward again
        assert r.recompute_summary.startswith("activations "), c.label


def test_probes_extrapolate_the_experts_over_data_exactly():
    """With a mixture's experts over the data axis their shards depend on its size: those
    probes are compiled on the candidate's data degree, and give what a full compile does."""
    from soapstone.dsl.search.plan_search import Planner
    from soapstone.dsl.search.space import candidates, to_parallel

    text = Path("tests/specs/moe_plan.par").read_text().split("parallel single")[0]
    model = load(text, dims={"batch": 16, "seq": 16, "hidden": 32, "heads": 4, "kv_heads": 2,
                             "experts": 4, "ffn": 64, "vocab": 64}).model()
    planner = Planner(model, load_profile("a100-40gb"))
    assert not planner.exact  # 8 alike blocks: probed
    cands = [c for c in candidates(model, planner.dims, 8, planner.profile, [])
             if c.experts_on_data]
    assert {c.data for c in cands} == {2, 4}  # 4 experts: not over 8 data ranks
    assert ("experts", "data") in to_parallel(model, planner.dims, cands[0]).parameter
    for c in cands[::8]:
        _assert_probed_is_full(planner, c)
