"""Routing a rank's own tokens as one rank would route the whole batch, and the all-to-all
that takes them to their experts' ranks and brings the outputs back.

Slots are taken choice-major, then in token order, over the whole batch. A rank whose token
dims are split holds runs of tokens that are contiguous in the batch's order (one run when
only the leading dim is split; one per local row when an inner dim is). A choice's slot is
the earlier choices to its expert: every choice of an earlier rank (c' < c) anywhere, the
choices c of the runs that start before its run, and its place in its own run. One allgather
of every rank's [top_k, runs, experts] counts gives all of them; the start of each rank's
runs follows from its mesh coordinates. The same counts give every rank's kept rows per
expert, so the alltoallv sizes need no exchange of their own.

Why alltoallv and not a fixed capacity with alltoall: the drops must be the single-rank run's,
so an expert's capacity is shared by the whole batch and one rank may fill all of it. A fixed
buffer would have to hold an expert's whole capacity from every source rank: n times the kept
rows. alltoallv moves the kept rows only.
"""

from __future__ import annotations

import itertools
import math

import attrs
import torch
import torch.nn.functional as F

from soapstone.comm import autograd as ag


@attrs.frozen
class TokenSplit:
    """Where each rank of the routing communicator holds its tokens: the token dims' global
    and local sizes (outermost first) and, per rank in the communicator's order, each dim's
    offset; `rank` is this rank's index there."""

    sizes: tuple[int, ...]
    local: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def inner(self) -> int:
        """The innermost split dim (-1: none): dims outside it index the runs."""
        return max((d for d, (g, n) in enumerate(zip(self.sizes, self.local, strict=True))
                    if n < g), default=-1)

    @property
    def runs(self) -> int:
        """Contiguous runs of tokens a rank holds."""
        return math.prod(self.local[:max(self.inner, 0)])

    def starts(self) -> torch.Tensor:
        """[ranks * runs]: the batch index of each rank's runs' first tokens, rank-major."""
        j = self.inner
        if j < 0:
            return torch.zeros(1, dtype=torch.long)
        stride = [math.prod(self.sizes[d + 1:]) for d in range(len(self.sizes))]
        grid = torch.zeros((), dtype=torch.long)
        for d in range(j):  # the runs' local index, outermost first
            grid = (grid[..., None] + torch.arange(self.local[d]) * stride[d]).reshape(-1)
        base = torch.tensor([sum(off[d] * stride[d] for d in range(j + 1))
                             for off in self.offsets])
        return (base[:, None] + grid.reshape(1, -1)).reshape(-1)


