"""Collective matmul (`overlap tensor`, AsyncTP) against blocking sequence parallelism.

    mpiexec -n 2 .venv/bin/python bench/bench_asynctp.py [--iters 30] [--json out.json]
        [--precision float8]
    mpiexec -n 4 .venv/bin/python bench/bench_asynctp.py --zero 3

examples/llama.par scaled up (DIMS) under its `sp2` and `sp2async` layouts, same weights and
batch, in one job: forward + backward of one step (SGD reducer, no update), interleaved step
by step (comm/bench/harness.py), median and interquartile range; the losses are checked equal
to 1e-6. On CPU the ring's sends progress only inside MPI calls on the same core, so there is
little to overlap: the figure is what the ring's extra calls and per-chunk kernels cost.
`--precision float8`: bf16 activations and float8 weight matmuls, the rings float8
(shard/runtime/float8.py Float8GatherRing / Float8ScatterRing); the losses then equal exactly.
`--zero 3` (4 ranks): FSDP x AsyncTP, torchtitan's pair: bench/fsdp_asynctp.par's dp2sp2z3
against dp2sp2asyncz3, the parameters ZeRO-3 shards over data gathered bucket by bucket.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DIMS = {"batch": 4, "seq": 256, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1536,
        "vocab": 2048}


def main(argv: list[str] | None = None) -> int:
    """Time sp2 and sp2async side by side; print the table and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--precision", choices=("fp32", "float8"), default="fp32")
    parser.add_argument("--zero", type=int, choices=(0, 3), default=0)
    args = parser.parse_args(argv)

    import torch
    from mpi4py import MPI

    from soapstone import comm, dsl
    from soapstone.comm.bench.harness import interleave
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.runtime.sharded_model import ShardedModel
    from soapstone.shard.train.optim import build_optimizer

    torch.set_num_threads(1)  # two ranks on two cores
    world = comm.init("mpi")
    spec = dsl.load(ROOT / ("bench/fsdp_asynctp.par" if args.zero else "examples/llama.par"),
                    dims=DIMS)
    names = ("dp2sp2z3", "dp2sp2asyncz3") if args.zero else ("sp2", "sp2async")
    g = torch.Generator().manual_seed(0)
    shape = (DIMS["batch"], DIMS["seq"])
    batch = {"tokens": torch.randint(0, DIMS["vocab"], shape, generator=g),
             "targets": torch.randint(0, DIMS["vocab"], shape, generator=g)}
    steps, losses = {}, {}
    for name in names:
        par = spec.parallel(name)
        f8 = args.precision == "float8"
        model = ShardedModel(lower(spec.model(), par), comm.Mesh(world, **dict(par.mesh)),
                             seed=0, dtype=torch.bfloat16 if f8 else None, float8=f8)
        reducer = build_optimizer(model, "sgd", lr=0.0, zero=par.zero).reducer

        def step(model=model, reducer=reducer):
            reducer.zero_grad()
            out = model(batch, provider=reducer.provider)
            out["loss"].backward()
            reducer.finish()
            return out["loss"]

        steps[name] = step
        losses[name] = model.loss_value({"loss": step().detach()})
    exact = 0.0 if args.precision == "float8" else 1e-6  # float8's rings: bit for bit
    base, ring = names
    assert abs(losses[base] - losses[ring]) <= exact * abs(losses[base]), losses
    session = interleave(steps, args.iters, 2, comm=MPI.COMM_WORLD)
    if world.rank == 0:
        print(f"llama {DIMS} sequence parallel over {world.size} ranks (MPI on CPU), "
              f"{args.precision}, fwd+bwd step, {args.iters} steps each, interleaved; "
              f"loss {losses}")
        print(session.table())
        ratio = session.compare(ring, base)
        print(f"  {ratio.text()}")
        if args.json:
            Path(args.json).write_text(json.dumps({"dims": DIMS, "losses": losses,
                                                   "precision": args.precision,
                                                   "zero": args.zero,
                                                   "ratio": ratio.to_json()}
                                                  | session.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
