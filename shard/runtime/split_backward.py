"""A stage's backward in two passes, for the zero-bubble schedule: B now, W later.

    grads, later = backward_input(roots, root_grads, inputs, params)   # B
    ...                                                                 # other work
    later.run()                                                         # W

B runs the autograd graph from the stage's outputs (or its scaled loss) to its float inputs
only and returns their gradients: what the stage upstream waits for. W, run later, gives the
parameters their gradients (accumulated into .grad, so the optimizer's gradient hooks see them
as in one backward). Together they compute what one backward computes, each node's arithmetic
on the same tensors, and nothing twice.

How the graph is cut. Autograd runs only the nodes from which a requested input can be
reached, and asks a node only for the outputs leading there. So B, asked for the inputs,
runs the *path* (the nodes that reach an input's accumulator) and skips the rest, which
leads only to parameters: the *weight part*. The weight part falls into connected pieces;
each meets the path at *joints*, path nodes with an edge into it (a matmul's backward, whose
weight gradient is one of its outputs). B runs every joint with its complete incoming
gradient (all its consumers are on the path too); a pre-hook keeps that gradient. W runs,
piece by piece, the engine from the joints' kept gradients (and from any output off the path,
e.g. everything of a first stage, whose inputs are token ids) to that piece's parameters
only: a joint then computes just its weight outputs, and no path node below it is asked for
anything, since none leads to those parameters. Pieces run in the order B reached their
joints (backward's order), so gradients reach the buckets in the order a plain backward
gives them.

A piece with two joints where one lies below the other (a weight used on two layers) would
let the upper joint's gradient reach the lower one again; the lower joint's pre-hook replaces
what arrives with the gradient it kept, as torch.distributed.pipelining's
stage_backward_weight does (its design, read before writing this one).
"""

from __future__ import annotations

import attrs
import torch
from torch.autograd.graph import GradientEdge, Node


def node_of(t: torch.Tensor) -> Node | None:
    """The autograd node a gradient for `t` enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # a leaf's accumulator exists only once a graph uses it; a view reaches the same one
    return t.view_as(t).grad_fn.next_functions[0][0]


@attrs.define
class _Piece:
    """One connected piece of the weight part: where W starts, what it ends at."""

    joints: list[Node] = attrs.Factory(list)
    roots: list[tuple[torch.Tensor, torch.Tensor | None]] = attrs.Factory(list)
    params: list[torch.Tensor] = attrs.Factory(list)


@attrs.define
class WeightPass:
    """What W needs of one B: the pieces, the gradients kept at their joints, and the graph
    (held by the roots until W has run)."""

    pieces: list[_Piece]
    kept: dict[Node, tuple]
    order: dict[Node, int]

    def run(self) -> None:
        """Accumulate every parameter's gradient (W); frees the graph. Once only."""
        def first(p: _Piece) -> int:
            return min((self.order.get(j, len(self.order)) for j in p.joints), default=-1)

        for piece in sorted(self.pieces, key=first):
            tensors: list = []
            grads: list = []
            for t, g in piece.roots:
                tensors.append(t)
                grads.append(torch.ones_like(t) if g is None else g)
            for j in piece.joints:
                for i, g in enumerate(self.kept.get(j, ())):
                    if g is not None:
                        tensors.append(GradientEdge(j, i))
                        grads.append(g)
            if not tensors:
                continue  # no gradient reached this piece: its parameters get none
            clamps = [j.register_prehook(lambda _, kept=self.kept[j]: kept)
                      for j in piece.joints if j in self.kept] if len(piece.joints) > 1 else []
            try:
                torch.autograd.backward(tensors, grads, inputs=piece.params)
            finally:
                for h in clamps:
                    h.remove()
        self.pieces, self.kept = [], {}


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                   inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """B: the gradients of `inputs` (None for one no root reaches) from `roots` with
    `grads` (None: ones, as for a loss), and the WeightPass that later gives `params` theirs.
    Parameters the roots do not reach get no gradient, as in one backward."""
    input_nodes = {n for n in map(node_of, inputs) if n is not None}
    param_of = {n: p for p in params if (n := node_of(p)) is not None}
    root_nodes = [node_of(t) for t in roots]
    # the graph below the roots: each node's children, in one walk
    children: dict[Node, list[Node]] = {}
    stack = [n for n in root_nodes if n is not None]
    while stack:
        n = stack.pop()
        if n in children:
            continue
        kids = [c for c, _ in n.next_functions if c is not None]
        children[n] = kids
        stack.extend(k for k in kids if k not in children)
    on_path = _reaching(children, input_nodes)
    # the weight part's connected pieces (union-find over its nodes and their joints)
    parent: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    joints = set()
    for n, kids in children.items():
        for c in kids:
            if c in on_path:
                continue
            if n in on_path:
                joints.add(n)
            parent[find(c)] = find(n)
    for n in root_nodes:
        if n is not None and n not in on_path:
            find(n)
    pieces: dict[Node, _Piece] = {}
    for n in list(parent):
        if n in on_path and n not in joints:
            continue
        piece = pieces.setdefault(find(n), _Piece())
        if n in joints:
            piece.joints.append(n)
        elif n in param_of:
            piece.params.append(param_of[n])
    for t, g, n in zip(roots, grads, root_nodes, strict=True):
        if n is not None and n not in on_path:
            pieces[find(n)].roots.append((t, g))
    kept: dict[Node, tuple] = {}
    order: dict[Node, int] = {}

    def keep(node: Node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
            order.setdefault(node, len(order))
        return hook

    handles = [j.register_prehook(keep(j)) for j in joints]
    try:
        path = [(t, g) for t, g, n in zip(roots, grads, root_nodes, strict=True)
                if n is not None and n in on_path]
        wanted = [i for i, t in enumerate(inputs) if node_of(t) in on_path]
        got: list[torch.Tensor | None] = [None] * len(inputs)
        if path and wanted:
            out = torch.autograd.grad([t for t, _ in path],
                                      [inputs[i] for i in wanted],
                                      [torch.ones_like(t) if g is None else g for t, g in path],
                                      retain_graph=True, allow_unused=True)
            for i, g in zip(wanted, out, strict=True):
                got[i] = g
    finally:
        for h in handles:
            h.remove()
    live = [p for p in pieces.values() if p.params]
    return got, WeightPass(live, kept, order)


def _reaching(children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which a target can be reached (targets included)."""
    parents: dict[Node, list[Node]] = {}
    for n, kids in children.items():
        for c in kids:
            parents.setdefault(c, []).append(n)
    seen = {t for t in targets if t in children}
    stack = list(seen)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen
