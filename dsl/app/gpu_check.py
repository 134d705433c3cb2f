"""`soapstone gpu-check`: what one GPU can prove about the CUDA path, in one command (about
four minutes on an H100), written to a JSON report (README, "On a GPU: make gpu-check").

In order, each a check of the report (name, ok, detail, seconds):
1. the CUDA tests of the suite, which skip on a machine without CUDA: tests/comm/test_gpu.py,
   tests/comm/backends/test_comm_nccl.py, tests/comm/test_device.py (pytest, in a child process);
2. `golden check` of every example with a record in tests/golden/runs, on cuda, one rank; then
   of tp2, pp2, dp2 ZeRO-3, a MoE layout, balanced CP and AsyncTP's rings with two ranks
   sharing the GPU (`--comm mpi`);
3. training: `run examples/gpt.par --device cuda` in bf16, in float8 (torch._scaled_mm) and in
   float8 under sp2 and sp2async on two ranks (e4m3 gathers, float8 rings); the loss falls,
   and the progress figures (tokens/s, TFLOP/s, MFU) come out;
4. the NCCL communicator over cupy at one rank (dsl/app/gpu_probe.py): every collective,
   p2p to itself, groups, events;
5. the step time, tokens/s and MFU of examples/gpt.par at GPT-2 small's width and seq 1024
   beside a plain-torch nanoGPT-style loop, side by side, and which SDPA kernel each ran.
The tests and the examples come from the checkout (`--root`, default the current directory);
soapstone itself from wherever it is installed (`make gpu-check` installs the wheels of `make
gpu-wheels` into a venv over the GPU image's torch). Exit 0: every check passed; 1: one failed
(the report says which); 2: no CUDA GPU here (one line), or no checkout at --root.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from soapstone.dsl.app.gpu_probe import Outcome
from soapstone.dsl.lang.errors import BadInput

CUDA_TESTS = ("tests/comm/test_gpu.py", "tests/comm/backends/test_comm_nccl.py",
              "tests/comm/test_device.py")
PLUGINS = {"swiglu": ("--plugin", "examples/custom_layer.py")}  # examples that need one
# two ranks on the one GPU (`--comm mpi`): tensor parallel, pipeline's grouped p2p, ZeRO-3,
# experts, load-balanced context parallel's per-chunk attention, AsyncTP's rings of async p2p
SHARED_LAYOUTS = (("gpt2", "tp2"), ("gpt2", "pp2"), ("gpt2", "dp2"), ("moe", "ep2"),
                  ("gpt", "cp2b"), ("gpt", "sp2async"))
# training runs on cuda (precision, layout, ranks): bf16; float8's `_scaled_mm`; float8 under
# sp2, whose gathers move e4m3 bytes cast at the allreduced amax; and AsyncTP's float8 rings
TRAINING = (("bf16", "single", 1), ("float8", "single", 1), ("float8", "sp2", 2),
            ("float8", "sp2async", 2))


def cuda_missing() -> str | None:
    """The one line gpu-check ends with (exit 2) on a machine without a usable CUDA GPU; None
    when torch sees one."""
    import torch

    if torch.cuda.is_available():
        return None
    why = ("built without CUDA" if torch.version.cuda is None
           else f"built with CUDA {torch.version.cuda} but sees no GPU")
    return (f"soapstone gpu-check: no CUDA GPU here (torch {torch.__version__} is {why}); run "
            "it on a machine with one: `make gpu-check` (README, 'On a GPU')")


def check_root(root: Path) -> None:
    """BadInput unless `root` is a soapstone checkout (its examples and tests)."""
    need = [root / "examples/gpt.par", root / "tests/golden/runs", *(root / t for t in CUDA_TESTS)]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise BadInput(f"--root {root}: not a soapstone checkout ({', '.join(missing)} missing);"
                       " run gpu-check from the repository, or pass --root DIR")


def environment() -> dict:
    """What this machine runs: Python, torch, CUDA, the GPU, cupy and its NCCL, mpi4py."""
    import importlib.metadata as md

    import torch

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "gpu": props.name,
           "gpu_memory_gib": round(props.total_memory / 2**30, 1),
           "capability": f"{props.major}.{props.minor}", "gpus": torch.cuda.device_count()}
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy", "mpi4py", "mpich", "soapstone"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    try:
        from cupy.cuda import nccl

        env["nccl"] = nccl.get_version()
    except Exception as e:  # noqa: BLE001 - the report says why NCCL is missing
        env["nccl"] = f"unusable: {type(e).__name__}: {e}"
    return env


def _child(name: str, cmd: list[str], root: Path, timeout: float) -> tuple[Outcome, str]:
    """Run `cmd` in a child process from `root`; (the outcome, its output)."""
    bindir = str(Path(sys.executable).parent)  # mpiexec of the mpich wheel, soapstone
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Outcome(name, False, f"timed out after {timeout:.0f} s",
                       time.perf_counter() - t0), text
    text = r.stdout + r.stderr
    tail = " | ".join(text.strip().splitlines()[-3:])
    return Outcome(name, r.returncode == 0, f"exit {r.returncode}: {tail}",
                   time.perf_counter() - t0), text


def cuda_tests(root: Path, timeout: float) -> Outcome:
    """The CUDA tests of the suite (CUDA_TESTS), their pytest summary as the detail."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS]
    out, text = _child("tests: " + " ".join(CUDA_TESTS), cmd, root, timeout)
    summary = next((line for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed|error)", line)), out.detail)
    failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return Outcome(out.name, out.ok, "; ".join([summary.strip("= "), *failed[:10]]),
                   out.seconds)


def golden_checks(root: Path, timeout: float) -> list[Outcome]:
    """`golden check` of every example with a record, on cuda, one rank."""
    out = []
    for record in sorted((root / "tests/golden/runs").glob("*.npz")):
        spec = root / "examples" / f"{record.stem}.par"
        if not spec.exists():
            continue
        cmd = [sys.executable, "-m", "soapstone.dsl.cli", "golden", "check",
               str(spec.relative_to(root)), str(record.relative_to(root)), "--device", "cuda",
               "--quiet", *PLUGINS.get(record.stem, ())]
        out.append(_child(f"golden check {spec.name} --device cuda", cmd, root, timeout)[0])
    return out


def shared_gpu_checks(root: Path, timeout: float) -> list[Outcome]:
    """`golden check` of SHARED_LAYOUTS, two ranks sharing this GPU over MPI through host memory."""
    out = []
    for example, layout in SHARED_LAYOUTS:
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "soapstone.dsl.cli", "golden", "check",
               f"examples/{example}.par", f"tests/golden/runs/{example}.npz", "--parallel",
               layout, "--device", "cuda", "--comm", "mpi", "--quiet"]
        name = f"golden check {example}.par --parallel {layout} --device cuda --comm mpi (2 ranks)"
        out.append(_child(name, cmd, root, timeout)[0])
    return out


