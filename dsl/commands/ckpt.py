"""`soapstone ckpt inspect DIR` and `soapstone ckpt export DIR -o model.safetensors`.

inspect: what a checkpoint holds (step, model, layout, optimizer, settings, every tensor with
its shape, dtype, saved layout, pieces and bytes, and the bytes each rank wrote), after
checking every file against the index (headers only). export: the full, unsharded parameters
(fp32 masters, or --dtype) as one safetensors file keyed by parameter name, for use outside
soapstone or as `run --init`. DIR is a checkpoint (step-NNNNNNNN) or a --save DIR (its latest
complete checkpoint; partial saves are named and passed over).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.commands import fail


def configure(parser: argparse.ArgumentParser) -> None:
    """`inspect DIR [--json]` | `export DIR -o FILE [--dtype D]`."""
    parser.add_argument("action", choices=["inspect", "export"],
                        help="inspect: what is in it; export: full parameters as safetensors")
    parser.add_argument("dir", metavar="DIR", help="a checkpoint, or a run's --save DIR")
    parser.add_argument("--json", action="store_true", help="inspect: the index as JSON")
    parser.add_argument("-o", "--output", metavar="FILE", help="export: the .safetensors file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="export: cast the parameters (default: as saved, fp32 masters)")


def main(args: argparse.Namespace) -> int:
    """Inspect or export; exit 2 for a missing, partial or damaged checkpoint."""
    from soapstone.shard.checkpoint import index as ix
    from soapstone.shard.checkpoint.verify import verify

    try:
        d, partial = ix.find(args.dir)
        index = ix.read(d)
        verify(d, index)
        if args.action == "export" and not args.output:
            from soapstone.dsl.lang.errors import BadInput

            raise BadInput("ckpt export: give the output file, -o model.safetensors")
    except UserError as e:
        return fail(e)
    for p in partial:
        print(f"ignoring partial save {p} (no index.json: it did not finish)", file=sys.stderr)
    if args.action == "export":
        return export(d, index, Path(args.output), args.dtype)
    if args.json:
        print(json.dumps(index | {"dir": str(d)}, indent=1, sort_keys=True))
    else:
        print("\n".join(describe(d, index)))
    return 0


def describe(d: Path, index: dict) -> list[str]:
    """inspect's text."""
    from soapstone.shard.plan.units import format_bytes

    mesh = " x ".join(f"{a}={n}" for a, n in index.get("mesh", {}).items()) or "one rank"
    opt = index["optimizer"]
    settings = index["settings"]
    lines = [f"checkpoint {d}",
             f"  model {index['model']} / {index.get('parallel') or 'single'}  mesh({mesh})  "
             f"{index.get('world_size', 1)} ranks  zero {index.get('zero', 0)}",
             f"  step {index['step']}  seed {index['seed']}  optimizer {opt['name']} "
             f"({opt['steps']} updates)  precision {settings.get('precision', '?')}",
             "  settings " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())
                                       if k != "dims" and v is not None),
             "tensors:"]
    width = max((len(n) for n in index["tensors"]), default=0)
    totals: dict[str, int] = {}
    for name, t in index["tensors"].items():
        n = _bytes(t)
        totals[t["kind"]] = totals.get(t["kind"], 0) + n
        layout = ", ".join(f"{p}@{a}" for a, p in t.get("layout", {}).items()) or "replicate"
        lines.append(f"  {name:<{width}}  {t['dtype']:<8} {str(list(t['shape'])):<16} "
                     f"{layout:<24} {len(t['pieces'])} piece{'s' if len(t['pieces']) > 1 else ''}"
                     f"  {format_bytes(n)}")
    lines.append("bytes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in totals.items()))
    lines.append("files:")
    for name, f in sorted(index["files"].items()):
        lines.append(f"  {name}  rank {f.get('rank', '?')}  {format_bytes(f['bytes'])}")
    return lines


def _bytes(t: dict) -> int:
    from soapstone.shard.checkpoint.index import DTYPES

    n = DTYPES.get(t["dtype"], ("?", 1))[1]
    for s in t["shape"]:
        n *= s
    return n


def export(d: Path, index: dict, output: Path, dtype: str | None) -> int:
    """Write every parameter's full tensor (read piece by piece) to one safetensors file."""
    from soapstone.shard.checkpoint.boxes import Box
    from soapstone.shard.checkpoint.index import params
    from soapstone.shard.checkpoint.tensorfile import BY_NAME, Reader, write

    reader = Reader(d, index)
    tensors = []
    try:
        for name, t in params(index).items():
            shape = tuple(t["shape"])
            want = BY_NAME[dtype or t["dtype"]]
            tensors.append((name, reader.read(f"param/{name}", Box((0,) * len(shape), shape),
                                              want)))
    except UserError as e:
        return fail(e)
    output.parent.mkdir(parents=True, exist_ok=True)
    n = write(output, tensors, {"format": "pt", "source": str(d), "step": str(index["step"]),
                                "model": index["model"]})
    print(f"exported {len(tensors)} parameters of {index['model']} at step {index['step']} "
          f"to {output} ({n} bytes)")
    return 0
