"""What a pipeline schedule is made of: actions, each of one kind, and what each kind means.

Compute kinds: `F` (forward of a microbatch through a virtual stage), `B` (its backward, or
only the input gradient where a `W` follows) and `W` (the weight gradients of a split
backward). Communication kinds: `RA` / `RG` post a receive of an activation / a gradient, `SA`
/ `SG` start a send. Everything that differs per kind (which message a compute reads and
sends, which way a message flows, over which edge, to which neighbour stage, what a compute
waits for) is one row of `_TRAITS`, read through ActionKind's properties: the schedule's
simulation, the p2p grouping, the expected call sequence, explain and the executor all ask
the kind, none re-derives it. Pure data: no torch.
"""

from __future__ import annotations

import enum

import attrs


class Direction(enum.StrEnum):
    """What a message carries: an activation (downstream) or a gradient (upstream).

    flow: +1 towards the next virtual stage (activations), -1 towards the one before;
    noun: the word for it in messages."""

    A = "A"
    G = "G"

    flow: int
    noun: str


@attrs.frozen
class _Traits:
    compute: bool
    direction: Direction | None  # compute: the way its messages flow (W: none); p2p: what moves
    sending: bool = False  # p2p: a send (else a receive)
    recv: ActionKind | None = None  # compute: the receive of its input (when it has a peer)
    send: ActionKind | None = None  # compute: the send of its output (when it has a peer)
    follows: ActionKind | None = None  # compute: what it waits for on its stage without a peer


class ActionKind(enum.StrEnum):
    """One kind of schedule action (the module doc); its str is its letter(s). What it means
    is its row of `_TRAITS`, read as attributes of the member (plain attributes, not
    properties: the executor asks them for every action of every step):

    compute: F, B, W (work on a stage; else a send or a receive); sending: SA, SG;
    receiving: RA, RG; direction: which way its messages flow (W: None, it has none);
    messages: whether it reads or makes a message (all but W, a split backward's weight
    half, which stays on its stage); recv / send: a compute's receive of its input and send
    of its output (F: RA, SA; B: RG, SG; W: None); follows: the compute of the same
    microbatch and stage it waits for where no message feeds it (B on the last stage waits
    for its F, W for its B)."""

    F = "F"
    B = "B"
    W = "W"
    RA = "RA"
    RG = "RG"
    SA = "SA"
    SG = "SG"

    compute: bool
    direction: Direction | None
    messages: bool
    sending: bool
    receiving: bool
    recv: ActionKind | None
    send: ActionKind | None
    follows: ActionKind | None

    def peer(self, stage: int) -> int:
        """The virtual stage at the other end of a send or receive at `stage`."""
        flow = self.direction.flow
        return stage + flow if self.sending else stage - flow

    def edge(self, stage: int) -> int:
        """The stage-graph edge a send or receive at `stage` moves over (edge i joins virtual
        stages i and i + 1)."""
        return min(stage, self.peer(stage))


A, G, K = Direction.A, Direction.G, ActionKind
A.flow, A.noun = 1, "activation"
G.flow, G.noun = -1, "gradient"
# the one table of what each kind means
_TRAITS: dict[ActionKind, _Traits] = {
    K.F: _Traits(True, A, recv=K.RA, send=K.SA),
    K.B: _Traits(True, G, recv=K.RG, send=K.SG, follows=K.F),
    K.W: _Traits(True, None, follows=K.B),
    K.RA: _Traits(False, A),
    K.RG: _Traits(False, G),
    K.SA: _Traits(False, A, sending=True),
    K.SG: _Traits(False, G, sending=True),
}
for _k, _t in _TRAITS.items():
    _k.compute, _k.direction, _k.sending = _t.compute, _t.direction, _t.sending
    _k.receiving = not _t.compute and not _t.sending
    _k.messages = _t.direction is not None
    _k.recv, _k.send, _k.follows = _t.recv, _t.send, _t.follows


@attrs.frozen
class Action:
    """One action of a schedule: `kind` of microbatch `mb` at virtual stage `stage`."""

    kind: ActionKind = attrs.field(converter=ActionKind)
    mb: int
    stage: int  # virtual stage

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@{self.stage}"

    def fed(self, last: int) -> bool:
        """Whether a compute action's input comes from a neighbour stage (F: from the stage
        before, B: from the one after; `last` is the last virtual stage)."""
        d = self.kind.direction
        return d is not None and 0 <= self.stage - d.flow <= last

    def receive(self, last: int) -> Action | None:
        """The receive a compute action reads (None: no neighbour feeds it)."""
        return Action(self.kind.recv, self.mb, self.stage) if self.fed(last) else None

    def send(self, last: int) -> Action | None:
        """The send of a compute action's output (None: no neighbour reads it)."""
        d = self.kind.direction
        if d is None or not 0 <= self.stage + d.flow <= last:
            return None
        return Action(self.kind.send, self.mb, self.stage)

    def waits_for(self, last: int) -> tuple[ActionKind, int, int] | None:
        """(kind, microbatch, stage) of the compute this one cannot start before: the one on
        the neighbour stage that produces its input, else the one it follows on its own stage
        (None: the first stage's forward)."""
        if self.fed(last):
            return self.kind, self.mb, self.stage - self.kind.direction.flow
        k = self.kind.follows
        return (k, self.mb, self.stage) if k is not None else None