def training(root: Path, tmp: Path, precision: str, layout: str, ranks: int,
             timeout: float) -> Outcome:
    """40 steps of examples/gpt.par on cuda in `precision`: the loss falls and the figures
    come out."""
    metrics = tmp / f"{precision}-{layout}.jsonl"
    launch = ["mpiexec", "-n", str(ranks)] if ranks > 1 else []
    comm = ["--comm", "mpi"] if ranks > 1 else []  # ranks sharing one GPU talk through host memory
    cmd = [*launch, sys.executable, "-m", "soapstone.dsl.cli", "run", "examples/gpt.par",
           "--parallel", layout, "--steps", "40", "--precision", precision, "--device", "cuda",
           *comm, "--metrics", str(metrics)]
    name = f"run --parallel {layout} --precision {precision} --device cuda ({ranks} rank" \
           + ("s)" if ranks > 1 else ")")
    out, text = _child(name, cmd, root, timeout)
    done = re.search(r"done: \d+ steps, loss ([\d.]+) -> ([\d.]+).*", text)
    if not out.ok or done is None:
        return out
    first, last = float(done.group(1)), float(done.group(2))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ok = last < first and all(r["tflops_per_device"] for r in rows)
    return Outcome(out.name, ok, done.group(0) + ("" if ok else " (the loss did not fall)"),
                   out.seconds)


