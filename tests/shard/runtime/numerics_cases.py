"""Golden numerics: every layout computes what the single-rank run computes.

Run on every rank by tests/support/mpirun.py (see tests/shard/runtime/test_numerics.py). For each
(model, layout): the sharded parameters are exactly the slices of the single-rank ones; in fp32 the
loss of each of 3 AdamW steps and every gathered gradient match the single-rank run with rtol 1e-5.

The parameters after the 3 AdamW steps are compared at rtol 1e-5 in float64. In fp32 they agree
only to about 1e-4 of an update: Adam divides each gradient by its own magnitude, so an element
whose gradient is near zero turns a rounding difference of the summation order (1e-7 of the
tensor's scale) into a visible change of its update. That is arithmetic, not sharding: the
same layouts agree to 1e-12 in float64. fp32 final params are still checked, to 1% of one
update (lr).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mpirun import ranks

from soapstone import dsl
from soapstone.comm import Mesh, init
from soapstone.dsl.compile.lower import lower
from soapstone.shard.data.tasks import random_inputs
from soapstone.shard.runtime.sharded_model import ShardedModel
from soapstone.shard.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[3]
W = init("mpi")
SEED, STEPS, RTOL, LR = 7, 3, 1e-5, 1e-3

dsl.custom.load_plugin(str(ROOT / "examples/custom_layer.py"))
CUSTOM = {"swiglu": dsl.custom.get("swiglu").fn}
SPECS = {name: dsl.load(ROOT / f"tests/specs/{name}_layouts.par") for name in
         ("gpt", "mlp", "llama", "ops", "branch", "window", "head_dim")}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """rtol 1e-5, with an absolute floor of 1e-5 of the tensor's scale for near-zero entries."""
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=RTOL, atol=RTOL * scale + 1e-12), \
        f"{what}: max abs diff {float((got - want).abs().max()):.3e} (scale {scale:.3e})"


def golden(spec: str, layout: str, dims: dict | None = None) -> None:
    s = dsl.load(ROOT / f"tests/specs/{spec}_layouts.par", dims=dims) if dims else SPECS[spec]
    par = s.parallel(layout)
    model = s.model(par.model)
    assert par.world_size == W.size, f"{layout} needs {par.world_size} ranks, not {W.size} (@ranks)"
    mesh = Mesh(W, **dict(par.mesh))
    train_and_compare(model, par, mesh, torch.float32, final_atol=1e-2 * LR)
    train_and_compare(model, par, mesh, torch.float64, final_atol=None)


def train_and_compare(model, par, mesh, dtype, final_atol) -> None:
    ref = ShardedModel(lower(model, None), None, seed=SEED, custom=CUSTOM, dtype=dtype)
    sharded = ShardedModel(lower(model, par), mesh, seed=SEED, custom=CUSTOM, dtype=dtype)
    for name, full in sharded.full_state_dict().items():
        assert torch.equal(full, ref.params[name].detach()), f"init of {name} differs"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)  # the kernel ours runs
    # the one gradient path: buckets summed over the axes the Program says (ZeRO 0 keeps the
    # reduced gradients in .grad after finish()); AdamW is torch's fused kernel
    opt = build_optimizer(sharded, "adamw", lr=LR, weight_decay=0.01, zero=0)  # torch's default
    for step in range(STEPS):
        batch = random_inputs(ref.program, step)
        want = ref(batch)["loss"]
        want.backward()
        out = sharded(batch)
        out["loss"].backward()
        opt.reducer.finish()
        got = sharded.loss_value(out)
        assert abs(got - float(want)) <= RTOL * abs(float(want)), \
            f"step {step}: loss {got!r} vs single-rank {float(want)!r} ({dtype})"
        if step == 0:
            for name, p in sharded.params.items():
                close(sharded.gather(p.grad, sharded.program.value(name)),
                      ref.params[name].grad, f"gradient of {name} ({dtype})")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for name, full in sharded.full_state_dict().items():
        what = f"{name} after {STEPS} AdamW steps ({dtype})"
        if final_atol is None:
            close(full, ref.params[name].detach(), what)
        else:
            diff = float((full - ref.params[name].detach()).abs().max())
            assert diff <= final_atol, f"{what}: max abs diff {diff:.3e} > {final_atol:.1e}"


@ranks(2)
def case_gpt_dp2():
    golden("gpt", "dp2")


@ranks(2)
def case_gpt_tp2():
    golden("gpt", "tp2")


@ranks(2)
def case_gpt_sp2():
    golden("gpt", "sp2")


