"""Which device a rank computes on: `cpu`, `cuda` (one GPU per rank, over NCCL) or `auto`.

A CUDA rank takes the GPU of its node-local rank (the ranks sharing its memory:
MPI.COMM_TYPE_SHARED): more ranks on a node than GPUs is bad input naming both numbers. There
is no sharing: NCCL (2.5 and later) refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), and the world communicator holds every rank. Every check runs
before any NCCL call, and the verdict is agreed over the world, so every rank fails together
(exit 2) instead of some waiting in a collective for the others.
"""

from __future__ import annotations

import socket

import torch

from soapstone.comm.errors import UserError

DEVICES = ("cpu", "cuda", "auto")
GPU_EXTRA = "pip install 'soapstone[gpu]' (cupy-cuda12x and NCCL) with a CUDA build of torch"


class DeviceError(UserError, ValueError):
    """A device that cannot be used here: says why and how to get it, or to use the CPU."""


def gpus_per_node_error(local_ranks: int, gpus: int, host: str,
                        flag: str = "--device cuda") -> str | None:
    """The message for a node with no GPU or more ranks than GPUs (None when it fits).
    `flag`: what asked for CUDA."""
    if gpus == 0:
        return f"{flag}: node {host} has no GPU that torch can see; use --device cpu"
    if local_ranks > gpus:
        return (f"{flag}: {local_ranks} ranks on node {host} but {gpus} GPU"
                f"{'s' if gpus != 1 else ''}; launch at most {gpus} rank"
                f"{'s' if gpus != 1 else ''} per node (NCCL refuses two ranks on one GPU), "
                "or use --device cpu")
    return None


def cuda_problem(flag: str = "--device cuda", instead: str = "--device cpu") -> str | None:
    """Why CUDA ranks cannot run in this process (None when they can). `flag`: what asked
    for CUDA; `instead`: the CPU choice to offer."""
    if not torch.cuda.is_available():
        build = "without CUDA" if torch.version.cuda is None else \
            f"with CUDA {torch.version.cuda}, but it sees no GPU"
        return f"{flag}: torch {torch.__version__} is built {build}; {GPU_EXTRA}, " \
               f"or use {instead}"
    from soapstone.comm.backends.nccl import nccl_module

    try:
        nccl_module()
    except UserError as e:
        return f"{flag}: NCCL is not usable ({e}); {GPU_EXTRA}, or use {instead}"
    return None


def resolve(choice: str) -> str:
    """`cpu` or `cuda` for a --device choice: `auto` is cuda when torch sees a GPU."""
    if choice not in DEVICES:
        raise DeviceError(f"--device {choice}: unknown; use one of {', '.join(DEVICES)}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def pick(choice: str, flag: str = "--device cuda",
         instead: str = "--device cpu") -> torch.device:
    """This rank's device for a --device choice (collective over the MPI world when CUDA is
    asked for: the ranks agree on the verdict, then each takes its node-local GPU). Raises
    DeviceError, on every rank alike, when it cannot be used; its message names `flag` and
    offers `instead`."""
    kind = resolve(choice)
    if kind == "cpu":
        return torch.device("cpu")
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    problem = cuda_problem(flag, instead)
    if problem is None:
        problem = gpus_per_node_error(local_size, torch.cuda.device_count(),
                                      socket.gethostname(), flag)
    # the first rank's problem, if any rank has one, so every rank raises the same error
    problems = world.allgather(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise DeviceError(first)
    index = local
    torch.cuda.set_device(index)
    import cupy

    cupy.cuda.Device(index).use()
    return torch.device("cuda", index)


def check_placement(device: torch.device, mesh) -> None:
    """DeviceError unless tensors on `device` can run on `mesh`'s communicators (None: one
    rank): CUDA needs a usable GPU, and a mesh over NCCL (init('nccl')); the CPU, MPI."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(cuda_problem())
    if mesh is None or not hasattr(mesh, "world"):
        return
    have = mesh.world.device_type
    if have != device.type:
        backend = "nccl" if device.type == "cuda" else "mpi"
        raise DeviceError(f"device {device}: the mesh's communicators take {have} tensors; "
                          f"build it over soapstone.comm.init('{backend}')")
