"""Loading a Hugging Face GPT-2 (small geometry) into soapstone layouts vs transformers'
`from_pretrained`: each rank's peak memory above its baseline against the bytes of its own
shard, and the load time.

The checkpoint is a random-init GPT2LMHeadModel of GPT-2 small's geometry (12 layers, hidden
768, 12 heads, ffn 3072, 1024 positions, vocab 50257), saved once with save_pretrained (fp32,
498 MB) under --dir. soapstone's model pads the vocab to 50304 (`cross_entropy(...,
classes = 50257)`, Megatron's padding: tp splits the vocab, and 50257 divides by no split),
reading the padded rows as zeros.

soapstone, under `mpiexec -n N` (N = 1, 2, 4; layout tp1 = one rank, else tpN: heads, ffn and
vocab split): each rank compiles the model, resets its peak-RSS mark (/proc/self/clear_refs),
takes its resident memory as the baseline, then builds the executor with empty weights and
fills them from the directory (`hf.load_init`: headers checked, each rank reading only its
slices with safetensors get_slice). Reported per rank: the peak resident memory above the
baseline (VmHWM - baseline), the bytes of its parameter shard, their ratio, and the wall time
of the build + load. transformers: `from_pretrained(DIR)` in a fresh process, one rank, timed
the same way (its peak above baseline too, for reference). Each figure is the best of
--repeat fresh runs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_hf_load.py [--repeat 3] [--dir /tmp/gpt2-small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PADDED = 50304  # 50257 rounded up to a multiple of 128
GEOMETRY = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_head": 12,
            "n_layer": 12, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident mark (VmHWM) restarts from the current RSS


def make_checkpoint(directory: Path) -> None:
    """The random-init GPT-2 small geometry, saved once."""
    if (directory / "model.safetensors").exists():
        return
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GEOMETRY)).save_pretrained(directory)


def soapstone_rank(directory: str) -> None:
    """One rank: compile, baseline, empty executor + load_init; print a JSON line."""
    import torch

    from soapstone.comm import Mesh, init
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.dsl.interop import hf, hf_config
    from soapstone.dsl.lang.spec import load
    from soapstone.shard.runtime.executor import Executor

    torch.set_num_threads(1)
    world = init("mpi")
    n = world.size
    cfg = hf_config.read_config(directory)
    text = hf.spec_text(cfg, "gpt2", batch=1, seq=16, vocab=PADDED)
    if n > 1:
        text += (f"parallel tp{n} for gpt2 on mesh(model = {n}) {{\n"
                 "  parameter heads, ffn, vocab -> model\n}\n")
    spec = load(text, filename="<gpt2-small>")
    par = spec.parallel(f"tp{n}") if n > 1 else None
    graph = lower_graph(spec.model("gpt2"), par)
    mesh = Mesh(world, **dict(par.mesh)) if par is not None else None
    shard = sum(4 * _numel(p.local_shape) for s in graph.stages for p in s.program.params)
    world.barrier()  # every rank compiled: the load starts together
    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    ex = Executor(graph, mesh, draw=False)
    hf.load_init(ex, directory)
    wall = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    _report({"who": f"soapstone tp{n}", "rank": world.rank, "shard": shard, "peak": peak,
             "wall": wall})


def _report(row: dict) -> None:
    """One rank's figures, as a file of its own (mpiexec may interleave the ranks' stdout)."""
    out = Path(os.environ["BENCH_HF_OUT"]) / f"{row['who'].replace(' ', '-')}-{row['rank']}.json"
    out.write_text(json.dumps(row))


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def transformers_one(directory: str) -> None:
    """from_pretrained on one rank, timed and measured like a soapstone rank."""
    import torch
    import transformers

    torch.set_num_threads(1)
    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    model = transformers.GPT2LMHeadModel.from_pretrained(directory)
    wall = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    _report({"who": "transformers", "rank": 0, "shard": shard, "peak": peak, "wall": wall})
    # its weights may still be file pages not yet read: touch every one, as a step would
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    _report({"who": "transformers touched", "rank": 0, "shard": shard,
             "peak": _status("VmHWM") - base, "wall": time.perf_counter() - t0})


def _run(cmd: list[str]) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "BENCH_HF_OUT": out}
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1800)
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
        return [json.loads(f.read_text()) for f in sorted(Path(out).glob("*.json"))]


def main() -> None:
    """Every configuration --repeat times in fresh processes; the table of best figures."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/soapstone-gpt2-small-50257")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--child", choices=["soapstone", "transformers"])
    args = ap.parse_args()
    if args.child == "soapstone":
        return soapstone_rank(args.dir)
    if args.child == "transformers":
        return transformers_one(args.dir)
    make_checkpoint(Path(args.dir))
    me = [sys.executable, __file__, "--dir", args.dir, "--child"]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    best: dict[tuple[str, int], dict] = {}
    for _ in range(args.repeat):
        rows = _run([*me, "transformers"])
        for n in args.ranks:
            rows += _run([mpiexec, "-n", str(n), *me, "soapstone"])
        for r in rows:
            key = (r["who"], r["rank"])
            if key not in best or r["wall"] < best[key]["wall"]:
                best[key] = {**r, "peak": min(r["peak"], best.get(key, r)["peak"])}
            else:
                best[key]["peak"] = min(best[key]["peak"], r["peak"])
    ref = best[("transformers", 0)]["wall"]
    print("| loader | rank | shard MB | peak above baseline MB | peak / shard | load s | "
          "time / from_pretrained |")
    print("|---|---|---|---|---|---|---|")
    for (who, rank), r in sorted(best.items(), key=lambda kv: (kv[0][0] != "transformers",
                                                               kv[0])):
        print(f"| {who} | {rank} | {r['shard'] / 1e6:.0f} | {r['peak'] / 1e6:.0f} | "
              f"{r['peak'] / r['shard']:.2f} | {r['wall']:.2f} | {r['wall'] / ref:.2f} |")


if __name__ == "__main__":
    main()