@ranks(2)
def case_gpt_sp2_float8_gathers_float8():
    """--precision float8 under sp2: the linears' inputs gathered as e4m3 at the allreduced
    amax (shard/runtime/float8.py Float8Gather) equal gathering bf16 then casting, bit for
    bit (loss, every gradient, backward's regathers included), for half the gathered bytes."""
    s = dsl.load(ROOT / "examples/gpt.par")
    par = s.parallel("sp2")
    mesh = Mesh(W, **dict(par.mesh))
    comm = mesh.comm("model")
    runs = []
    for fp8_gather in (False, True):
        m = ShardedModel(lower(s.model(), par), mesh, seed=SEED, dtype=torch.bfloat16,
                         float8=True)
        gathers = m.float8_gathered
        m.float8_gathered = gathers if fp8_gather else set()
        before = {k: (v.calls, v.bytes) for k, v in comm.stats.items()}
        out = m(random_inputs(m.program, 0))
        out["loss"].backward()
        moved = {k: (v.calls - before.get(k, (0, 0))[0], v.bytes - before.get(k, (0, 0))[1])
                 for k, v in comm.stats.items()}
        runs.append((m.loss_value(out), {n: p.grad for n, p in m.params.items()}, moved))
    (loss0, grads0, moved0), (loss1, grads1, moved1) = runs
    assert loss0 == loss1
    for n, g in grads0.items():
        assert torch.equal(g, grads1[n]), f"gradient of {n} differs"
    # 4 blocks x (attention's and the mlp's input) and the output projection's, gathered in
    # forward and again in backward, each a [batch 8, seq 16, hidden 32] slab: bf16 moves 2
    # bytes an element, e4m3 1 (ring on 2 ranks: half of it leaves this rank); plus one amax
    # allreduced per gather
    assert len(gathers) == 4 * 2 + 1
    slab = 8 * 16 * 32 // 2
    assert moved0["allgather"][1] - moved1["allgather"][1] == 2 * len(gathers) * slab, \
        (moved0, moved1)
    assert moved1["allreduce"][0] - moved0["allreduce"][0] == 2 * len(gathers)


@ranks(2)
def case_float8_rings_equal_float8_gathers_bit_for_bit():
    """--precision float8 with `overlap tensor` (shard/runtime/float8.py Float8GatherRing,
    Float8ScatterRing: chunks cast at the blocking step's scales, e4m3 / e5m2 bytes around
    the ring, one weight-gradient product over the whole float8 operands) is the float8 sp2
    step without rings, bit for bit: loss and every gradient, gpt and llama (widths of 16:
    hidden 64), and under `recompute layer` (the rings run again in backward's rerun)."""
    llama = {"hidden": 64}
    for path, dims, plain, rings in (
            ("examples/gpt.par", None, "sp2", "sp2async"),
            ("examples/llama.par", llama, "sp2", "sp2async"),
            ("tests/specs/sp_residual.par", llama, "sp2_rc", "sp2async_rc")):
        s = dsl.load(ROOT / path, dims=dims)
        runs = []
        for layout in (plain, rings):
            par = s.parallel(layout)
            m = ShardedModel(lower(s.model(par.model), par), Mesh(W, **dict(par.mesh)),
                             seed=SEED, dtype=torch.bfloat16, float8=True)
            assert bool(m.float8_rings) == (layout == rings), (path, layout)
            out = m(random_inputs(m.program, 0))
            out["loss"].backward()
            runs.append((m.loss_value(out), {n: p.grad for n, p in m.params.items()}))
        (loss0, grads0), (loss1, grads1) = runs
        assert loss0 == loss1, (path, loss0, loss1)
        for n, g in grads0.items():
            assert torch.equal(g, grads1[n]), f"{path} {rings}: gradient of {n} differs"


@ranks(2)
def case_gpt_cp2():
    golden("gpt", "cp2")


@ranks(2)
def case_gpt_cp2b():
    golden("gpt", "cp2b")  # load-balanced: zigzag chunks, key prefixes only


@ranks(2)
def case_causal_context_parallel_work():
    """The (query, key) pairs the attention kernel computes per rank, per head, forward, at seq
    64: cp2 gives rank 0 queries 0..31 against keys 0..31 (1024) and rank 1 32..63 against all
    64 (2048); cp2b's chunks of 16 give rank 0 16 x 16 + 16 x 64 and rank 1 16 x 32 + 16 x 48,
    1280 each: 5/8 of the 32 x 64 a dense mask computes."""
    from torch.utils._python_dispatch import TorchDispatchMode  # its only home in torch

    class Pairs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.pairs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                self.pairs += args[0].shape[-2] * args[1].shape[-2]
            return func(*args, **(kwargs or {}))

    s = dsl.load(ROOT / "tests/specs/gpt_layouts.par", dims={"seq": 64})
    want = {"cp2": (1024, 2048), "cp2b": (1280, 1280)}
    for layout, pairs in want.items():
        par = s.parallel(layout)
        m = ShardedModel(lower(s.model(), par), Mesh(W, **dict(par.mesh)), seed=SEED)
        with Pairs() as seen:
            m(random_inputs(m.program, 0))
        layers = 4
        assert seen.pairs == layers * pairs[W.rank], (layout, W.rank, seen.pairs)


