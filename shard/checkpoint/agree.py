"""One verdict for every rank of a collective save or load.

A full disk may stop one rank's write, a damaged byte may be read by one rank only; if that
rank raised alone, the others would wait in their next collective forever. Instead each rank
reports what it met, every rank learns the first problem (its text) and the bytes they wrote
together, and all of them raise the same error, which rank 0 prints.
"""

from __future__ import annotations

import attrs
import torch

MESSAGE_BYTES = 4096  # a problem's text travels in a buffer of this size (cut to fit)


@attrs.frozen
class Verdict:
    """What the ranks agreed on: the first failing rank's problem (None: none failed), that
    rank, and a count summed over the ranks."""

    problem: str | None
    rank: int | None
    total: int

    def where(self) -> str:
        """`rank R: ` before a problem from a job of several ranks, else nothing."""
        return f"rank {self.rank}: " if self.rank is not None else ""


def agree(world, problem: str | None, count: int = 0) -> Verdict:
    """Every rank's problem (or None) and `count`, agreed (collective over `world`; None or
    one rank: this rank's own)."""
    if world is None or world.size == 1:
        return Verdict(problem, None, count)
    mine = torch.tensor([[1 if problem is not None else 0, count]], dtype=torch.int64)
    every = world.allgather(mine, dim=0)
    total = int(every[:, 1].sum())
    failed = every[:, 0].nonzero()
    if not len(failed):
        return Verdict(None, None, total)
    src = int(failed[0, 0])
    return Verdict(share(world, problem if world.rank == src else "", src), src, total)


def share(world, text: str, src: int = 0) -> str:
    """Rank `src`'s `text` on every rank (collective; None world: `text`)."""
    if world is None or world.size == 1:
        return text
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if world.rank == src:
        data = text.encode()[:MESSAGE_BYTES]
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world.broadcast(buf, src)
    return bytes(buf.numpy()).rstrip(b"\0").decode(errors="replace")
