"""Which device a rank computes on: `cpu`, `cuda` (one GPU per rank, over NCCL) or `auto`;
and over which communicator (--comm): `auto`, `nccl` or `mpi`.

A CUDA rank takes the GPU of its node-local rank (the ranks sharing its memory:
MPI.COMM_TYPE_SHARED). With a GPU per rank the ranks always talk over NCCL. More ranks on a
node than GPUs is bad input naming both numbers, unless `--comm mpi` asks for sharing: NCCL
(2.5 and later) refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so
ranks that share a GPU (rank r on GPU r mod GPUs) exchange over MPI instead, staging every
message through host memory (comm/backends/staged.py): any layout can then be debugged on one
GPU, slowly. The choice is always explicit, never a silent fallback. Every check runs before
any NCCL call, and the verdict is agreed over the world, so every rank fails together (exit 2)
instead of some waiting in a collective for the others.
"""

from __future__ import annotations

import socket

import torch

from soapstone.comm.errors import UserError

DEVICES = ("cpu", "cuda", "auto")
COMMS = ("auto", "nccl", "mpi")
GPU_EXTRA = ("pip install 'soapstone[gpu]' (cupy-cuda12x and NCCL; 'soapstone[gpu13]' for "
             "a CUDA 13 torch) with a CUDA build of torch")


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
                "or use --device cpu, or add --comm mpi to share the GPUs through host memory "
                "(slow: for debugging a layout)")
    return None


def comm_error(kind: str, comm: str, local_ranks: int, gpus: int, host: str) -> str | None:
    """Why --comm COMM cannot serve --device KIND (cpu or cuda) with `local_ranks` ranks on a
    node of `gpus` GPUs (None when it can). With a GPU per rank it is NCCL; --comm mpi is for
    ranks sharing GPUs."""
    if comm not in COMMS:
        return f"--comm {comm}: unknown; use one of {', '.join(COMMS)}"
    if kind == "cpu":
        if comm == "nccl":
            return ("--comm nccl: NCCL moves CUDA tensors; add --device cuda, or use --comm "
                    "mpi (or auto) on the CPU")
        return None
    if comm != "mpi":
        return gpus_per_node_error(local_ranks, gpus, host)
    if gpus == 0:
        return f"--device cuda --comm mpi: node {host} has no GPU that torch can see; " \
               "use --device cpu"
    if local_ranks <= gpus:
        own = "each have a GPU of their own" if local_ranks > 1 else "has a GPU of its own"
        return (f"--comm mpi: the {local_ranks} rank{'s' if local_ranks != 1 else ''} on node "
                f"{host} {own} ({gpus} GPU{'s' if gpus != 1 else ''}), "
                "so they talk over NCCL; --comm mpi is for more ranks than GPUs (staging "
                "through host memory to debug a layout); drop --comm mpi")
    return None


def backend(kind: str, comm: str = "auto") -> str:
    """The comm.init backend for --device KIND (cpu or cuda) and --comm: `mpi` on the CPU,
    `mpi-staged` for CUDA ranks sharing GPUs (--comm mpi), else `nccl`."""
    if kind == "cpu":
        return "mpi"
    return "mpi-staged" if comm == "mpi" else "nccl"


def cuda_problem(flag: str = "--device cuda", instead: str = "--device cpu",
                 nccl: bool = True) -> str | None:
    """Why CUDA ranks cannot run in this process (None when they can). `flag`: what asked
    for CUDA; `instead`: the CPU choice to offer; `nccl`: whether they need NCCL too (not
    when --comm mpi stages through host memory)."""
    if not torch.cuda.is_available():
        build = "without CUDA" if torch.version.cuda is None else \
            f"with CUDA {torch.version.cuda}, but it sees no GPU"
        return f"{flag}: torch {torch.__version__} is built {build}; {GPU_EXTRA}, " \
               f"or use {instead}"
    if not nccl:
        return None
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
         instead: str = "--device cpu", comm: str = "auto") -> torch.device:
    """This rank's device for a --device choice and --comm (collective over the MPI world when
    CUDA is asked for: the ranks agree on the verdict, then each takes its node-local GPU, or
    GPU local rank mod GPUs when --comm mpi shares them). Raises DeviceError, on every rank
    alike, when it cannot be used; its message names `flag` and offers `instead`."""
    kind = resolve(choice)
    if kind == "cpu":
        problem = comm_error(kind, comm, 1, 0, socket.gethostname())
        if problem is not None:
            raise DeviceError(problem)
        return torch.device("cpu")
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    problem = cuda_problem(flag, instead, nccl=comm != "mpi")
    if problem is None:
        gpus = torch.cuda.device_count()
        host = socket.gethostname()
        problem = (comm_error(kind, comm, local_size, gpus, host) if comm != "auto"
                   else gpus_per_node_error(local_size, gpus, host, flag))
    # the first rank's problem, if any rank has one, so every rank raises the same error
    problems = world.allgather(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise DeviceError(first)
    index = local % torch.cuda.device_count()  # local itself unless --comm mpi shares GPUs
    torch.cuda.set_device(index)
    if comm != "mpi":  # NCCL's cupy: it must work on the same GPU as torch
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
        want = "nccl" if device.type == "cuda" else "mpi"
        raise DeviceError(f"device {device}: the mesh's communicators take {have} tensors; "
                          f"build it over soapstone.comm.init('{want}')")
