"""`soapstone debug hang DIR`: read every rank's flight-recorder dump and say who diverged.

The dumps are the `rank<R>.json` files the watchdog writes on a collective timeout, an uncaught
exception or SIGUSR1 (`SOAPSTONE_TRACE_DIR=DIR` or `run --debug-dir DIR`; soapstone.comm's
watchdog.py). Printed: the first divergence (a rank behind in a communicator, ranks calling
different collectives, a message waited for and never sent), then each rank: what it is doing,
where the layout's plan puts it (which call of the step it is in or makes next, when the run
handed the watchdog its plan: comm/observe/expected.py), its newest operations and where its Python
stack is. No MPI, no torch: run it anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.comm.observe.dump_schema import DumpError, check_dumps
from soapstone.dsl.commands import fail


def configure(parser: argparse.ArgumentParser) -> None:
    """`hang DIR` (the only subject so far), --ops N."""
    parser.add_argument("subject", choices=["hang"],
                        help="hang: read the per-rank dumps of a stuck or failed job")
    parser.add_argument("dir", metavar="DIR", help="the dump directory (SOAPSTONE_TRACE_DIR, "
                                                   "run --debug-dir)")
    parser.add_argument("--ops", type=int, default=4, metavar="N",
                        help="newest operations shown per rank (default 4)")


def load_dumps(folder: str) -> dict[int, dict]:
    """{world rank: its dump} from `folder`/rank<R>.json, each checked field by field and
    against the others (comm/observe/dump_schema.py); DumpError if there are none, or one
    is damaged or disagrees with another."""
    path = Path(folder)
    if not path.is_dir():
        raise DumpError(f"{folder}: no such directory; pass the directory given as "
                        "SOAPSTONE_TRACE_DIR or run --debug-dir")
    files = {}
    for f in sorted(path.glob("rank*.json")):
        try:
            files[f] = json.loads(f.read_text())
        except (OSError, ValueError) as e:  # UnicodeDecodeError and JSON's errors too
            raise DumpError(f"{f}: not a soapstone flight-recorder dump ({e})") from None
    dumps = check_dumps(files)
    if not dumps:
        raise DumpError(f"{folder}: no rank<R>.json dumps; they are written on a collective "
                        "timeout, an exception or SIGUSR1 when SOAPSTONE_TRACE_DIR (or run "
                        "--debug-dir) names this directory")
    return dumps


def hang_report(dumps: dict[int, dict], ops: int = 4) -> list[str]:
    """The text of `soapstone debug hang` for these dumps."""
    from soapstone.comm.observe.diagnose import divergences, doing, stack_tail
    from soapstone.comm.observe.expected import position_lines
    from soapstone.comm.observe.flight_recorder import entry_text

    size = max([d.get("size", 0) for d in dumps.values()] + [max(dumps) + 1])
    missing = [r for r in range(size) if r not in dumps]
    reasons = sorted({d.get("reason", "?") for d in dumps.values()})
    lines = [f"{len(dumps)} of {size} ranks dumped ({'; '.join(reasons)})"]
    if missing:
        lines.append("no dump from " + ", ".join(f"rank {r}" for r in missing)
                     + " (dead, or stuck in native code holding the GIL)")
    found = divergences(dumps)
    if found:
        lines.append(f"first divergence: {found[0]}")
        lines.extend(f"also: {text}" for text in found[1:])
    else:
        lines.append("no divergence: every rank has made the same collectives and the "
                     "messages waited for were sent")
    for rank in sorted(dumps):
        d = dumps[rank]
        lines.append(f"rank {rank} ({d.get('host', '?')} pid {d.get('pid', '?')}): {doing(d)}")
        if d.get("failure"):
            lines.append(f"  failed: {d['failure']}")
        lines.extend(f"  plan: {text}" for text in position_lines(rank, d.get("expected") or {}))
        newest = sorted(((e["started_s_ago"], snap["key"], e) for snap in d.get("comms", [])
                         for e in snap.get("entries", [])), key=lambda x: -x[0])[-ops:]
        lines.extend(f"  {entry_text(e, key)}" for _, key, e in newest)
        lines.append("  stack (innermost last):")
        lines.extend(f"  {s}" for s in stack_tail(d))
    return lines


def main(args: argparse.Namespace) -> int:
    """Print the hang report of DIR; 0, or 2 when DIR holds no dumps."""
    try:
        dumps = load_dumps(args.dir)
    except UserError as e:
        return fail(e)
    print("\n".join(hang_report(dumps, args.ops)), file=sys.stdout, flush=True)
    return 0
