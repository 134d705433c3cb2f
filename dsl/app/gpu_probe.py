"""The in-process parts of `soapstone gpu-check` (dsl/app/gpu_check.py), on one GPU:

- `nccl_one_rank`: the NCCL communicator over cupy at world size 1: init, every collective in
  every reduction and four dtypes, blocking and async, `out=`, p2p to itself (soapstone refuses
  it with a CommError; NCCL's own communicator sends and receives to itself within one group),
  a split sub-communicator and a Mesh, and the CUDA events the flight recorder completes its
  entries by;
- `step_time`: a training step of examples/gpt.par at GPT-2 small's width and a realistic
  sequence beside the plain-torch nanoGPT-style loop of shard/train/reference_gpt.py on the
  same GPU, same shapes and batch, bf16 autocast and fused AdamW, interleaved
  (comm/bench/harness.py): step time, tokens/s, TFLOP/s and MFU of each, and which SDPA kernel
  each one's attention ran (read from the profiler's CUDA kernel names).
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs

# GPT-2 small's width at seq 1024; examples/gpt.par's blocks repeated 6 times (the spec's
# repeat count is text, so a copy is written): 120M parameters, untied head
GPT_DIMS = {"batch": 16, "seq": 1024, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": 50304}
GPT_BLOCKS = 6
# the attention kernels a CUDA profile can show, by a marker of their kernel names
SDPA_KERNELS = (("flash", "flash"), ("fmha", "memory-efficient"),
                ("efficient_attention", "memory-efficient"), ("cudnn", "cudnn"),
                ("sdpa", "cudnn"))


@attrs.frozen
class Outcome:
    """One named check: whether it passed and what it found."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0

    def to_json(self) -> dict:
        """The report's entry."""
        return {"name": self.name, "ok": self.ok, "detail": self.detail,
                "seconds": round(self.seconds, 2)}


def _equal(got, want, what: str) -> None:
    import torch

    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(f"{what}: got {got.flatten()[:6].tolist()}..., want "
                             f"{want.flatten()[:6].tolist()}...")


