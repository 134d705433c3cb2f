"""The rates a GPU profile's constants stand for, measured on the GPU in hand (CUDA only):
bf16 and float8 matmul TFLOP/s at transformer shapes, causal attention's TFLOP/s (SDPA,
forward and forward + backward) from 2K to 128K tokens, and HBM copy bandwidth. Each as a
fraction of the profile's peak, so profiles.json can carry measured figures instead of
guesses (its `measured` entries cite the report this writes). `--memory-bound`: the
memory-bound ops the cost model prices by bytes (memory_bound_rows), and the update.

    python bench/bench_gpu_rates.py --profile h100-80gb --out rates.json
    python bench/bench_gpu_rates.py --memory-bound --out memory_bound.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
import torch.nn.functional as F

from soapstone.shard.plan.analysis.hardware import load_profile

PEAK_BF16, PEAK_FP8 = 989e12, 1979e12  # H100 SXM dense peaks (FLOP/s): linear_row's fractions


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of one call of `fn` on the current CUDA stream (events around each)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def matmul_rows(peak: dict) -> list[dict]:
    """bf16 and (where the peak has one) float8 matmuls at Llama-3 8B and 70B widths, 8K tokens."""
    return [r for shape in ((8192, 4096, 4096), (8192, 4096, 14336), (8192, 8192, 28672),
                            (8192, 14336, 4096)) for r in matmul_row(*shape, peak)]


def matmul_row(m: int, k: int, n: int, peak: dict) -> list[dict]:
    """One (m x k) . (k x n) matmul in bf16 and, where the peak has one, float8."""
    flops = 2 * m * k * n
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    s = timed(partial(torch.matmul, a, b))
    rows = [{"kind": "matmul bf16", "shape": [m, k, n], "tflops": flops / s / 1e12,
             "of_peak": flops / s / 1e12 / peak["bf16"]}]
    if "fp8" in peak:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device="cuda")
        s = timed(partial(torch._scaled_mm, a8, b8, scale_a=one, scale_b=one,
                          out_dtype=torch.bfloat16))
        rows.append({"kind": "matmul float8", "shape": [m, k, n], "tflops": flops / s / 1e12,
                     "of_peak": flops / s / 1e12 / peak["fp8"]})
    return rows


LINEAR_SHAPES = ((8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 14336), (8192, 14336, 4096),
                 (8192, 8192, 28672), (8192, 28672, 8192), (8192, 4096, 128256))


def linear_row(m: int, k: int, n: int) -> dict:
    """One bias-free linear's three matmuls as torch runs them (weight stored out x in, m
    tokens, k in, n out): fwd x . W^T, dgrad g . W, wgrad g^T . x in bf16, as fractions of the
    bf16 peak; float8 forward (e4m3, tensorwise scales) with and without `use_fast_accum`, and
    dgrad (e5m2 x e4m3), as fractions of the fp8 peak (bench/data/gpu/h100_linear_rates.json)."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    x = torch.randn(m, k, device="cuda", dtype=bf16)
    w = torch.randn(n, k, device="cuda", dtype=bf16)
    g = torch.randn(m, n, device="cuda", dtype=bf16)
    x8, w8, g8 = x.to(e4m3), w.to(e4m3), g.to(torch.float8_e5m2)
    w8_cols = w8.t().contiguous().t()  # n x k, column-major: _scaled_mm's second operand
    one = torch.ones((), device="cuda")
    mm8 = partial(torch._scaled_mm, scale_a=one, scale_b=one, out_dtype=bf16)
    flops = 2 * m * k * n
    row: dict = {"shape": [m, k, n]}
    for name, fn, peak in (("fwd", partial(torch.matmul, x, w.t()), PEAK_BF16),
                           ("dgrad", partial(torch.matmul, g, w), PEAK_BF16),
                           ("wgrad", partial(torch.matmul, g.t(), x), PEAK_BF16),
                           ("f8fwd", partial(mm8, x8, w8.t()), PEAK_FP8),
                           ("f8fwd_fast", partial(mm8, x8, w8.t(), use_fast_accum=True),
                            PEAK_FP8),
                           ("f8dgrad", partial(mm8, g8, w8_cols), PEAK_FP8)):
        row[name] = round(flops / timed(fn) / peak, 4)
    return row


