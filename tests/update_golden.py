"""Rewrite the golden files; tests only compare against them. Review the diff like code.

    .venv/bin/python tests/update_golden.py                # show files: tests/golden/*.txt
    .venv/bin/python tests/update_golden.py --runs towers  # and tests/golden/runs/towers.npz

`make golden` runs the first. The show files are text and rewritten whole (stale ones removed);
the run records (`soapstone golden record`: one rank, 5 SGD steps, seed 0) are binary and
carry the torch version, so they are recorded only when named: `--runs all` records every
example's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "support"))

from golden_show import EXAMPLES, GOLDEN, PLUGIN, golden_shows, stale_files  # noqa: E402

RUNS = GOLDEN / "runs"


def update_shows() -> None:
    """Write every golden show file; remove those no example makes."""
    for g in golden_shows():
        text = g.text()
        old = g.path.read_text() if g.path.exists() else None
        if text != old:
            g.path.write_text(text)
            print(f"{'wrote' if old is None else 'updated'} {g.path.relative_to(TESTS.parent)}")
    for p in stale_files():
        p.unlink()
        print(f"removed {p.relative_to(TESTS.parent)}")


def record_runs(names: list[str]) -> None:
    """Record the single-rank run of each named example (or of every one, for `all`)."""
    from soapstone.dsl.app.golden_run import record_run

    if names == ["all"]:
        names = [p.stem for p in sorted(EXAMPLES.glob("*.par"))]
    for name in names:
        out = RUNS / f"{name}.npz"
        record_run(str(EXAMPLES / f"{name}.par"), str(out), plugins=(str(PLUGIN),))
        print(f"recorded {out.relative_to(TESTS.parent)}")


def main(argv: list[str] | None = None) -> int:
    """Rewrite the show files, and record the runs named with --runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", metavar="EXAMPLE", default=[],
                        help="also record these examples' runs (e.g. towers), or `all`")
    args = parser.parse_args(argv)
    update_shows()
    record_runs(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
