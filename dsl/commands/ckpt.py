"""`soapstone ckpt inspect|verify|export DIR`: what a checkpoint holds; is it whole; its weights.

inspect: what a checkpoint holds (step, model, layout, optimizer, settings, every tensor with
its shape, dtype, saved layout, pieces and bytes, and the bytes each rank wrote), after
checking the index field by field and every file against it (headers only). verify: every
byte of every piece against its checksum too, offline; exit 0 with one line, or exit 2 naming
the problems. export: the full, unsharded parameters (fp32 masters, or --dtype) as one
safetensors file keyed by parameter name, for use outside soapstone or as `run --init`. DIR is
a checkpoint (step-NNNNNNNN) or a --save DIR: inspect and export take its newest usable
checkpoint, verify checks every one; unfinished saves are named and passed over.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.commands import fail


def configure(parser: argparse.ArgumentParser) -> None:
    """`inspect DIR [--json]` | `verify DIR` | `export DIR -o FILE [--dtype D]`."""
    parser.add_argument("action", choices=["inspect", "verify", "export"],
                        help="inspect: what is in it; verify: check every byte against its "
                             "checksum; export: full parameters as safetensors")
    parser.add_argument("dir", metavar="DIR", help="a checkpoint, or a run's --save DIR")
    parser.add_argument("--json", action="store_true", help="inspect: the index as JSON")
    parser.add_argument("-o", "--output", metavar="FILE", help="export: the .safetensors file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="export: cast the parameters (default: as saved, fp32 masters)")


def main(args: argparse.Namespace) -> int:
    """Inspect, verify or export; exit 2 for a missing, partial or damaged checkpoint."""
    from soapstone.shard.checkpoint.verify import latest

    if args.action == "verify":
        return verify(args.dir)
    try:
        d, index, skipped = latest(args.dir)
        if args.action == "export" and not args.output:
            from soapstone.dsl.lang.errors import BadInput

            raise BadInput("ckpt export: give the output file, -o model.safetensors")
    except UserError as e:
        return fail(e)
    for p, why in skipped:
        print(f"ignoring {p}: {why}", file=sys.stderr)
    if args.action == "export":
        return export(d, index, Path(args.output), args.dtype)
    if args.json:
        print(json.dumps(index.raw | {"dir": str(d)}, indent=1, sort_keys=True))
    else:
        print("\n".join(describe(d, index)))
    return 0


def verify(path: str) -> int:
    """`ckpt verify`: every checkpoint DIR names, every byte against its checksum."""
    from soapstone.shard.checkpoint import index as ix
    from soapstone.shard.checkpoint.verify import verify_data

    try:
        candidates, skipped = ix.find(path)
    except UserError as e:
        return fail(e)
    problems: list[str] = []
    steps, files, pieces, nbytes = [], 0, 0, 0
    for d in reversed(candidates):
        try:
            index = ix.read(d)
        except UserError as e:
            problems.append(str(e))
            continue
        report = verify_data(d, index, problems)
        steps.append(index.step)
        files, pieces, nbytes = files + report.files, pieces + report.pieces, \
            nbytes + report.bytes
    for p, why in skipped:
        print(f"note: passed over {p}: {why}", file=sys.stderr)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        print(f"ckpt verify {path}: {len(problems)} problem{'s' * (len(problems) > 1)}; "
              "the checkpoint is damaged", file=sys.stderr)
        return 2
    which = ", ".join(map(str, steps))
    print(f"ok: {path}: step{'s' * (len(steps) > 1)} {which}: {files} file"
          f"{'s' * (files > 1)}, {pieces} pieces, {nbytes} bytes of tensors, every checksum "
          "matches")
    return 0


def describe(d: Path, index) -> list[str]:
    """inspect's text."""
    from soapstone.shard.plan.units import format_bytes

    mesh = " x ".join(f"{a}={n}" for a, n in index.mesh.items()) or "one rank"
    opt = index.optimizer
    settings = index.settings
    lines = [f"checkpoint {d}",
             f"  model {index.model} / {index.parallel or 'single'}  mesh({mesh})  "
             f"{index.world_size} ranks  zero {index.zero}",
             f"  step {index.step}  seed {index.seed}  optimizer {opt.name} "
             f"({opt.steps} updates)  precision {settings.get('precision', '?')}",
             "  settings " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())
                                       if k != "dims" and v is not None),
             "tensors:"]
    width = max((len(n) for n in index.tensors), default=0)
    totals: dict[str, int] = {}
    for name, t in index.tensors.items():
        n = _bytes(t)
        totals[t.kind] = totals.get(t.kind, 0) + n
        layout = ", ".join(f"{p}@{a}" for a, p in t.layout.items()) or "replicate"
        lines.append(f"  {name:<{width}}  {t.dtype:<8} {str(list(t.shape)):<16} "
                     f"{layout:<24} {len(t.pieces)} piece{'s' if len(t.pieces) > 1 else ''}"
                     f"  {format_bytes(n)}")
    lines.append("bytes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in totals.items()))
    lines.append("files:")
    for name, f in sorted(index.files.items()):
        lines.append(f"  {name}  rank {f.rank}  {format_bytes(f.bytes)}")
    return lines


def _bytes(t) -> int:
    import math

    return math.prod(t.shape) * t.itemsize


def export(d: Path, index, output: Path, dtype: str | None) -> int:
    """Write every parameter's full tensor (read piece by piece) to one safetensors file."""
    import torch

    from soapstone.shard.checkpoint.boxes import Box
    from soapstone.shard.checkpoint.checksum import chunk_crcs
    from soapstone.shard.checkpoint.index import params
    from soapstone.shard.checkpoint.tensorfile import BY_NAME, Reader, write

    reader = Reader(d, index)
    tensors = []
    try:
        for name, t in params(index).items():
            shape = t.shape
            want = BY_NAME[dtype or t.dtype]
            tensors.append((name, reader.read(f"param/{name}", Box((0,) * len(shape), shape),
                                              want)))
    except UserError as e:
        return fail(e)
    finally:
        reader.close()
    # the file carries its checksums (safetensors metadata): `run --init FILE` checks them
    tensors = [(name, t.contiguous()) for name, t in tensors]
    crcs = {name: chunk_crcs(t.reshape(-1).view(torch.uint8).numpy()) for name, t in tensors}
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        n = write(output, tensors, {"format": "pt", "source": str(d), "step": str(index.step),
                                    "model": index.model, "crc32": json.dumps(crcs)}).bytes
    except OSError as e:
        from ..errors import BadInput

        return fail(BadInput(f"ckpt export -o {output}: cannot write it ({e.strerror})"))
    print(f"exported {len(tensors)} parameters of {index.model} at step {index.step} "
          f"to {output} ({n} bytes)")
    return 0
