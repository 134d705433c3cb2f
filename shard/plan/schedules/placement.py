"""Where a schedule puts its virtual stages: stage -> (pipe rank, chunk of that rank).

A placement is one function `(stage, pipe) -> (rank, chunk)`, owned by the schedule (its
ScheduleKind's `place`); everything that needs a stage's rank (the schedule's own action
lists, the p2p grouping and its proof, the checker's block-order rule, the planner's
candidates) asks it. A V-shaped schedule (ZB-V, DualPipeV: rank r holds stages r and
2P-1-r) supplies `v_shape`; there two neighbour stages (P-1 and P) share the last rank, so
the blocks of one rank are cut into stages where the spec's `operator` ranges change
(`cut`). Pure data: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def round_robin(stage: int, pipe: int) -> tuple[int, int]:
    """Virtual stage v on pipe rank v mod P, as that rank's chunk v // P (Megatron's
    interleaving; with one chunk per rank, stage r on rank r)."""
    return stage % pipe, stage // pipe


def v_shape(stage: int, pipe: int) -> tuple[int, int]:
    """Down the pipe ranks and back: stage v < P on rank v (chunk 0), stage v >= P on rank
    2P-1-v (chunk 1), so rank 0 holds the first stage and the last (the loss)."""
    return (stage, 0) if stage < pipe else (2 * pipe - 1 - stage, 1)


def cut(owners: Sequence[tuple[int, Hashable]], order: Sequence[int]) -> list[int]:
    """Each block's virtual stage, in block order: owners[i] is block i's (pipe rank, the
    operator range naming it), `order` the rank of every stage under the placement. A stage
    ends where the rank changes, and also where the range changes while the placement puts
    the next stage on the same rank (a V's turn: two ranges on the last rank are two
    stages; elsewhere neighbouring ranges on one rank stay one stage, as always)."""
    out: list[int] = []
    for i, (rank, mark) in enumerate(owners):
        if i == 0:
            out.append(0)
            continue
        k = out[-1]
        prev_rank, prev_mark = owners[i - 1]
        turn = (mark != prev_mark and k + 1 < len(order) and order[k] == order[k + 1] == rank)
        out.append(k + 1 if rank != prev_rank or turn else k)
    return out
