"""How long `soapstone plan` takes, with activation recompute in the search and without it: a
100-block GPT (examples/gpt.par's model with 100 blocks, hidden 8192, 64 heads, sequence 1024,
batch 1024) planned for 4096 devices, and seed 004's 1T model (tests/specs/gpt_1t.par) at
sequence 256 (fits without recompute) and 2048 (only fits with it), all on a100-40gb in bf16.

Each search runs in a fresh process (the schedule caches start cold), the two settings of one
spec one after the other, `--repeat` times; the table gives the median wall and CPU seconds of
the search (loading the spec not included) and with / without as a ratio.

    .venv/bin/python bench/bench_plan.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DIMS = "dim batch = 1024, seq = 1024, hidden = 8192, heads = 64, ffn = 32768, vocab = 51200"
SPECS = {"gpt, 100 blocks": ("gpt100", None), "gpt_1t, seq 256": ("tests/specs/gpt_1t.par", 256),
         "gpt_1t, seq 2048": ("tests/specs/gpt_1t.par", 2048)}


def gpt100() -> str:
    """The 100-block spec's text."""
    text = Path("examples/gpt.par").read_text().split("parallel single")[0]
    text = text.replace("repeat 4 as layer", "repeat 100 as layer")
    return text.replace("dim batch = 8, seq = 16, hidden = 32, heads = 4, ffn = 64, vocab = 64",
                        DIMS)


def one(name: str, recompute: bool) -> dict:
    """Plan one spec in this process: the search's wall and CPU seconds and its outcome."""
    from soapstone.dsl import load
    from soapstone.dsl.search.plan_search import Planner, search
    from soapstone.dsl.search.space import PlanError
    from soapstone.shard.plan.analysis.hardware import load_profile

    src, seq = SPECS[name]
    model = load(gpt100() if src == "gpt100" else src,
                 dims={"seq": seq} if seq else None).model()
    planner = Planner(model, load_profile("a100-40gb"), precision="bf16",
                      recompute=None if recompute else ())
    w, c = time.perf_counter(), time.process_time()
    try:
        plan = search(planner, 4096)
        out = {"costed": plan.evaluated, "fit": len(plan.ranked),
               "best": plan.best.candidate.label}
    except PlanError:
        out = {"costed": None, "fit": 0, "best": "nothing fits"}
    return out | {"wall": time.perf_counter() - w, "cpu": time.process_time() - c}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--recompute", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.recompute == "on")))
        return 0
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):
        for name in SPECS:
            for rc in ("off", "on"):
                r = subprocess.run([sys.executable, __file__, "--one", name, "--recompute", rc],
                                   capture_output=True, text=True, check=True)
                runs.setdefault((name, rc), []).append(json.loads(r.stdout))
    print("| spec | recompute | layouts costed | fit | wall s | CPU s | CPU on/off | winner |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SPECS:
        cpu = {rc: statistics.median(x["cpu"] for x in runs[name, rc]) for rc in ("off", "on")}
        for rc in ("off", "on"):
            last = runs[name, rc][-1]
            wall = statistics.median(x["wall"] for x in runs[name, rc])
            ratio = f"{cpu['on'] / cpu['off']:.2f}x" if rc == "on" else ""
            print(f"| {name} | {rc} | {last['costed'] or '-'} | {last['fit']} | {wall:.2f} | "
                  f"{cpu[rc]:.2f} | {ratio} | {last['best']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
