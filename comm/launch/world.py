"""init(): the world communicator, created once per process."""

from __future__ import annotations

from soapstone.comm.communicator import Communicator
from soapstone.comm.errors import CommError
from soapstone.comm.launch.failure import install_failure_handler

BACKENDS = ("mpi", "nccl", "auto", "mpi-staged")
_world: Communicator | None = None


def init(backend: str = "auto", failure_handler: bool = True) -> Communicator:
    """Return the world communicator (created on the first call; later calls return it).

    backend: "mpi" (CPU tensors), "nccl" (CUDA tensors; selects this rank's GPU from its
    node-local rank first), "auto" (nccl when CUDA and cupy's NCCL are usable, else mpi), or
    "mpi-staged" (CUDA tensors over MPI through host memory, for ranks sharing a GPU: the GPU
    must be chosen already, as comm.launch.device.pick does; backends/staged.py).
    Also installs the failure handler (an uncaught exception on any rank aborts the job) and
    starts the watchdog (watchdog.py: collective deadlines, flight-recorder dumps); a bad
    SOAPSTONE_COLLECTIVE_TIMEOUT, SOAPSTONE_TRACE_DIR or SOAPSTONE_FLIGHT_RECORDER is a
    UserError, raised before anything else.
    """
    global _world
    if backend not in BACKENDS:
        raise CommError(f"init: `backend`={backend!r} is unknown; pass one of {BACKENDS}")
    if _world is not None:
        have = _backend_of(_world)
        if backend not in ("auto", have):
            raise CommError(
                f"init: already initialised with backend {have!r}, asked for {backend!r}; "
                "call init() once per process"
            )
        return _world
    from soapstone.comm.observe import watchdog
    from soapstone.comm.observe.flight_recorder import capacity_from_env

    capacity_from_env(), watchdog.timeout_from_env(), watchdog.trace_dir_from_env()
    if failure_handler:
        install_failure_handler()
    if backend == "auto":
        from soapstone.comm.backends.nccl import nccl_available

        backend = "nccl" if nccl_available() else "mpi"
    if backend == "mpi-staged":
        from soapstone.comm.backends.staged import StagedMPICommunicator

        _world = StagedMPICommunicator()
    elif backend == "nccl":
        from soapstone.comm.backends.nccl import NCCLCommunicator, select_local_device

        select_local_device()
        _world = NCCLCommunicator()
    else:
        from soapstone.comm.backends.mpi import MPICommunicator

        _world = MPICommunicator()
    from mpi4py import MPI

    watchdog.start(MPI.COMM_WORLD)
    return _world


def _backend_of(world: Communicator) -> str:
    from soapstone.comm.backends.staged import StagedMPICommunicator

    if isinstance(world, StagedMPICommunicator):
        return "mpi-staged"
    return "nccl" if world.device_type == "cuda" else "mpi"