@attrs.frozen
class Routing:
    """This rank's routing: probs[T, E], experts[T, k], gates[T, k], kept[T, k]; `counts`
    [n, k, runs, E]: every rank's choices per (choice rank, run, expert); `start` [k, n*runs,
    E]: the slot each run's first choice to an expert would take; `slots` an expert's
    capacity."""

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    start: torch.Tensor
    slots: int

    @property
    def tokens(self) -> int:
        """Tokens of the whole batch."""
        return self.probs.shape[0] * self.counts.shape[0]

    def kept_per_rank(self) -> torch.Tensor:
        """[n, E]: how many choices of each rank each expert keeps (the same on every rank)."""
        n, k, runs, e = self.counts.shape
        per_run = self.counts.permute(1, 0, 2, 3).reshape(k, n * runs, e)
        kept = (self.slots - self.start).clamp(min=0).minimum(per_run)
        return kept.reshape(k, n, runs, e).sum((0, 2))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, capacity: float,
          split: TokenSplit | None = None, comm=None, normalize: bool = False) -> Routing:
    """Route this rank's tokens x[T, h] (in the batch's order within the rank); `split` and
    `comm`: where the ranks hold their tokens and the communicator over them (None: x is
    the whole batch). The softmax is over every expert, in fp32, before the top_k (as
    transformers' Mixtral and Qwen-MoE routers); `normalize` divides the kept weights by
    their sum; capacity 0 keeps every choice."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    n_tok, n_exp = probs.shape
    runs = split.runs if split is not None else 1
    onehot = F.one_hot(experts.t(), n_exp).reshape(top_k, runs, -1, n_exp)  # choice-major
    mine = onehot.sum(2)  # [k, runs, E]
    rank = split.rank if split is not None else 0
    counts = mine[None] if comm is None else comm.allgather(mine[None].contiguous(), 0)
    n = counts.shape[0]
    # capacity 0: an expert may take every token of the batch (each picks it at most once)
    slots = math.ceil(capacity * n_tok * n * top_k / n_exp) if capacity else n_tok * n
    per_run = counts.permute(1, 0, 2, 3).reshape(top_k, n * runs, n_exp)
    order = split.starts().argsort() if split is not None else torch.arange(n * runs)
    ahead = torch.empty_like(per_run)  # choices c of the runs before each run, to each expert
    ahead[:, order] = per_run[:, order].cumsum(1) - per_run[:, order]
    every = per_run.sum(1)  # [k, E]
    start = (every.cumsum(0) - every)[:, None, :] + ahead  # [k, n*runs, E]
    here = start[:, rank * runs:(rank + 1) * runs, None, :]
    position = (onehot.cumsum(2) - 1 + here).gather(
        -1, experts.t().reshape(top_k, runs, -1, 1)).reshape(top_k, n_tok)
    return Routing(probs, experts, gates, (position < slots).t(), counts, start, slots)


def balance_term(r: Routing) -> torch.Tensor:
    """This rank's term of Switch's balance loss E * sum_e(share_e * mean prob_e): the share
    counts every rank's choices; the mean prob sums this rank's tokens over the whole batch's
    count, so the ranks' terms (and their gradients) add up to the single-rank loss."""
    n_exp = r.probs.shape[-1]
    share = r.counts.sum((0, 1, 2)).float() / (r.tokens * r.experts.shape[1])
    return n_exp * (share * (r.probs.sum(0) / r.tokens)).sum()


def exchange(tokens: torch.Tensor, r: Routing, group: list[int], me: int, comm, local: int,
             expert) -> tuple[torch.Tensor, list[int], list[int]]:
    """y[T, h]: each kept choice's token sent to the rank holding its expert (`local` experts a
    rank, in the order of `comm`, whose ranks are the routing ranks `group`; this rank is
    `group[me]`), run there by `expert(rows, j)` (j: the local expert), its output sent back
    and added, times its gate, in expert order (as one rank adds them); and the rows the
    dispatch sends to and gets from each rank (the combine sends them back)."""
    tok, choice = r.kept.nonzero(as_tuple=True)
    target = r.experts[tok, choice]
    order = torch.argsort(target, stable=True)  # by expert: by destination rank, then expert
    tok, choice = tok[order], choice[order]
    kept = r.kept_per_rank()[group]  # [n, E]: the exchange group's rows per expert
    n = len(group)
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


def token_split(ctx, x, lead: tuple[str, ...], axes: tuple[str, ...]) -> tuple[TokenSplit, list]:
    """Where the ranks of the communicator over `axes` (row-major, in mesh order) hold the
    token dims `lead` of value `x`, and each rank's coordinates on those axes."""
    mesh = ctx.mesh
    ordered = [a for a in mesh.axes if a in axes]
    local = tuple(x.local_shape[x.dims.index(d)] for d in lead)
    on = [x.layout.split_axis(d) for d in lead]
    coords = [dict(zip(ordered, c, strict=True))
              for c in itertools.product(*(range(mesh.size(a)) for a in ordered))]
    offsets = tuple(tuple(at[a] * n if a else 0 for a, n in zip(on, local, strict=True))
                    for at in coords)
    me = coords.index({a: mesh.coord(a) for a in ordered})
    return TokenSplit(tuple(ctx.sizes[d] for d in lead), local, offsets, me), coords


def exchange_group(ctx, coords: list[dict], axis: str) -> list[int]:
    """The routing ranks (indices into `coords`) that differ from this one only along
    `axis`, in that axis's order: the ranks of the exchange's communicator."""
    mesh = ctx.mesh
    return [i for i, at in enumerate(coords)
            if all(c == mesh.coord(a) for a, c in at.items() if a != axis)]