def nccl_one_rank(world) -> list[Outcome]:
    """The NCCL communicator `world` (one rank) through every call (module doc). Nothing in
    it is NCCL's own but the events: the tests run it over MPI on the CPU too."""
    import torch

    from soapstone.comm import Mesh

    dev = world.device
    out = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            detail = fn() or "ok"
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out.append(Outcome(f"nccl: {name}", True, detail, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - every failure is a finding of the report
            out.append(Outcome(f"nccl: {name}", False, f"{type(e).__name__}: {e}",
                               time.perf_counter() - t0))

    def collectives():
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            x = torch.arange(24, device=dev).reshape(4, 3, 2).to(dt)
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and not dt.is_floating_point:
                    continue
                for async_op in (False, True):
                    t = x.clone()
                    r = world.allreduce(t, op, async_op=async_op)
                    _equal(r.wait() if async_op else r, x, f"allreduce {op} {dt}")
            for async_op in (False, True):
                def got(r, a=async_op):
                    return r.wait() if a else r
                _equal(got(world.reduce_scatter(x, 0, async_op=async_op)), x,
                       f"reduce_scatter {dt}")
                _equal(got(world.allgather(x, 1, async_op=async_op)), x, f"allgather {dt}")
                o = torch.empty_like(x)
                _equal(got(world.allgather(x, 0, async_op=async_op, out=o)), x,
                       f"allgather out= {dt}")
                _equal(got(world.broadcast(x.clone(), 0, async_op=async_op)), x,
                       f"broadcast {dt}")
                _equal(got(world.alltoall(x, 0, 1, async_op=async_op)), x, f"alltoall {dt}")
                _equal(got(world.alltoallv(x, [4], [4], 0, async_op=async_op)), x,
                       f"alltoallv {dt}")
        return "allreduce (sum, avg, max, min), reduce_scatter, allgather (+ out=), " \
               "broadcast, alltoall, alltoallv; f32, bf16, f16, i64; blocking and async"

    def p2p_self():
        from soapstone.comm import CommError

        a = torch.randn(1000, device=dev)
        try:  # soapstone's rule, before any NCCL call: a clean error, never a hang
            world.isend(a, 0)
            raise AssertionError("isend to this rank itself was not refused")
        except CommError:
            pass
        if dev.type != "cuda":
            return "soapstone refuses p2p to this rank itself (CommError)"
        from cupy.cuda import nccl

        b = torch.zeros_like(a)
        raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)  # NCCL's own, world size 1
        stream = torch.cuda.current_stream().cuda_stream
        nccl.groupStart()
        raw.send(a.data_ptr(), a.numel(), nccl.NCCL_FLOAT32, 0, stream)
        raw.recv(b.data_ptr(), b.numel(), nccl.NCCL_FLOAT32, 0, stream)
        nccl.groupEnd()
        torch.cuda.synchronize()
        raw.destroy()
        _equal(b, a, "NCCL send to self + recv from self in one group")
        return "soapstone refuses p2p to this rank itself (CommError); NCCL's own send and " \
               "recv to self in one group move the data"

    def groups():
        sub = world.split(0, 0)
        try:
            t = torch.ones(8, device=dev)
            _equal(sub.allreduce(t.clone()), t, "split allreduce")
        finally:
            sub.free()
        with Mesh(world, data=1) as mesh:
            t = torch.arange(6.0, device=dev)
            _equal(mesh.comm("data").allgather(t, 0), t, "mesh allgather")
        return "split() and Mesh(data=1): a sub-communicator of its own, freed"

    def events():
        from soapstone.comm.observe.flight_recorder import DONE, STATE

        big = torch.ones(1 << 24, device=dev)  # 64 MiB: a kernel after it must wait for it
        work = world.allreduce(big, async_op=True)
        work.wait()  # the current stream waits for the side stream's event
        total = float(big.sum())
        if total != float(1 << 24):
            raise AssertionError(f"async allreduce then sum: {total}")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rec = world.flight
        deadline = time.monotonic() + 10
        while rec.pending and time.monotonic() < deadline:  # the watchdog polls the events
            time.sleep(0.05)
        left = [e for e in rec.entries() if e[STATE] != DONE] if rec.recording else []
        if rec.pending or left:
            raise AssertionError(f"{len(rec.pending)} flight-recorder entries still enqueued "
                                 "10 s after the GPU finished")
        return "async Work orders the current stream by an event; the watchdog completed " \
               "every flight-recorder entry from its CUDA event"

    check("collectives", collectives)
    check("p2p to self", p2p_self)
    check("groups", groups)
    check("events", events)
    return out


def gpt_spec(root: Path, into: Path) -> Path:
    """examples/gpt.par's model with its blocks repeated GPT_BLOCKS times (its parallel blocks
    left out: they name 4 blocks), written into `into`."""
    text = (root / "examples/gpt.par").read_text().split("\nparallel ")[0]
    marker = "repeat 4 as layer"
    if marker not in text:
        raise ValueError(f"{root / 'examples/gpt.par'}: no `{marker}` to scale")
    path = into / "gpt_gpu_check.par"
    path.write_text(text.replace(marker, f"repeat {GPT_BLOCKS} as layer"))
    return path


def attention_kernel(step, device) -> str:
    """Which SDPA kernel one call of `step` ran on the GPU (a profile's kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    kind = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[kind]) as prof:
        step()
    names = {e.key.lower() for e in prof.key_averages()}
    found = {label for marker, label in SDPA_KERNELS for n in names if marker in n}
    return ", ".join(sorted(found)) or "none of flash / memory-efficient / cudnn (math?)"


def step_time(root: Path, tmp: Path, steps: int, peak, device=None, dims=None) -> dict:
    """soapstone vs the plain-torch loop on this GPU (module doc; `device` and `dims` other
    than the GPU's and GPT_DIMS: the tests, on the CPU); the figures as JSON."""
    import torch

    from soapstone import dsl
    from soapstone.comm.bench.harness import interleave
    from soapstone.dsl.app.throughput import step_flops
    from soapstone.dsl.compile.lower import lower
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.runtime.executor import Executor
    from soapstone.shard.train.reference_gpt import GPT, load_from_soapstone

    dev = device or torch.device("cuda", torch.cuda.current_device())
    d = dims or GPT_DIMS
    model = dsl.load(gpt_spec(root, tmp), dims=d).model()
    graph = lower_graph(model, None)
    ours = Executor(graph, None, seed=0, compute_dtype=torch.bfloat16, device=dev)
    ours.use_optimizer(name="adamw", lr=1e-4)
    ref = GPT(d["vocab"], d["hidden"], d["heads"], d["ffn"], GPT_BLOCKS)
    load_from_soapstone(ref, ours.full_state_dict())
    ref = ref.to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    g = torch.Generator().manual_seed(0)
    shape = (d["batch"], d["seq"])
    batch = {"tokens": torch.randint(0, d["vocab"], shape, generator=g).to(dev),
             "targets": torch.randint(0, d["vocab"], shape, generator=g).to(dev)}

    def step_ours():
        return ours.train_step(batch)

    def step_ref():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = ref(batch["tokens"], batch["targets"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    names = {"soapstone": step_ours, "plain torch (nanoGPT-style)": step_ref}
    first = {n: fn() for n, fn in names.items()}  # the same weights: the same first loss
    kernels = {n: attention_kernel(fn, dev) for n, fn in names.items()}
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    session = interleave(names, steps, warmup=3, sync=sync)
    flops = step_flops(lower(model, None))
    tokens = d["batch"] * d["seq"]
    rows = {}
    for n, t in session.timings.items():
        rate = flops / t.median
        rows[n] = t.to_json() | {
            "tokens_per_s": tokens / t.median, "tflops": rate / 1e12,
            "mfu": rate / peak.flops if peak else None, "first_loss": first[n],
            "sdpa_kernel": kernels[n]}
    params = sum(p.numel() for p in ref.parameters())
    ratio = session.compare("soapstone", "plain torch (nanoGPT-style)")
    return {"model": f"examples/gpt.par x{GPT_BLOCKS} blocks, {params / 1e6:.1f}M params",
            "dims": d, "precision": "bf16 (autocast / compute dtype) over fp32 masters",
            "optimizer": "AdamW, fused", "model_flops_per_step": flops,
            "peak_flops": peak.flops if peak else None,
            "peak_source": peak.source if peak else None,
            "rows": rows, "ratio": ratio.to_json(), "table": session.table()}
