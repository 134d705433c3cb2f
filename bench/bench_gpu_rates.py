"""The rates a GPU profile's constants stand for, measured on the GPU in hand (CUDA only):
bf16 and float8 matmul TFLOP/s at transformer shapes, causal attention's TFLOP/s (SDPA,
forward and forward + backward) from 2K to 128K tokens, and HBM copy bandwidth. Each as a
fraction of the profile's peak, so profiles.json can carry measured figures instead of
guesses (its `measured` entries cite the report this writes).

    python bench/bench_gpu_rates.py --profile h100-80gb --out rates.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

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


def main(argv: list[str] | None = None) -> int:
    """Measure, print one line per row, write --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-80gb")
    ap.add_argument("--out", default="gpu-rates.json")
    ap.add_argument("--linears", action="store_true",
                    help="only a linear's forward and backward matmuls (linear_row)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_rates: no CUDA GPU here", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    peak = {k: v / 1e12 for k, v in profile.peak_flops.items()}  # TFLOP/s
    rows = [linear_row(*shape) for shape in LINEAR_SHAPES] if args.linears else \
        matmul_rows(peak) + attention_rows(peak) + [bandwidth_row(profile)]
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "profile": args.profile, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
