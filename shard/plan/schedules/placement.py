"""Where a schedule puts its virtual stages: stage -> (pipe rank, chunk of that rank).

A placement is one function `(stage, pipe) -> (rank, chunk)`, owned by the schedule (its
ScheduleKind's `place`); everything that needs a stage's rank (the schedule's own action
lists, the p2p grouping and its proof, the checker's block-order rule, the planner's
candidates) asks it. A V-shaped schedule (ZB-V, DualPipeV: rank r holds stages r and
2P-1-r) supplies its own. Pure data: no torch.
"""

from __future__ import annotations


def round_robin(stage: int, pipe: int) -> tuple[int, int]:
    """Virtual stage v on pipe rank v mod P, as that rank's chunk v // P (Megatron's
    interleaving; with one chunk per rank, stage r on rank r)."""
    return stage % pipe, stage // pipe
