"""Real geometry from the examples (issue 28): GPT-2 124M and a LLaMA-3-8B geometry in every
layout examples/gpt2.par and examples/llama.par declare.

The geometries, as --dim sets and edits of the example's text (what the Hugging Face
mismatch errors tell a user to write):
- GPT-2 124M: --dim vocab=50304 --dim classes=50257 --dim hidden=768 --dim heads=12
  --dim ffn=3072 --dim max_seq=1024 (50257 ids padded as Megatron pads them, so the layouts
  that split vocab take it); 12 blocks.
- LLaMA-3-8B: --dim vocab=128256 --dim hidden=4096 --dim heads=32 --dim kv_heads=8
  --dim ffn=14336, the attention's rope = 500000.0 with LLaMA-3's scaling (rope_factor = 8.0,
  rope_low_freq = 1.0, rope_high_freq = 4.0, rope_original_max = 8192), each rmsnorm's
  eps = 1e-05; 32 blocks.

1. Full depth, no weights (`--part plan`): the example's text with the real block count
   (`repeat 12` / `repeat 32`; the pipeline layouts' two stages half the blocks each), then
   `soapstone check` of the file (every layout) and `soapstone explain` of each layout: a row
   per layout with its ranks and the busiest rank's params, activations and total bytes.
2. Real weights (`--part load`): a save_pretrained-like directory, then for every layout a
   run from it:
   - GPT-2 124M whole (--gpt2-blocks, default 12): transformers' random-init GPT2LMHeadModel,
     saved with save_pretrained;
     `run --init hf:DIR --steps 1 --optimizer sgd` in each layout: its first loss equals
     transformers' (rel 1e-5);
   - LLaMA-3-8B widths at 2 layers (the example's own count: 1.49e9 parameters, 6 GB in
     fp32; the full 32 do not fit a 24 GiB machine): the directory written
     tensor by tensor (a streaming safetensors writer, normal(0, 0.02) weights and norms
     around 1: no full model in memory; the mapping is hf_tensors' own, checked against
     transformers on small configs in tests/dsl/interop/test_hf*.py); `generate --init hf:DIR
     --temperature 0` in each layout whose weights, summed over its ranks, fit --budget-gb
     (each rank holds its layout's shares; a replicated layout holds more): its greedy
     tokens equal one rank's. The rest are listed as skipped, with the bytes they need.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_geometry.py [--part plan|load|both]
        [--model gpt2|llama|both] [--dir /tmp/soapstone-geometry] [--budget-gb 12]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPT2_DIMS = {"vocab": 50304, "classes": 50257, "hidden": 768, "heads": 12, "ffn": 3072,
             "max_seq": 1024}
LLAMA3_DIMS = {"vocab": 128256, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
LLAMA3_ROPE = ("rope = 500000.0, rope_factor = 8.0, rope_low_freq = 1.0, rope_high_freq = 4.0, "
               "rope_original_max = 8192")
GEOMETRY = {"gpt2": (GPT2_DIMS, 12), "llama": (LLAMA3_DIMS, 32)}


def spec_text(kind: str, blocks: int = 2) -> str:
    """The example's text for the geometry: LLaMA-3's rope and eps, `blocks` blocks (the
    pipeline layouts' two stages half each)."""
    text = (ROOT / f"examples/{kind}.par").read_text()
    if kind == "llama":
        text = text.replace("rope = 10000.0", LLAMA3_ROPE).replace("rmsnorm(x)",
                                                                   "rmsnorm(x, eps = 1e-05)")
    if blocks != 2:
        half = blocks // 2
        text = text.replace("repeat 2 as layer", f"repeat {blocks} as layer").replace(
            "layer[0] -> pipe 0, layer[1] -> pipe 1",
            f"layer[0..{half - 1}] -> pipe 0, layer[{half}..{blocks - 1}] -> pipe 1")
    return text


def dim_flags(dims: dict[str, int]) -> list[str]:
    """--dim NAME=SIZE for each."""
    return [x for d, n in dims.items() for x in ("--dim", f"{d}={n}")]


def soapstone(*argv: str, ranks: int = 1, timeout: float = 1800) -> subprocess.CompletedProcess:
    """The CLI, under mpiexec when ranks > 1."""
    cmd = [str(BIN / "soapstone"), *argv]
    if ranks > 1:
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def layouts(path: Path, dims: dict[str, int]) -> dict[str, int]:
    """The file's layouts that take the dims: name -> ranks."""
    from soapstone import dsl

    spec = dsl.load(path, dims=dims)
    return {name: p.world_size for name, p in spec.parallels.items()}


# ---- 1. full depth, no weights --------------------------------------------------------------

def plan_part(kind: str, work: Path) -> None:
    """check + explain of every layout at the real block count."""
    dims, blocks = GEOMETRY[kind]
    path = work / f"{kind}-{blocks}.par"
    path.write_text(spec_text(kind, blocks))
    t0 = time.perf_counter()
    r = soapstone("check", str(path), *dim_flags(dims))
    print(f"{kind} x {blocks} blocks: check rc {r.returncode} in "
          f"{time.perf_counter() - t0:.1f} s: {r.stdout.strip()} {r.stderr.strip()}")
    print("| layout | ranks | params / rank | activations / rank | total / rank (adamw) | "
          "explain s |")
    print("|---|---|---|---|---|---|")
    for name, n in layouts(path, dims).items():
        t0 = time.perf_counter()
        r = soapstone("explain", str(path), "--parallel", name, *dim_flags(dims), "--json")
        took = time.perf_counter() - t0
        if r.returncode:
            print(f"| {name} | {n} | explain rc {r.returncode}: {r.stderr.strip()[:200]} |")
            continue
        e = json.loads(r.stdout)
        print(f"| {name} | {n} | {e['param_bytes'] / 2**30:.2f} GiB | "
              f"{e['activation_bytes'] / 2**30:.2f} GiB | {e['total_bytes'] / 2**30:.2f} GiB | "
              f"{took:.1f} |")


# ---- 2. real weights, reduced depth --------------------------------------------------------

def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str]],
                      seed: int = 0) -> None:
    """A safetensors file of fp32 tensors (name, shape, init: normal | ones) written one
    block of rows at a time: normal(0, 0.02), or 1 + normal(0, 0.02) for norms."""
    import torch

    header, offset = {}, 0
    for name, shape, _ in tensors:
        size = 4 * _numel(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset,
                                                                             offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape, init in tensors:
            rows = shape[0]
            per = max(1, (1 << 24) // max(1, _numel(shape[1:])))  # ~64 MB a block
            for r0 in range(0, rows, per):
                block = torch.randn((min(per, rows - r0), *shape[1:]), generator=g) * 0.02
                if init == "ones":
                    block += 1.0
                f.write(block.numpy().tobytes())


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def llama3_dir(directory: Path) -> Path:
    """A LLaMA-3-8B-wide, 2-layer save_pretrained-like directory (config.json +
    model.safetensors), written once."""
    from soapstone import dsl
    from soapstone.dsl.compile.lower import resolve_ties
    from soapstone.dsl.interop import hf_config
    from soapstone.dsl.interop.hf_tensors import hf_shape, tensor_map

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 128256, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
            "num_hidden_layers": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(conf, indent=2))
    cfg = hf_config.read_config(directory)
    model = resolve_ties(dsl.load(spec_text("llama"), dims=LLAMA3_DIMS).model("llama"))
    sizes = dict(model.dims)
    shapes = {p.name: tuple(sizes[d] for d in p.type.dims) for p in model.params}
    tensors = [(t.name, hf_shape(t.how, [shapes[n] for n in t.params]),
                "ones" if t.name.endswith("norm.weight") else "normal")
               for t in tensor_map(cfg)]
    write_safetensors(directory / "model.safetensors", tensors)
    return directory


def gpt2_dir(directory: Path, layers: int) -> Path:
    """transformers' random-init GPT-2 124M widths, `layers` layers, saved once."""
    if (directory / "model.safetensors").exists():
        return directory
    import torch
    import transformers

    torch.manual_seed(0)
    conf = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_head=12,
                                   n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(conf).save_pretrained(directory)
    return directory


def _first_loss(metrics: Path) -> float:
    return json.loads(metrics.read_text().splitlines()[0])["loss"]


def gpt2_load(work: Path, blocks: int) -> None:
    """Every layout's first loss from the HF weights (`blocks` layers) against transformers'."""
    import torch
    import torch.nn.functional as F
    import transformers

    from soapstone import dsl
    from soapstone.dsl.compile.lower import lower
    from soapstone.shard.data.source import make_task

    d = gpt2_dir(work / f"gpt2-124m-{blocks}l", blocks)
    path = work / f"gpt2-{blocks}.par"
    path.write_text(spec_text("gpt2", blocks))
    model = dsl.load(path, dims=GPT2_DIMS).model("gpt2")
    batch = make_task(lower(model, None), 0).batch(0)
    ref = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
    with torch.no_grad():
        logits = ref(input_ids=batch["tokens"]).logits
    want = float(F.cross_entropy(logits.reshape(-1, 50257), batch["targets"].reshape(-1)))
    del ref
    print(f"gpt2 124M widths, {blocks} blocks: transformers' loss {want:.6f}")
    print("| layout | ranks | first loss | rel. diff | s |")
    print("|---|---|---|---|---|")
    for name, n in layouts(path, GPT2_DIMS).items():
        metrics = work / f"gpt2-{name}.jsonl"
        t0 = time.perf_counter()
        r = soapstone("run", str(path), "--parallel", name, *dim_flags(GPT2_DIMS), "--init",
                      f"hf:{d}", "--steps", "1", "--optimizer", "sgd", "--quiet",
                      "--metrics", str(metrics), ranks=n)
        took = time.perf_counter() - t0
        if r.returncode:
            print(f"| {name} | {n} | rc {r.returncode}: {r.stderr.strip()[-300:]} | | |")
            continue
        got = _first_loss(metrics)
        print(f"| {name} | {n} | {got:.6f} | {abs(got - want) / want:.1e} | {took:.0f} |")


def llama_load(work: Path, budget: float) -> None:
    """Every layout that fits the budget: greedy tokens from the HF weights, as one rank's."""
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph

    t0 = time.perf_counter()
    d = llama3_dir(work / "llama3-8b-2l")
    print(f"llama3-8b widths, 2 blocks: directory ready in {time.perf_counter() - t0:.0f} s")
    path = work / "llama-2.par"
    path.write_text(spec_text("llama"))
    spec = dsl.load(path, dims=LLAMA3_DIMS)
    print("| layout | ranks | weights on all ranks | greedy tokens | as one rank | s |")
    print("|---|---|---|---|---|---|")
    first = None
    for name, par in spec.parallels.items():
        graph = lower_graph(spec.model("llama"), par)
        # each stage's shares on each of its ranks (world / pipe of them)
        held = 4 * sum(_numel(p.local_shape) for s in graph.stages for p in s.program.params)
        held *= par.world_size // graph.pipe
        if held > budget * 2**30:
            print(f"| {name} | {par.world_size} | {held / 2**30:.1f} GiB | skipped: over "
                  f"--budget-gb {budget:g} | | |")
            continue
        t0 = time.perf_counter()
        r = soapstone("generate", str(path), "--parallel", name, *dim_flags(LLAMA3_DIMS),
                      "--init", f"hf:{d}", "--prompt", "!", "--tokens", "4",
                      "--temperature", "0", "--tokenizer", str(_byte_free_tokenizer(work)),
                      ranks=par.world_size)
        took = time.perf_counter() - t0
        if r.returncode:
            print(f"| {name} | {par.world_size} | {held / 2**30:.1f} GiB | rc {r.returncode}: "
                  f"{r.stderr.strip()[-300:]} | | |")
            continue
        out = r.stdout.strip().splitlines()[0]
        first = out if first is None else first
        print(f"| {name} | {par.world_size} | {held / 2**30:.1f} GiB | {out!r} | "
              f"{out == first} | {took:.0f} |")


def _byte_free_tokenizer(work: Path) -> Path:
    """A word-level tokenizer.json over 128256 ids ("t0", "t1", ...; "!" is id 0), so the
    generated ids print as themselves."""
    path = work / "tokenizer.json"
    if not path.exists():
        vocab = {"!": 0, **{f"t{i}": i for i in range(1, 128256)}}
        path.write_text(json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "!"}}))
    return path


def main() -> None:
    """The parts asked for, their tables on stdout."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("plan", "load", "both"), default="both")
    ap.add_argument("--model", choices=("gpt2", "llama", "both"), default="both")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "soapstone-geometry"))
    ap.add_argument("--gpt2-blocks", type=int, default=12,
                    help="GPT-2's layers in the load part (default 12: GPT-2 124M whole)")
    ap.add_argument("--budget-gb", type=float, default=12.0,
                    help="the most weight bytes, summed over a layout's ranks, a LLaMA load "
                         "may hold (this machine's free memory, less a margin)")
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    kinds = ("gpt2", "llama") if args.model == "both" else (args.model,)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for kind in kinds:
        if args.part in ("plan", "both"):
            plan_part(kind, work)
        if args.part in ("load", "both"):
            if kind == "gpt2":
                gpt2_load(work, args.gpt2_blocks)
            else:
                llama_load(work, args.budget_gb)


if __name__ == "__main__":
    main()
