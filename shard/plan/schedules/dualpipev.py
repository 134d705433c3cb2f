"""dualpipev: DeepSeek's DualPipeV (the V-shaped, one-copy variant of DualPipe, DeepSeek-V3
report; deepseek-ai/DualPipe; torch's ScheduleDualPipeV orders it the same way).

The V placement of zbv (placement.v_shape: rank r holds stage r on the way down, chunk 0,
and stage 2P-1-r on the way back, chunk 1). Its steady state runs a forward of one chunk and
a whole backward of the other chunk, of different microbatches, back to back: DualPipe's
overlapped F&B (on a GPU the two share the device, one's compute hiding the other's
communication; on CPU the overlap is the order alone). A whole backward here is B then its W
at once; where the schedule splits one (zero bubble, at the ramps), its W waits in a queue
and fills a later gap, oldest first. Rank r runs, with n = M microbatches:

1. 2(P-r-1) forwards of chunk 0;
2. r+1 pairs: F chunk 0, F chunk 1;
3. P-r-1 triples: B chunk 1 (split), the oldest queued W, F chunk 1;
4. M-2P+r+1 rounds: F chunk 0 & backward chunk 1, then F chunk 1 & backward chunk 0 (torch
   runs the last rank's first F&B unoverlapped; in an action order the two read the same);
5. P-r-1 rounds: backward chunk 1, then F chunk 1 & backward chunk 0;
6. r+1 pairs: backward chunk 1, backward chunk 0, split from about the middle on;
7. P-r-1 pairs: the oldest queued W, backward chunk 0 (split where 6 began to);
8. r+1 queued W's.

It needs M >= 2P (step 4 must run at least once on rank 0). Memory: parameters 1x (each rank
holds two distinct stages, half of a rank's layers each; DualPipe's two directions hold every
stage twice, 2x); activations of up to 2P+1 microbatch-chunks per rank (the published PP+1).
Bubble, published: (PP/2-1)(F&B+B-3W) with PP = 2P stages, against zb1p's (PP-1)(F+B-2W).
`bubble` is this module's schedule under `simulate`'s cost model (per chunk F = B = W = 1;
F&B = F + B on CPU, no overlap): each rank works 6M in a step of 6M + P-1, the P-1
chunk-forwards the last rank waits for the first microbatch, so (P-1)/(6M+P-1), zbv's from
2M >= 3P-1 on (the published form's F&B+B-3W = 0 in this model: F&B = 2, B = W = 1; the
simulation agrees, tests/shard/pipeline/test_zbv.py).
"""

from __future__ import annotations

from collections.abc import Callable

from soapstone.shard.plan.schedules.actions import Action
from soapstone.shard.plan.schedules.kind import ScheduleKind
from soapstone.shard.plan.schedules.placement import v_shape


def actions(r: int, p: int, m: int, chunks: int, at: Callable[[int], int]) -> list[Action]:
    """DualPipeV for pipe rank r (the module doc's steps)."""
    down, back = at(0), at(1)
    acts: list[Action] = []
    nxt = {(k, s): 0 for k in "FB" for s in (down, back)}
    queue: list[Action] = []  # split backwards' W's, oldest first

    def forward(stage: int) -> None:
        acts.append(Action("F", nxt[("F", stage)], stage))
        nxt[("F", stage)] += 1

    def backward(stage: int, split: bool) -> None:
        mb = nxt[("B", stage)]
        nxt[("B", stage)] += 1
        acts.append(Action("B", mb, stage))
        w = Action("W", mb, stage)
        if split:
            queue.append(w)
        else:  # a whole backward: its W at once
            acts.append(w)

    def weights() -> None:
        if queue:
            acts.append(queue.pop(0))

    for _ in range(2 * (p - r - 1)):
        forward(down)
    for _ in range(r + 1):
        forward(down)
        forward(back)
    for _ in range(p - r - 1):
        backward(back, True)
        weights()
        forward(back)
    for _ in range(m - 2 * p + r + 1):  # F&B, F&B
        forward(down)
        backward(back, False)
        forward(back)
        backward(down, False)
    for _ in range(p - r - 1):
        backward(back, False)
        forward(back)
        backward(down, False)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(back, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(down, split)
    for _ in range(p - r - 1):
        weights()
        backward(down, split)
    for _ in range(r + 1):
        weights()
    return acts


def least(p: int) -> int:
    """Its steady state runs once on rank 0 only from M = 2P on."""
    return 2 * p


def bubble(p: int, m: int, v: int) -> float:
    """(P-1)/(6M+P-1) (the module doc; `simulate` agrees)."""
    return (p - 1) / (6 * m + p - 1)


def formula(p: int, m: int, v: int) -> str:
    """bubble's formula as explain prints it, beside the published one."""
    return "(p-1)/(6m+p-1); published (PP/2-1)(F&B+B-3W) idle per rank, PP = 2p stages"


def walked(p: int, m: int) -> int:
    """From M = 2P (its least) on, every M holds the same microbatch-chunks at its peaks."""
    return min(m, 2 * p)


DUALPIPEV = ScheduleKind(
    "dualpipev", actions, place=v_shape, split=True, needs_stages=True, stages_per_rank=2,
    send_in_read_order=True,
    why_stages="it places two stages per rank in a V", bubble=bubble, formula=formula,
    walked=walked, least=least, why_least="its steady state needs two microbatches per stage",
    memory="parameters 1x (two distinct stages per rank; DualPipe, both directions, 2x); "
    "activations of up to 2P+1 microbatch-chunks per rank (published: PP+1)")