def attention_rows(peak: dict, heads: int = 32, head_dim: int = 128) -> list[dict]:
    """Causal SDPA at 2K..128K tokens per sequence, 128K tokens in all: forward and
    forward + backward TFLOP/s counted as the causal half of 4*s^2*d per head (x3.5 with the
    backward's five matmuls), and the kernel torch chose."""
    return [attention_row(seq, peak, heads, head_dim)
            for seq in (2048, 4096, 8192, 16384, 32768, 65536, 131072)]


def attention_row(seq: int, peak: dict, heads: int, head_dim: int) -> dict:
    """Causal SDPA at `seq` tokens a sequence (`attention_rows`)."""
    batch = max(1, 131072 // seq)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    fwd_flops = 4 * batch * heads * seq * seq * head_dim / 2
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True)
    s_f = timed(sdpa, reps=5)
    grad = torch.randn_like(q)

    def both():
        sdpa().backward(grad)

    s_b = timed(both, reps=5)
    return {"kind": "attention causal", "seq": seq, "batch": batch, "heads": heads,
            "head_dim": head_dim, "forward_tflops": fwd_flops / s_f / 1e12,
            "forward_backward_tflops": 3.5 * fwd_flops / s_b / 1e12,
            "of_peak": 3.5 * fwd_flops / s_b / 1e12 / peak["bf16"]}


def bandwidth_row(profile) -> dict:
    """A 2 GiB device-to-device copy: bytes read + written per second, against the profile."""
    src = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    s = timed(partial(dst.copy_, src))
    gbs = 2 * src.numel() * 2 / s / 1e9
    return {"kind": "hbm copy", "gbs": gbs, "of_profile": gbs * 1e9 / profile.memory_bandwidth}


# --memory-bound: each op the cost model prices by bytes (shard/plan/analysis/cost.py: its
# float inputs' and output's bytes forward, twice that backward, at memory_bandwidth), run as
# soapstone's eager kernels run it (shard/ops/), forward and backward, on Llama-3 8B's shapes
# at bf16: `gbs` is the cost model's bytes (3 x forward's) over the measured seconds
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, SEQ = 4096, 32, 8, 128, 14336, 32000, 8192
DEVICE = "cuda"
UPDATE_ELEMENTS = 2**30  # fp32 master elements of the update rows (4 GiB a buffer)


def rmsnorm_op(x, gamma, eps: float = 1e-6):
    """shard/ops/norms.py rmsnorm over the last dim, undistributed."""
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x * torch.rsqrt(ms + eps) * gamma


def rope_op(x, cos, sin):
    """shard/ops/positions/rope.py rope, its cos/sin tables made."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def repeat_dim_op(x, idx):
    """shard/ops/dims.py repeat_dim: grouped-query kv heads read per query head."""
    return x.index_select(2, idx)


def loss_op(logits, targets):
    """shard/ops/loss/cross_entropy.py on whole classes: the chunked PlainLoss, its gradient
    written over the logits (no step reads them again), over the token count."""
    from soapstone.shard.ops.loss.cross_entropy import CHUNK_ELEMENTS
    from soapstone.shard.ops.loss.loss_kernels import PlainLoss

    x = logits.reshape(-1, logits.shape[-1])
    rows = max(1, min(x.shape[0], CHUNK_ELEMENTS // x.shape[1]))
    return PlainLoss.apply(x, targets.reshape(-1), x.shape[1], rows, True) / x.shape[0]


def forward_backward(fn, inputs, grad):
    """`fn`'s forward and the gradients of the inputs that take one (none accumulated)."""
    out = fn(*inputs)
    return torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad)


def float_bytes(tensors) -> int:
    """The bytes the cost model counts for an op: its float inputs' and output's."""
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())


def op_row(kind: str, tokens: int, fn, inputs) -> dict:
    """One memory-bound op: forward, and forward + backward, timed; its rate as the cost
    model counts its bytes (forward: inputs + output; forward + backward: 3x that)."""
    out = fn(*inputs)
    model_bytes = float_bytes([*inputs, out])
    grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
    del out
    s_f = timed(partial(fn, *inputs), reps=7)
    s_b = timed(partial(forward_backward, fn, inputs, grad), reps=7)
    return {"kind": kind, "tokens": tokens, "model_bytes": model_bytes,
            "forward_ms": s_f * 1e3, "forward_backward_ms": s_b * 1e3,
            "forward_gbs": model_bytes / s_f / 1e9, "gbs": 3 * model_bytes / s_b / 1e9}


def act(*shape: int, grad: bool = True):
    """A bf16 activation on the GPU."""
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=grad)


