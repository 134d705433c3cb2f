"""Tensor parallel at 2 ranks: soapstone vs PyTorch DTensor (Colwise/RowwiseParallel on gloo).

    mpiexec -n 2 .venv/bin/python bench/bench_tp.py [--iters 30] [--json out.json]
            [--device cpu|cuda]

Both run examples/gpt.par scaled up (hidden 512, 8 heads, ffn 2048, vocab 2048, seq 128,
batch 8, 4 layers) with the same weights and batch, in one job, alternating. soapstone uses
the spec's `tp2` layout (heads, ffn and vocab split; vocab-parallel loss). DTensor uses the
torchtitan-style plan: q/k/v and the MLP's up projection column-parallel, the attention output
and down projection row-parallel, the embedding row-parallel over vocab, the head
column-parallel with `loss_parallel` so neither side gathers the logits. Timed: forward +
backward of one step, median and interquartile range of the steps after warm-up, the two
interleaved step by step (comm/bench/harness.py). The losses are checked equal.
--device cuda: both on NCCL with the model and batch on each rank's GPU (bench_dp.start), each
step timed between torch.cuda.synchronize() calls. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DIMS = {"batch": 8, "seq": 128, "hidden": 512, "heads": 8, "ffn": 2048, "vocab": 2048}


def dtensor_model(ref_params, world, device=None):
    """The plain-torch GPT, loaded with soapstone's weights, on `device` (default cpu),
    parallelised with DTensor."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    model = GPT(DIMS["vocab"], DIMS["hidden"], DIMS["heads"], DIMS["ffn"], layers=4)
    load_from_soapstone(model, ref_params)
    device = torch.device("cpu" if device is None else device)
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    for blk in model.blocks:
        parallelize_module(blk, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                       "v": ColwiseParallel(), "o": RowwiseParallel(),
                                       "up": ColwiseParallel(), "down": RowwiseParallel()})
        blk.heads //= world  # each rank now holds heads / world of them
    parallelize_module(model, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    return model, torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30,
                        help="timed steps after the warm-up (default and least 30)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (MPI vs gloo) or cuda (a GPU per rank, NCCL on both sides)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from bench_dp import start
    from torch.distributed.tensor.parallel import loss_parallel

    from soapstone import comm, dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.runtime.sharded_model import ShardedModel
    from soapstone.shard.train.optim import build_optimizer

    torch.set_num_threads(1)  # two ranks on two cores
    bench = start(args.device)
    world, device = bench.world, bench.device
    spec = dsl.load(ROOT / "examples/gpt.par", dims=DIMS)
    par = spec.parallel("tp2")
    ours = ShardedModel(lower(spec.model(), par), comm.Mesh(world, **dict(par.mesh)), seed=0,
                        device=device)
    # the runtime's one gradient path (buckets summed over the axes the Program names);
    # no update is timed, as for DTensor
    reducer = build_optimizer(ours, "sgd", lr=0.0).reducer
    full = ours.full_state_dict()
    theirs, _ = dtensor_model(full, world.size, device)

    g = torch.Generator().manual_seed(0)
    shape = (DIMS["batch"], DIMS["seq"])
    batch = {"tokens": torch.randint(0, DIMS["vocab"], shape, generator=g).to(device),
             "targets": torch.randint(0, DIMS["vocab"], shape, generator=g).to(device)}

    def step_soapstone():
        reducer.zero_grad()
        out = ours(batch)
        out["loss"].backward()
        reducer.finish()
        return out["loss"]

    def step_dtensor():
        theirs.zero_grad(set_to_none=True)
        logits = theirs.head(theirs.norm(_blocks(theirs, theirs.emb(batch["tokens"]))))
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
            loss.backward()
        return loss

    losses = {"soapstone": ours.loss_value({"loss": step_soapstone().detach()}),
              "dtensor": float(step_dtensor().detach().full_tensor())}
    from mpi4py import MPI

    from soapstone.comm.bench.harness import interleave

    session = interleave({"soapstone": step_soapstone, "dtensor": step_dtensor}, args.iters,
                         args.warmup, comm=MPI.COMM_WORLD, sync=bench.sync)
    if world.rank == 0:
        on = f"NCCL on {bench.label}" if device.type == "cuda" else "gloo / MPI on CPU"
        print(f"gpt {DIMS} tensor parallel over {world.size} ranks ({on}), fwd+bwd step, "
              f"{args.iters} steps each, interleaved")
        print(f"loss at init: soapstone {losses['soapstone']:.6f}  dtensor {losses['dtensor']:.6f}")
        print(session.table())
        ratio = session.compare("soapstone", "dtensor")
        print(f"  {ratio.text()}")
        if args.json:
            Path(args.json).write_text(json.dumps({"dims": DIMS, "ranks": world.size,
                                                   "device": bench.label, "losses": losses,
                                                   "ratio": ratio.to_json()}
                                                  | session.to_json()))
    return 0


def _blocks(model, x):
    for blk in model.blocks:
        x = blk(x)
    return x


if __name__ == "__main__":
    sys.exit(main())
