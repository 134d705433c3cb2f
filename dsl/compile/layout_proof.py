"""A layout proved before launch: the static verifier (shard/plan/verify/prove.py) with the spec's
locations, so a failure names the FILE:LINE:COL of the op whose collective or message it is.

`check --verify` calls `prove_layout`; `run` and `golden check` call it too, before the fit
check and before any mesh communicator exists (milliseconds for the examples, well under a
second for a 64-stage pipeline: BENCHMARKS.md). `run` also hands each rank's expected calls
to the watchdog (`expected_calls`), so a timeout report says where each rank should be.
Torch-free.
"""

from __future__ import annotations

from soapstone.shard.plan.sizes import PROOF_RANKS, PROOF_WORK
from soapstone.shard.plan.verify.prove import (
    Verified,
    VerifyError,
    representatives,
    verify_layout,
)

EVERY_RANK_UP_TO = 64  # worlds this large derive every rank; larger, one pipe column


def locations(model) -> dict[str, str]:
    """IR value name -> the spec location of the op that computes it."""
    return {op.out: str(op.loc) for op in model.ops if op.loc is not None}


def prove_layout(model, graph, optimizer: str = "adamw") -> Verified:
    """Prove `graph` (a StageGraph of `model`): VerifyError (exit 2) naming both ranks, the
    communicator, the position and each side's call with its spec location, else a summary.
    Above EVERY_RANK_UP_TO ranks, from one rank per pipe coordinate (verify_layout says why
    that proves the rest), so the cost grows with the pipeline, not the world."""
    if graph.stages[-1].program.loss is None:  # a training step needs something to minimise
        raise VerifyError(f"model '{model.name}' has no loss to train: name an output `loss` "
                          "(output loss = ...) or mark one (output y = ... as loss)")
    where = locations(model)
    ranks = representatives(graph) if graph.world_size > EVERY_RANK_UP_TO else None
    check_proof_size(graph, graph.world_size if ranks is None else len(ranks))
    return verify_layout(graph, locate=lambda name: where.get(name, ""), optimizer=optimizer,
                         ranks=ranks)


def check_proof_size(graph, derived: int) -> None:
    """Refuse (VerifyError, exit 2) a layout whose proof would not end in seconds: one that
    lists more than PROOF_RANKS ranks in a communicator, or derives more than PROOF_WORK calls
    (shard/plan/sizes.py). Arithmetic on the graph, before any sequence is built."""
    name = graph.parallel or graph.model
    if graph.world_size > PROOF_RANKS:
        raise VerifyError(f"layout {name}: {graph.world_size} ranks; the proof before launch "
                          f"lists every communicator's ranks: at most {PROOF_RANKS}")
    steps = max(sum(len(s.program.steps) for s in graph.stages_of(r))
                for r in range(graph.pipe))
    work = derived * graph.microbatches * steps
    if work > PROOF_WORK:
        raise VerifyError(f"layout {name}: the proof before launch derives every call of a "
                          f"step: {derived} rank{'s' if derived > 1 else ''} x "
                          f"{graph.microbatches} microbatches x {steps} ops = {work} calls; at "
                          f"most {PROOF_WORK}: use fewer microbatches")


def expected_calls(graph, rank: int, model=None) -> dict:
    """World rank `rank`'s calls of one step per communicator, as the plain data the watchdog
    takes (soapstone.comm.observe.expected.expect): comm may not import the plan."""
    from soapstone.shard.plan.verify.sequence import expected_by_comm, rank_sequence

    where = locations(model) if model is not None else {}
    return expected_by_comm(rank_sequence(graph, rank, locate=lambda n: where.get(n, "")))