def in_process(root: Path, tmp: Path, steps: int) -> tuple[list[Outcome], dict | None]:
    """The NCCL communicator's checks and the step-time comparison, in this process."""
    import torch

    from soapstone.comm import init
    from soapstone.dsl.app.gpu_probe import nccl_one_rank, step_time
    from soapstone.dsl.app.throughput import find_peak

    out = []
    t0 = time.perf_counter()
    try:
        world = init("nccl")
    except Exception as e:  # noqa: BLE001 - the report says why
        return [Outcome("nccl: init", False, f"{type(e).__name__}: {e}",
                        time.perf_counter() - t0)], None
    out.append(Outcome("nccl: init", True, repr(world), time.perf_counter() - t0))
    out.extend(nccl_one_rank(world))
    t0 = time.perf_counter()
    try:
        peak = find_peak(None, "bf16", torch.cuda.get_device_name())
        figures = step_time(root, tmp, steps, peak)
    except Exception as e:  # noqa: BLE001 - an OOM or a kernel error is a finding
        out.append(Outcome("step time vs plain torch", False, f"{type(e).__name__}: {e}",
                           time.perf_counter() - t0))
        return out, None
    r = figures["rows"]
    mfu = "; ".join(f"{n}: {v['tokens_per_s']:,.0f} tok/s, {v['tflops']:.1f} TFLOP/s"
                    + (f", MFU {v['mfu']:.1%}" if v["mfu"] is not None else "")
                    + f", attention {v['sdpa_kernel']}" for n, v in r.items())
    verdict = figures["ratio"]["verdict"]
    out.append(Outcome("step time vs plain torch", True,
                       f"{figures['model']}: {mfu}; plain/soapstone "
                       f"{figures['ratio']['ratio']:.2f}x ({verdict})",
                       time.perf_counter() - t0))
    return out, figures


def gpu_check(root: Path, report: Path, steps: int, skip_tests: bool = False,
              say=print) -> int:
    """Run every check, write `report`, print one line per check; the exit code (module
    doc). BadInput for a --root that is not a checkout."""
    check_root(root)
    t0 = time.perf_counter()
    data = {"environment": environment(), "checks": []}
    say(f"soapstone gpu-check on {data['environment']['gpu']} (torch "
        f"{data['environment']['torch']}, CUDA {data['environment']['torch_cuda']})")
    checks = data["checks"]

    def add(outcomes):
        for o in outcomes:
            checks.append(o.to_json())
            say(f"  {'ok  ' if o.ok else 'FAIL'} {o.name} ({o.seconds:.0f} s): {o.detail}")

    with tempfile.TemporaryDirectory() as tmp:
        if not skip_tests:
            add([cuda_tests(root, timeout=300)])
        add(golden_checks(root, timeout=120))
        add(shared_gpu_checks(root, timeout=120))
        add([training(root, Path(tmp), *run, timeout=180) for run in TRAINING])
        outcomes, figures = in_process(root, Path(tmp), steps)
        add(outcomes)
    if figures is not None:
        data["step_time"] = {k: v for k, v in figures.items() if k != "table"}
        say(figures["table"])
    data["ok"] = all(c["ok"] for c in checks)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    report.write_text(json.dumps(data, indent=1) + "\n")
    failed = sum(not c["ok"] for c in checks)
    say(f"{len(checks) - failed} of {len(checks)} checks passed in {data['seconds']:.0f} s; "
        f"report: {report}")
    return 0 if data["ok"] else 1