def memory_bound_rows(tokens: int) -> list[dict]:
    """Every memory-bound op kind of examples/llama.par at Llama-3 8B's widths (bf16,
    `tokens` as tokens / 8192 sequences of 8192)."""
    b, s = tokens // SEQ, SEQ
    angles = torch.outer(torch.arange(s, dtype=torch.float32),
                         1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = torch.cat((angles, angles), -1).to(DEVICE)
    cos, sin = (t.to(torch.bfloat16).reshape(1, s, 1, HEAD_DIM)
                for t in (angles.cos(), angles.sin()))
    ids = torch.randint(0, VOCAB, (b, s), device=DEVICE)
    group = torch.arange(HEADS, device=DEVICE) // (HEADS // KV_HEADS)
    cases = [
        ("embedding", F.embedding, (ids, act(VOCAB, HIDDEN))),
        ("rmsnorm", rmsnorm_op, (act(b, s, HIDDEN), act(HIDDEN))),
        ("rope q", rope_op, (act(b, s, HEADS, HEAD_DIM), cos, sin)),
        ("rope k", rope_op, (act(b, s, KV_HEADS, HEAD_DIM), cos, sin)),
        ("repeat_dim", repeat_dim_op, (act(b, s, KV_HEADS, HEAD_DIM), group)),
        ("add", torch.add, (act(b, s, HIDDEN), act(b, s, HIDDEN))),
        ("silu", F.silu, (act(b, s, FFN),)),
        ("mul", torch.mul, (act(b, s, FFN), act(b, s, FFN))),
        ("cross_entropy", loss_op, (act(b, s, VOCAB), torch.randint(0, VOCAB, (b, s),
                                                                    device=DEVICE))),
    ]
    return [op_row(kind, tokens, fn, inputs) for kind, fn, inputs in cases]


def adamw_update(p, g, m, v, step):
    """shard/train/optim.py FlatAdamW.update's kernel on one flat fp32 slice."""
    torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


def update_rows(n: int = UPDATE_ELEMENTS) -> list[dict]:
    """The update over `n` fp32 master elements: fused AdamW (the cost model prices it as
    2 x (4 + 4 + 8) bytes an element: `model_gbs`), and what the step does around it that
    the cost model does not price: the bf16 gradient added into its fp32 bucket
    (data_parallel.Bucket.add_grad), the gradient norm, the masters copied to the bf16
    parameters. `gbs`: the bytes each kernel reads and writes."""
    p, g, m, v = (torch.rand(n, device=DEVICE) for _ in range(4))
    step = torch.ones((), device=DEVICE)
    g16, p16 = torch.randn(n, device=DEVICE, dtype=torch.bfloat16), torch.empty(
        n, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for kind, fn, moved in (("adamw", partial(adamw_update, p, g, m, v, step), 28 * n),
                            ("grad add bf16->fp32", partial(g.add_, g16), 10 * n),
                            ("grad copy bf16->fp32", partial(g.copy_, g16), 6 * n),
                            ("grad norm", partial(torch.linalg.vector_norm, g), 4 * n),
                            ("master copy fp32->bf16", partial(p16.copy_, p), 6 * n)):
        s = timed(fn, reps=5)
        rows.append({"kind": kind, "elements": n, "ms": s * 1e3, "bytes": moved,
                     "gbs": moved / s / 1e9})
    rows[0]["model_gbs"] = 32 * n / (rows[0]["ms"] / 1e3) / 1e9
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure, print one line per row, write --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-80gb")
    ap.add_argument("--out", default="gpu-rates.json")
    ap.add_argument("--linears", action="store_true",
                    help="only a linear's forward and backward matmuls (linear_row)")
    ap.add_argument("--memory-bound", action="store_true",
                    help="only the memory-bound ops and the update (memory_bound_rows)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_rates: no CUDA GPU here", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    peak = {k: v / 1e12 for k, v in profile.peak_flops.items()}  # TFLOP/s
    if args.memory_bound:  # in parts, each written as it ends
        parts = [lambda: [bandwidth_row(profile)], partial(memory_bound_rows, 8192),
                 partial(memory_bound_rows, 32768), update_rows]
    elif args.linears:
        parts = [lambda: [linear_row(*shape) for shape in LINEAR_SHAPES]]
    else:
        parts = [lambda: matmul_rows(peak) + attention_rows(peak) + [bandwidth_row(profile)]]
    rows: list[dict] = []
    for part in parts:
        for r in part():
            rows.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in r.items()}), flush=True)
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "profile": args.profile, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
