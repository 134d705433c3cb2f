"""Optimizer offload in the runtime (`offload optimizer`, ZeRO-Offload's optimizer half).

The optimizer's update runs on flat segments (shard/train/optim.py): a master slice, its reduced
gradient and the rule's state. With the parameters on a CUDA device, `HostStep` keeps, for
each segment, a master copy, a gradient buffer (both pinned, so that copies run
asynchronously) and the rule's state in host memory. A step copies every gradient to the
host on a side stream (an event per segment), then for each segment in turn waits for its
gradient, runs the update on the CPU (the rule's fused CPU kernel) and copies the new master
back to the device on the side stream, so the copies of later segments overlap the update of
earlier ones. The device then holds the parameters and gradients only, never the state.

Where the parameters live in host memory already (a CPU run) there is nothing to move:
`wanted` says so and the optimizer keeps its ordinary path.
"""

from __future__ import annotations

import torch


def wanted(segments) -> bool:
    """Whether offload has anything to move: some segment's master lives on a CUDA device."""
    return any(s.master is not None and s.master.is_cuda for s in segments)


class HostStep:
    """Host copies of each segment's master and gradient, the rule's state on the host, and
    the step that updates through them (module doc)."""

    def __init__(self, segments, rule):
        self.master: list[torch.Tensor | None] = []
        self.grad: list[torch.Tensor | None] = []
        for s in segments:
            if s.master is None:
                self.master.append(None)
                self.grad.append(None)
                continue
            m = torch.empty(s.master.shape, dtype=s.master.dtype, pin_memory=True)
            m.copy_(s.master)
            self.master.append(m)
            self.grad.append(torch.empty_like(m, pin_memory=True))
        self.state = [rule.init_state(m) if m is not None else {} for m in self.master]
        # the device master's version when the host copy last matched it: anything else
        # writing it (a resumed checkpoint, a loaded state dict) makes the host copy stale
        self.seen = [s.master._version if s.master is not None else 0 for s in segments]
        self.stream = torch.cuda.Stream(device=next(
            s.master.device for s in segments if s.master is not None))

    def step(self, segments, rule, steps: int) -> None:
        """One update of every segment through host memory; the device masters hold the new
        values when it returns."""
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)  # the gradients are final (reduced, clipped)
        arrived = []
        with torch.cuda.stream(self.stream):
            for s, g in zip(segments, self.grad, strict=True):
                if g is not None and s.grad is not None:
                    g.copy_(s.grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                arrived.append(event)
        for k, s in enumerate(segments):
            m, g = self.master[k], self.grad[k]
            if m is None or s.grad is None or not m.numel():
                continue
            arrived[k].synchronize()
            if s.master._version != self.seen[k]:
                m.copy_(s.master)
            rule.update(m, g, self.state[k], steps)
            with torch.cuda.stream(self.stream):
                s.master.copy_(m, non_blocking=True)
            self.seen[k] = s.master._version
        main.wait_stream(self.stream)  # publishing reads the new masters after the copies
