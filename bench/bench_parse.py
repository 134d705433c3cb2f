"""Front-end speed: parse + check examples/gpt.par with `repeat 1000` (about 22k primitive ops).

    .venv/bin/python bench/bench_parse.py [--repeat 1000] [--runs 5]

Prints the best and median wall time of `soapstone.dsl.load` (parse, expand, shape inference,
every parallel block checked). No torch is imported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from soapstone.dsl import load

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    text = (ROOT / "examples" / "gpt.par").read_text()
    text = text.replace("repeat 4 as layer", f"repeat {args.repeat} as layer")
    # the pipeline layout must cover every block: stretch its ranges to the new depth
    half, last = args.repeat // 2, args.repeat - 1
    stages = f"layer[0..{half - 1}] -> pipe 0, layer[{half}..{last}] -> pipe 1"
    text = text.replace("layer[0..1] -> pipe 0, layer[2..3] -> pipe 1", stages)
    load(text)  # warm-up: builds the lark parser once per process
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        spec = load(text, filename="gpt.par")
        times.append(time.perf_counter() - t0)
    m = spec.model()
    print(f"parse+check gpt.par, repeat {args.repeat}: {len(m.ops)} ops, {len(m.params)} params, "
          f"{len(spec.parallels)} parallel blocks")
    print(f"best {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms "
          f"over {args.runs} runs")
    print(f"torch imported: {'torch' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
