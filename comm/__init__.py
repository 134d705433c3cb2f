"""soapstone.comm: communicators (MPI, NCCL), Mesh, autograd-aware collectives, p2p.

Attributes load lazily so that `import soapstone.comm` (and `soapstone bench --help`) costs no
torch or MPI import until something is used.
"""

from __future__ import annotations

import importlib

from soapstone.comm import moved

_EXPORTS = {
    "Communicator": "communicator",
    "CommError": "errors",
    "UserError": "errors",
    "Work": "communicator",
    "OpStats": "communicator",
    "bus_bytes": "accounting",
    "MPICommunicator": "backends.mpi",
    "NCCLCommunicator": "backends.nccl",
    "nccl_available": "backends.nccl",
    "Mesh": "mesh",
    "init": "launch.world",
    "install_failure_handler": "launch.failure",
    "abort_on_exception": "launch.failure",
    "autograd": None,
}

__all__ = sorted(_EXPORTS)


def _export(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'soapstone.comm' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


# modules that moved rooms (0.2): their old paths work until 0.3, with a DeprecationWarning
__getattr__ = moved.keep_old_paths(__name__, {
    "bench_nccl": "bench.nccl",
    "debug": "observe.debug",
    "device": "launch.device",
    "diagnose": "observe.diagnose",
    "expected": "observe.expected",
    "failure": "launch.failure",
    "flight_recorder": "observe.flight_recorder",
    "mpi": "backends.mpi",
    "nccl": "backends.nccl",
    "nodes": "launch.nodes",
    "supervisor": "launch.supervisor",
    "watchdog": "observe.watchdog",
    "world": "launch.world",
}, names=_export)
