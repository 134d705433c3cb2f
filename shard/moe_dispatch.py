"""Routing a rank's own tokens as one rank would route the whole batch, and the all-to-all
that takes them to their experts' ranks and brings the outputs back.

Slots are taken choice-major, then in token order, over the whole batch (shard/moe.py `route`).
With the batch split over an axis, rank r holds a contiguous block of tokens (the leading
token dim is the split one: dsl/rules.py), so a choice's slot is: the choices of earlier
ranks (c' < c anywhere, plus choice c on earlier ranks) to its expert, plus its place among
this rank's. One allgather of every rank's [top_k, experts] counts gives all of them, and also
every rank's kept count per expert: the alltoallv sizes follow from it, with no size exchange.

Why alltoallv and not a fixed capacity with alltoall: the drops must be the single-rank run's,
so an expert's capacity is shared by the whole batch and one rank may fill all of it. A fixed
buffer would have to hold an expert's whole capacity from every source rank: n times the kept
rows. alltoallv moves the kept rows only.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

from soapstone.comm import autograd as ag


@attrs.frozen
class Routing:
    """This rank's routing: probs[T, E], experts[T, k], gates[T, k], kept[T, k]; `counts`
    [n, k, E]: every rank's choices per (choice rank, expert); `slots` an expert's capacity;
    `rank` this rank's place along the token axis (0 unsplit)."""

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    slots: int
    rank: int

    @property
    def tokens(self) -> int:
        """Tokens of the whole batch."""
        return self.probs.shape[0] * self.counts.shape[0]

    def kept_per_rank(self) -> torch.Tensor:
        """[n, E]: how many choices of each rank each expert keeps (the same on every rank)."""
        c = self.counts
        per_choice = c.sum(0)  # [k, E]
        start = (per_choice.cumsum(0) - per_choice)[None] + (c.cumsum(0) - c)  # [n, k, E]
        return (self.slots - start).clamp(min=0).minimum(c).sum(1)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, capacity: float,
          comm=None) -> Routing:
    """Route this rank's tokens x[T, h]; `comm`: the communicator the batch is split over in
    rank-order blocks (None: x is the whole batch)."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    n_tok, n_exp = probs.shape
    onehot = F.one_hot(experts.t(), n_exp)  # [k, T, E], choice-major
    mine = onehot.sum(1)  # [k, E]
    if comm is None:
        counts, rank = mine[None], 0
    else:
        counts, rank = comm.allgather(mine[None].contiguous(), 0), comm.rank
    slots = math.ceil(capacity * n_tok * counts.shape[0] * top_k / n_exp)
    every = counts.sum(0)  # [k, E]
    before = (every.cumsum(0) - every) + counts[:rank].sum(0)  # earlier choices, earlier ranks
    position = (onehot.cumsum(1) - 1 + before[:, None, :]).gather(
        -1, experts.t()[..., None]).squeeze(-1)  # [k, T]
    kept = (position < slots).t()
    return Routing(probs, experts, gates, kept, counts, slots, rank)


def balance_term(r: Routing) -> torch.Tensor:
    """This rank's term of Switch's balance loss E * sum_e(share_e * mean prob_e): the share
    counts every rank's choices; the mean prob sums this rank's tokens over the whole batch's
    count, so the ranks' terms (and their gradients) add up to the single-rank loss."""
    n_exp = r.probs.shape[-1]
    share = r.counts.sum((0, 1)).float() / (r.tokens * r.experts.shape[1])
    return n_exp * (share * (r.probs.sum(0) / r.tokens)).sum()


def exchange(tokens: torch.Tensor, r: Routing, comm, local: int, expert
             ) -> tuple[torch.Tensor, list[int], list[int]]:
    """y[T, h]: each kept choice's token sent to the rank holding its expert (`local` experts a
    rank, in rank order), run there by `expert(rows, j)` (j: the local expert), and its output
    sent back and added, times its gate, in expert order (as one rank adds them); and the rows
    the dispatch sends to and gets from each rank (the combine sends them back)."""
    tok, choice = r.kept.nonzero(as_tuple=True)
    target = r.experts[tok, choice]
    order = torch.argsort(target, stable=True)  # by expert: by destination rank, then expert
    tok, choice, target = tok[order], choice[order], target[order]
    kept = r.kept_per_rank()  # [n, E]
    n = kept.shape[0]
    me = comm.rank
    send = kept[me].reshape(n, local).sum(1).tolist()
    mine = kept[:, me * local:(me + 1) * local]  # [n, local]: rows from each rank per expert
    recv = mine.sum(1).tolist()
    rows = ag.all_to_all_v(tokens[tok], comm, send, recv)
    which = torch.arange(local).repeat(n).repeat_interleave(mine.reshape(-1))
    out = torch.zeros_like(rows)
    for j in range(local):
        at = (which == j).nonzero(as_tuple=True)[0]
        if at.numel():
            out = out.index_add(0, at, expert(rows[at], j))
    back = ag.all_to_all_v(out, comm, recv, send)
    gate = r.gates[tok, choice].unsqueeze(-1).to(back.dtype)
    return torch.zeros_like(tokens).index_add(0, tok, back * gate), send, recv
