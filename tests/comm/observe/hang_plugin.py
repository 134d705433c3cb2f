"""A --plugin for tests/comm/observe/test_watchdog.py's `soapstone run` hangs;
SOAPSTONE_TEST_HANG picks one:

- sleep_layer: the `swiglu` layer of examples/swiglu.par (the example's math) sleeps on world
  rank 1 at its first call, as a stuck custom layer or data loader would;
- never_send: world rank 0 drops its p2p sends (a pipeline stage that never sends).

The short deadline is armed where the job is about to hang (the layer's first call, the first
p2p call), not at launch: before that, ranks may legitimately wait for each other for seconds
on a loaded machine (imports, compiles). It prints the timeout the run flags had set, so the
test sees `run --collective-timeout` arrive.
"""

from __future__ import annotations

import os
import time

import soapstone.dsl
from soapstone.comm.observe import watchdog

MODE = os.environ.get("SOAPSTONE_TEST_HANG", "")
DEADLINE_S = float(os.environ.get("SOAPSTONE_TEST_DEADLINE", "3"))
_armed = False


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _arm() -> None:
    global _armed
    if not _armed:
        _armed = True
        print(f"[rank {_rank()}] hang_plugin: run set the timeout to {watchdog.get().timeout:g}s;"
              f" arming {DEADLINE_S:g}s", flush=True)
        watchdog.configure(timeout=DEADLINE_S)


@soapstone.dsl.layer(
    "swiglu",
    inputs=["x[..., hidden]"],
    params={"w1": ("[hidden, ffn]", "normal(0.02)"), "w3": ("[hidden, ffn]", "normal(0.02)"),
            "w2": ("[ffn, hidden]", "normal(0.02)")},
    output="[..., hidden]",
    dims=("ffn",),
    shard={"ffn": "partial"},
)
def swiglu(x, w1, w3, w2):
    """silu(x @ w1) * (x @ w3) @ w2; in sleep_layer mode rank 1 sleeps first."""
    import torch.nn.functional as F

    if MODE == "sleep_layer":
        _arm()
        if _rank() == 1:
            time.sleep(600)
    return (F.silu(x @ w1) * (x @ w3)) @ w2


if MODE == "never_send":
    from soapstone.comm.communicator import Communicator, Work

    _isend, _irecv = Communicator.isend, Communicator.irecv

    def isend(self, t, dst, tag=0):
        _arm()
        if _rank() == 0:
            return Work(None, None)  # dropped: the peer waits for it forever
        return _isend(self, t, dst, tag)

    def irecv(self, t, src, tag=0):
        _arm()
        return _irecv(self, t, src, tag)

    Communicator.isend, Communicator.irecv = isend, irecv
