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

import torch

from soapstone.shard.plan.analysis.hardware import load_profile


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
    rows = []
    for m, k, n in ((8192, 4096, 4096), (8192, 4096, 14336), (8192, 8192, 28672),
                    (8192, 14336, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        s = timed(lambda: a @ b)
        rows.append({"kind": "matmul bf16", "shape": [m, k, n], "tflops": 2 * m * k * n / s / 1e12,
                     "of_peak": 2 * m * k * n / s / 1e12 / peak["bf16"]})
        if "fp8" in peak:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device="cuda")
            s = timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16))
            rows.append({"kind": "matmul float8", "shape": [m, k, n],
                         "tflops": 2 * m * k * n / s / 1e12,
                         "of_peak": 2 * m * k * n / s / 1e12 / peak["fp8"]})
    return rows


def linear_rows(peak: dict) -> list[dict]:
    """A bias-free linear's three matmuls as torch runs them (weight stored out x in): forward
    x . W^T, input gradient g . W, weight gradient g^T . x, bf16, at Llama-3 8B / 70B widths
    and 8K tokens; and float8 forward with and without `use_fast_accum` (torchao's forward
    setting)."""
    rows = []
    for m, k, n in ((8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 14336),
                    (8192, 14336, 4096), (8192, 8192, 28672), (8192, 28672, 8192)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * k * n
        for part, fn in (("forward", lambda: x @ w.t()), ("input grad", lambda: g @ w),
                         ("weight grad", lambda: g.t() @ x)):
            s = timed(fn)
            rows.append({"kind": f"linear bf16 {part}", "shape": [m, k, n],
                         "tflops": flops / s / 1e12, "of_peak": flops / s / 1e12 / peak["bf16"]})
        if "fp8" in peak:
            x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            for fast in (False, True):
                s = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16,
                                                   use_fast_accum=fast))
                rows.append({"kind": f"linear float8 forward{' fast_accum' if fast else ''}",
                             "shape": [m, k, n], "tflops": flops / s / 1e12,
                             "of_peak": flops / s / 1e12 / peak["fp8"]})
    return rows


def attention_rows(peak: dict, heads: int = 32, head_dim: int = 128) -> list[dict]:
    """Causal SDPA at 2K..128K tokens per sequence, 128K tokens in all: forward and
    forward + backward TFLOP/s counted as the causal half of 4*s^2*d per head (x3.5 with the
    backward's five matmuls), and the kernel torch chose."""
    rows = []
    for seq in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
        batch = max(1, 131072 // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        fwd_flops = 4 * batch * heads * seq * seq * head_dim / 2
        sdpa = torch.nn.functional.scaled_dot_product_attention
        s_f = timed(lambda: sdpa(q, k, v, is_causal=True), reps=5)
        grad = torch.randn_like(q)

        def both():
            sdpa(q, k, v, is_causal=True).backward(grad)

        s_b = timed(both, reps=5)
        rows.append({"kind": "attention causal", "seq": seq, "batch": batch, "heads": heads,
                     "head_dim": head_dim,
                     "forward_tflops": fwd_flops / s_f / 1e12,
                     "forward_backward_tflops": 3.5 * fwd_flops / s_b / 1e12,
                     "of_peak": 3.5 * fwd_flops / s_b / 1e12 / peak["bf16"]})
        del q, k, v, grad
    return rows


def bandwidth_row(profile) -> dict:
    """A 2 GiB device-to-device copy: bytes read + written per second, against the profile."""
    src = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * 2 / s / 1e9
    return {"kind": "hbm copy", "gbs": gbs, "of_profile": gbs * 1e9 / profile.memory_bandwidth}


def main(argv: list[str] | None = None) -> int:
    """Measure, print one line per row, write --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-80gb")
    ap.add_argument("--out", default="gpu-rates.json")
    ap.add_argument("--linears", action="store_true",
                    help="only a linear's forward and backward matmuls (linear_rows)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_rates: no CUDA GPU here", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    peak = {k: v / 1e12 for k, v in profile.peak_flops.items()}  # TFLOP/s
    rows = linear_rows(peak) if args.linears else \
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
