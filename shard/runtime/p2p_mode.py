"""How a pipeline's p2p runs on this device: posted ahead with MPI tags, or in the groups the
static proof pairs (NCCL has no tags); and whether the device can run the schedule at all
(shard/runtime/executor.py's module doc describes the two modes)."""

from __future__ import annotations

import os

import torch

from soapstone.comm.errors import UserError
from soapstone.shard.plan import schedules
from soapstone.shard.plan.stage_graph import StageGraph
from soapstone.shard.plan.verify import p2p_proof

P2P_MODES = ("ahead", "grouped")


class P2PModeError(UserError, ValueError):
    """An unknown p2p mode, or one the device cannot run."""


def p2p_mode(choice: str | None, device: torch.device) -> str:
    """The p2p mode to run: `choice`, else SOAPSTONE_P2P, else grouped on CUDA and ahead on
    CPU. CUDA runs grouped only: posting receives ahead needs tags, which NCCL lacks."""
    where = "p2p" if choice is not None else "SOAPSTONE_P2P"
    if choice is None:
        choice = os.environ.get("SOAPSTONE_P2P", "").strip() or None
    if choice is None:
        return "grouped" if device.type == "cuda" else "ahead"
    if choice not in P2P_MODES:
        raise P2PModeError(f"{where} = {choice!r}: unknown p2p mode; use one of "
                           f"{', '.join(P2P_MODES)}")
    if device.type == "cuda" and choice != "grouped":
        raise P2PModeError(f"{where} = {choice!r} cannot run on --device cuda: NCCL has no tags "
                           "to match receives posted ahead; use grouped")
    return choice


def check_device(graph: StageGraph, device: torch.device) -> None:
    """DeviceError for a layout this device cannot run: on CUDA a pipeline runs its p2p in
    groups (NCCL's in-order semantics, no tags), so its schedule must be one whose groups
    p2p_proof proves deadlock-free and FIFO-paired, for training and for infer. The proof
    counts one message per action; an edge's several tensors go as consecutive messages in
    the same order on both sides, so they pair whenever the actions do."""
    if device.type != "cuda" or graph.pipe <= 1:
        return
    sched = schedules.build(graph.schedule, graph.pipe, graph.microbatches, graph.chunks)
    why = p2p_proof.unproven(sched)
    if why is None:
        return
    from soapstone.comm.launch.device import DeviceError

    raise DeviceError(
        f"layout {graph.parallel}: schedule {graph.schedule} (pipe = {graph.pipe}, "
        f"microbatches = {graph.microbatches}, chunks = {graph.chunks}) cannot run on "
        f"--device cuda: no grouping of its p2p is proven deadlock-free under NCCL's in-order "
        f"rendezvous ({why}); run it with --device cpu, or pick another schedule or "
        "microbatch count")
