"""How long `soapstone plan` takes: a 100-block GPT (examples/gpt.par's model with 100 blocks,
hidden 8192, 64 heads, sequence 1024, batch 1024) planned for 4096 devices, and seed 004's 1T
model (tests/specs/gpt_1t.par at sequence 256), both on a100-40gb; wall and CPU seconds for
loading the spec and for the search.

    .venv/bin/python bench/bench_plan.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from soapstone.dsl import load
from soapstone.dsl.plan_search import Planner, search
from soapstone.shard.plan.hardware import load_profile

DIMS = "dim batch = 1024, seq = 1024, hidden = 8192, heads = 64, ffn = 32768, vocab = 51200"


def gpt100() -> str:
    """The 100-block spec's text."""
    text = Path("examples/gpt.par").read_text().split("parallel single")[0]
    text = text.replace("repeat 4 as layer", "repeat 100 as layer")
    return text.replace("dim batch = 8, seq = 16, hidden = 32, heads = 4, ffn = 64, vocab = 64",
                        DIMS)


def timed(what: str, fn):
    """fn()'s result, printing its wall and CPU seconds."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    print(f"  {what:<8} wall {time.perf_counter() - w:6.2f} s   "
          f"cpu {time.process_time() - c:6.2f} s")
    return out


def main() -> int:
    prof = load_profile("a100-40gb")
    for name, src, dims in (("gpt, 100 blocks", gpt100(), None),
                            ("gpt_1t, 128 blocks", "tests/specs/gpt_1t.par", {"seq": 256})):
        print(f"{name} on 4096 x {prof.name}:")
        w, c = time.perf_counter(), time.process_time()
        model = timed("load", lambda src=src, dims=dims: load(src, dims=dims).model())
        plan = timed("search", lambda model=model: search(Planner(model, prof,
                                                                  precision="bf16"), 4096))
        print(f"  total    wall {time.perf_counter() - w:6.2f} s   cpu "
              f"{time.process_time() - c:6.2f} s   ({plan.evaluated} layouts costed, "
              f"{len(plan.ranked)} fit; best {plan.best.candidate.label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
