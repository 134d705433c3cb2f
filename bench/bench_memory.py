"""explain's activation estimate against what a real step holds.

For each case (an example model with dims scaled up so that activations dominate, on one rank;
or, under mpiexec, one layout), one training step of `soapstone run`'s path (Executor + AdamW)
is measured on every rank after a first step has allocated gradients and optimizer state:
- saved: the bytes autograd keeps for backward (every tensor a saved-tensors hook packs, each
  storage once, parameters left out): explain's `activation_bytes`. Storage that forward
  empties after packing (selective recompute's dropped values, sequence parallelism's
  gathered linear inputs) is counted at its packed size, so there "live" is the measure;
  under ZeRO-3 its own hooks take every save and the column shows "-";
- peak: the forward and backward's peak resident memory above what the rank held before
  (VmHWM reset through /proc/self/clear_refs; allocations over 64 KiB each get their own
  mmap, returned at free, so resident memory follows the live tensors): explain's
  `activation_bytes + transient_bytes`, less the input batch, which exists before.
  glibc serves a request over the mmap threshold from a free chunk of its heap when one is
  big enough (mmap only when the heap would grow), so which tensors land in already-resident
  heap pages varies run to run with the heap's layout: at a few MiB this moves the resident
  peak by up to ~0.8 MiB (measured at pipe 2, 1F1B: the free heap chunks of >= 128 KiB at a
  step's start were 0 to 3, and a 128 KiB receive buffer came from the heap in some runs);
- malloc: the same step's peak of the bytes malloc hands out (heap in use + mmapped chunks,
  glibc's mallinfo2) above the step's start, sampled after every torch op: every tensor,
  MPI's and Python's own allocations included, wherever malloc puts them; the same every run.

    .venv/bin/python bench/bench_memory.py [--json F] [--precision bf16 [--precision fp32]]
    .venv/bin/python bench/bench_memory.py --spec examples/llama.par --precision float8 \\
        --dim seq=128 --dim hidden=128 --dim ffn=512 --dim vocab=256
    mpiexec -n 2 .venv/bin/python bench/bench_memory.py --spec examples/gpt.par \\
        --parallel tp2 --dim seq=256 --dim hidden=256
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

CASES = [  # (spec, dims)
    ("examples/mlp.par", {"batch": 4096, "features": 512, "ffn": 2048}),
    ("examples/gpt.par", {"batch": 8, "seq": 256, "hidden": 256, "heads": 8, "ffn": 1024,
                          "vocab": 512}),
    ("examples/towers.par", {"batch": 2048, "hidden": 512, "ffn": 2048}),
    ("examples/moe.par", {"batch": 8, "seq": 256, "hidden": 256, "experts": 8, "ffn": 1024,
                          "vocab": 512}),
]
SMALL = [  # quick enough for a test
    ("examples/mlp.par", {"batch": 1024, "features": 256, "ffn": 1024}),
    ("examples/gpt.par", {"batch": 8, "seq": 128, "hidden": 128, "heads": 4, "ffn": 512,
                          "vocab": 256}),
    ("tests/specs/loss_layouts.par", {}),  # the loss's chunks most of the step
]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _exact_rss() -> None:
    """Serve every allocation over 64 KiB by its own mmap, returned at free."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def _malloc_in_use() -> int:
    """Bytes malloc has handed out and not taken back: heap chunks in use + mmapped chunks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def _malloc_peak(run) -> int:
    """The peak of `_malloc_in_use` over `run()` above its start, sampled after every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sampler(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Sampler.peak = max(Sampler.peak, _malloc_in_use())
            return out

    start = _malloc_in_use()
    Sampler.peak = start
    with Sampler():
        run()
    return Sampler.peak - start


def measure(spec: str, dims: dict[str, int], layout: str | None = None, comm=None,
            precision: str = "fp32") -> dict:
    """explain's figures (explain --precision `precision`) vs saved-for-backward bytes and the
    step's peak of a `run --precision` step, on this rank."""
    import torch

    from soapstone.comm import Mesh
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.data.source import make_task
    from soapstone.shard.plan.analysis.explain import estimate_pipeline
    from soapstone.shard.plan.analysis.precision import graph_as_run
    from soapstone.shard.runtime.executor import Executor

    loaded = load(spec, dims=dims)
    par = loaded.parallel(layout) if layout else None
    model = loaded.model(par.model if par else None)
    graph = lower_graph(model, par)
    mesh = Mesh(comm, **dict(par.mesh)) if par is not None and graph.world_size > 1 else None
    rank = mesh.rank if mesh else 0
    pipe_rank = mesh.coord(graph.axis) if mesh and graph.axis else None
    est = estimate_pipeline(graph_as_run(graph, precision), par.zero if par else 0, "adamw",
                            rank=pipe_rank)
    # bf16: bf16 compute over fp32 masters, as the Trainer builds it for run --precision bf16;
    # float8: bf16's, with the weight matmuls in float8
    ex = Executor(graph, mesh, seed=0,
                  compute_dtype=torch.bfloat16 if precision != "fp32" else None,
                  float8=precision == "float8")
    ex.use_optimizer(name="adamw", lr=1e-3, zero=par.zero if par else 0)
    task = make_task(lower_graph(model, None).program, 0)
    ex.train_step(task.batch(0), step=0)  # gradients and optimizer state now exist
    params = {p.untyped_storage().data_ptr() for p in ex.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ex.forward_backward(task.batch(1), step=1)
    # ZeRO-3's own hooks (shard/parallel/zero.py) sit inside these and take every save: none
    # reaches `pack`, so "saved" is not measured there ("live" is the measure)
    unseen = not saved and est.activation_bytes > 0
    ex.step()
    batch = task.batch(2)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    ex.forward_backward(batch, step=2)
    peak = _status("VmHWM") - before
    ex.step()
    from soapstone.shard.runtime.memory import LiveBytes

    live = LiveBytes()  # the same step's tensors alone: no allocator or MPI buffers
    with live:
        ex.forward_backward(task.batch(3), step=3)
    ex.step()
    malloc = _malloc_peak(lambda: ex.forward_backward(task.batch(4), step=4))
    ex.step()
    # the batch exists before the step; under bf16 and float8 its float inputs are cast to a
    # new bf16 copy inside the step, which explain counts as the input value: the rest is old
    inputs = sum(t.untyped_storage().nbytes() for t in batch.values()
                 if precision == "fp32" or not t.is_floating_point())
    est_peak = est.activation_bytes + est.transient_bytes - inputs
    return {"spec": spec, "dims": dims, "layout": layout, "rank": rank, "precision": precision,
            "explain_activation_bytes": est.activation_bytes,
            "explain_transient_bytes": est.transient_bytes, "saved_bytes": sum(saved.values()),
            "peak_step_bytes": peak, "input_bytes": inputs, "live_step_bytes": live.peak,
            "live_error": est_peak / max(1, live.peak) - 1, "malloc_step_bytes": malloc,
            "malloc_error": est_peak / max(1, malloc) - 1,
            "saved_error": None if unseen else
            est.activation_bytes / max(1, sum(saved.values())) - 1,
            "peak_error": est_peak / max(1, peak) - 1}


def table(rows: list[dict]) -> str:
    """The rows as text."""
    out = [f"{'case':<34} {'rank':>4} {'saved MiB':>9} {'explain':>8} {'err':>6} "
           f"{'peak MiB':>8} {'explain':>8} {'err':>6} {'live MiB':>8} {'err':>6} "
           f"{'malloc':>8} {'err':>6}"]
    for r in rows:
        case = r["spec"] + (f" / {r['layout']}" if r["layout"] else "")
        est_peak = r["explain_activation_bytes"] + r["explain_transient_bytes"] - \
            r["input_bytes"]
        saved = ("-", "-") if r["saved_error"] is None else \
            (f"{r['saved_bytes'] / 2**20:.1f}", f"{r['saved_error']:+.1%}")
        out.append(f"{case:<34} {r['rank']:>4} {saved[0]:>9} "
                   f"{r['explain_activation_bytes'] / 2**20:>8.1f} {saved[1]:>6} "
                   f"{r['peak_step_bytes'] / 2**20:>8.1f} {est_peak / 2**20:>8.1f} "
                   f"{r['peak_error']:>+6.1%} {r['live_step_bytes'] / 2**20:>8.1f} "
                   f"{r['live_error']:>+6.1%} {r['malloc_step_bytes'] / 2**20:>8.1f} "
                   f"{r['malloc_error']:>+6.1%}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", help="one case: this spec (default: the built-in cases)")
    ap.add_argument("--parallel", help="its layout (run under mpiexec -n WORLD)")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--small", action="store_true", help="the quick cases (tests)")
    ap.add_argument("--json", metavar="F", help="also write the rows as JSON (rank 0)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "float8"), action="append",
                    help="the step's, as run's --precision (default fp32; repeat it for "
                         "each in turn)")
    args = ap.parse_args()
    import torch

    from soapstone.comm import init
    from soapstone.dsl.app.build import parse_dims

    torch.set_num_threads(1)
    _exact_rss()
    comm = init("mpi")
    if args.spec:
        cases = [(args.spec, parse_dims(args.dim))]
    else:
        cases = SMALL if args.small else CASES
    rows = [measure(spec, dims, args.parallel, comm, p) for spec, dims in cases
            for p in args.precision or ["fp32"]]
    from mpi4py import MPI

    every = MPI.COMM_WORLD.allgather(rows)
    if comm.rank == 0:
        flat = [r for part in every for r in part]
        sys.stdout.write(table(flat))
        if args.json:
            Path(args.json).write_text(json.dumps(flat, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
