"""Activation recompute: memory saved and time paid, soapstone beside plain torch.

On one rank, gpt.par's model (tests/specs/recompute_layouts.par: `single` and `rc_single`,
`recompute layer`) against the plain-torch GPT of shard/train/reference_gpt.py with and without
torch.utils.checkpoint around each block (non-reentrant, as soapstone uses it). For each:
the step's peak resident memory above what the process held before it (bench_memory.py's
method), explain's activations + working set for soapstone, and the median time of a training
step (forward, backward, AdamW). The figures that matter are the ratios recompute / plain.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_recompute.py [--steps 30] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import _exact_rss, _status, measure  # noqa: E402

SPEC = str(ROOT / "tests/specs/recompute_layouts.par")
DIMS = {"batch": 8, "seq": 256, "hidden": 256, "heads": 8, "ffn": 1024, "vocab": 512}


def soapstone_step(layout: str, spec: str = SPEC, mesh=None):
    """A function running the next training step of `layout` of `spec` (one rank, or this
    rank's share on `mesh`)."""
    from soapstone.dsl import load
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.data.source import make_task
    from soapstone.shard.runtime.executor import Executor

    loaded = load(spec, dims=DIMS)
    par = loaded.parallel(layout)
    model = loaded.model(par.model)
    ex = Executor(lower_graph(model, par), mesh, seed=0)
    ex.use_optimizer(name="adamw", lr=1e-3)
    task = make_task(lower_graph(model, None).program, 0)
    count = iter(range(10**9))
    return lambda: ex.train_step(task.batch(k := next(count)), step=k)


def alternate(steps: int, **runs) -> dict[str, float]:
    """Median seconds per step of each run, their steps interleaved in a rotating order after
    one warm-up step each (comm/bench/harness.py: at least 30 steps); prints the medians with
    their interquartile ranges and the load average."""
    from soapstone.comm.bench.harness import interleave

    session = interleave(runs, steps, warmup=1)
    print(session.table())
    return {n: t.median for n, t in session.timings.items()}


def torch_step(recompute: bool):
    """A function running the next training step of the plain-torch GPT."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from soapstone.shard.train.reference_gpt import GPT

    torch.manual_seed(0)
    model = GPT(DIMS["vocab"], DIMS["hidden"], DIMS["heads"], DIMS["ffn"], 4)
    if recompute:
        for blk in model.blocks:
            plain = blk.forward
            blk.forward = lambda x, f=plain: checkpoint(f, x, use_reentrant=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = (DIMS["batch"], DIMS["seq"])
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(DIMS["vocab"], shape, generator=gen)
        model(tokens, torch.randint(DIMS["vocab"], shape, generator=gen)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def peak_of(step) -> int:
    """Resident memory a step takes above what the process held before it (after a first)."""
    step()  # gradients and optimizer state exist
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step()
    return _status("VmHWM") - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps (at least 30)")
    ap.add_argument("--json", metavar="F")
    args = ap.parse_args()
    import torch

    from soapstone.comm import init

    torch.set_num_threads(1)
    _exact_rss()
    comm = init("mpi")
    rows = {}
    for layout in ("single", "rc_single"):
        m = measure(SPEC, DIMS, layout, comm)
        rows[layout] = {"peak_step_bytes": m["peak_step_bytes"],
                        "explain_bytes": m["explain_activation_bytes"]
                        + m["explain_transient_bytes"] - m["input_bytes"]}
    for name, rc in (("torch", False), ("torch+checkpoint", True)):
        rows[name] = {"peak_step_bytes": peak_of(torch_step(rc))}
    runs = {"single": soapstone_step("single"), "rc_single": soapstone_step("rc_single"),
            "torch": torch_step(False), "torch+checkpoint": torch_step(True)}
    for name, t in alternate(args.steps, **runs).items():
        rows[name]["step_s"] = t
    mib = 2 ** 20
    print(f"{'case':<18} {'peak MiB':>9} {'explain':>8} {'step ms':>8}")
    for name, r in rows.items():
        est = f"{r['explain_bytes'] / mib:>8.1f}" if "explain_bytes" in r else f"{'':>8}"
        print(f"{name:<18} {r['peak_step_bytes'] / mib:>9.1f} {est} {r['step_s'] * 1e3:>8.1f}")
    ratios = {
        "soapstone memory recompute/plain":
            rows["rc_single"]["peak_step_bytes"] / rows["single"]["peak_step_bytes"],
        "torch memory checkpoint/plain":
            rows["torch+checkpoint"]["peak_step_bytes"] / rows["torch"]["peak_step_bytes"],
        "soapstone time recompute/plain": rows["rc_single"]["step_s"] / rows["single"]["step_s"],
        "torch time checkpoint/plain":
            rows["torch+checkpoint"]["step_s"] / rows["torch"]["step_s"],
    }
    for k, v in ratios.items():
        print(f"{k:<34} {v:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"dims": DIMS, "rows": rows, "ratios": ratios},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