@ranks(4)
def case_gpt_tp4():
    golden("gpt", "tp4")


@ranks(4)
def case_gpt_dp2tp2():
    golden("gpt", "dp2tp2")


@ranks(4)
def case_gpt_cp2tp2():
    golden("gpt", "cp2tp2")


@ranks(4)
def case_gpt_cp2tp2b():
    golden("gpt", "cp2tp2b")


@ranks(4)
def case_gpt_ulysses4b():
    golden("gpt", "ulysses4b", dims={"seq": 128})


@ranks(4)
def case_gpt_dp2sp2():
    golden("gpt", "dp2sp2")


@ranks(4)
def case_gpt_ulysses4():
    # long enough sequences that the compiler picks all-to-alls (checked in test_compile.py)
    golden("gpt", "ulysses4", dims={"seq": 128})


# sliding-window attention: the mask by global positions, the window across a split seq
@ranks(2)
def case_window_tp2():
    golden("window", "tp2")


@ranks(2)
def case_window_sp2():
    golden("window", "sp2")


@ranks(2)
def case_window_cp2():
    golden("window", "cp2")


@ranks(2)
def case_window_cp2b():
    golden("window", "cp2b")


# heads x head_dim (4 x 16) wider than hidden (32): the heads split, each head whole
@ranks(2)
def case_head_dim_tp2():
    golden("head_dim", "tp2")


@ranks(2)
def case_head_dim_sp2():
    golden("head_dim", "sp2")


@ranks(2)
def case_head_dim_cp2():
    golden("head_dim", "cp2")


@ranks(2)
def case_mlp_dp2():
    golden("mlp", "dp2")


@ranks(2)
def case_mlp_tp2():
    golden("mlp", "tp2")


@ranks(2)
def case_mlp_rowfirst():
    golden("mlp", "rowfirst")


@ranks(4)
def case_mlp_tp4():
    golden("mlp", "tp4")


@ranks(4)
def case_mlp_dp2tp2():
    golden("mlp", "dp2tp2")


@ranks(2)
def case_llama_tp2():
    golden("llama", "tp2")


@ranks(2)
def case_llama_dp2():
    golden("llama", "dp2")


@ranks(2)
def case_llama_sp2():
    golden("llama", "sp2")


@ranks(2)
def case_llama_cp2():
    golden("llama", "cp2")


@ranks(2)
def case_llama_cp2b():
    golden("llama", "cp2b")


@ranks(4)
def case_llama_tp4():
    golden("llama", "tp4")


@ranks(4)
def case_llama_dp2tp2():
    golden("llama", "dp2tp2")


@ranks(2)
def case_ops_hid2():
    golden("ops", "hid2")


@ranks(2)
def case_ops_cls2():
    golden("ops", "cls2")


@ranks(4)
def case_ops_dp2hid2():
    golden("ops", "dp2hid2")


@ranks(2)
def case_branch_br2():
    golden("branch", "br2")


@ranks(4)
def case_branch_dp2br2():
    golden("branch", "dp2br2")


@ranks(4)
def case_branch_br2tp2():
    golden("branch", "br2tp2")


@ranks(2)
def case_branch_gated_br2():
    golden("branch", "gated_br2")


@ranks(2)
def case_branch_ops_run_only_on_their_owner():
    """Off its owner a branch op does no work: a torch profiler sees no matmul for it."""
    s = SPECS["branch"]
    program = lower(s.model("towers"), s.parallel("br2"))
    m = ShardedModel(program, Mesh(W, branch=2), seed=0)
    from torch.profiler import profile

    with profile() as prof:
        m(random_inputs(program, 0))
    # 2 matmuls per tower, on its owner only, plus the input layer and the head everywhere
    mms = sum(e.count for e in prof.key_averages()
              if e.key in ("aten::bmm", "aten::mm", "aten::addmm"))
    assert mms == 2 + 2, f"rank {W.rank} ran {mms} matmuls"


@ranks(2, 4)
def case_full_state_dict_round_trip():
    """A plain (unsharded) state dict loads into any layout and comes back unchanged."""
    s = SPECS["gpt"]
    for name in ("tp2", "sp2", "cp2", "dp2") if W.size == 2 else ("tp4", "dp2tp2"):
        par = s.parallel(name)
        program = lower(s.model(), par)
        g = torch.Generator().manual_seed(5)
        plain = {p.name: torch.randn(p.shape, generator=g) for p in program.params}
        m = ShardedModel(program, Mesh(W, **dict(par.mesh)), seed=0)
        m.load_full_state_dict(plain)
        back = m.full_state_dict()
        for k, v in plain.items():
            assert torch.equal(back[k], v), f"{name}: {k} changed in the round trip"
