"""How long proving a layout before launch takes (shard/plan/verify/prove.py via
dsl/compile/layout_proof.py,
what `check --verify`, `run` and `golden check` call): examples/gpt.par's 8-rank layout gpt8
(pipe 2 x data 2 x model 2, 1F1B, 4 microbatches, ZeRO-1) and a 128-block GPT cut into 64
pipeline stages (two blocks each, 1F1B, 128 microbatches, on 64 ranks), and that times 4
data-parallel replicas (256 ranks: proved from one pipe column). Lowering is timed
apart (the compiler, which every command runs anyway); the proof is deriving every rank's
sequence, the three checks and the bytes against explain. Median of 5 runs, wall and CPU.

    .venv/bin/python bench/bench_verify.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from soapstone.dsl import load
from soapstone.dsl.compile.layout_proof import prove_layout
from soapstone.dsl.compile.stages import lower_graph

REPEATS = 5
STAGES, BLOCKS, MICROBATCHES = 64, 128, 128


def pipeline64(data: int = 1) -> str:
    """gpt.par's model with 128 blocks, and a 64-stage layout of two blocks per stage (times
    `data` data-parallel replicas)."""
    text = Path("examples/gpt.par").read_text().split("parallel single")[0]
    text = text.replace("repeat 4 as layer", f"repeat {BLOCKS} as layer")
    text = text.replace("dim batch = 8,", f"dim batch = {MICROBATCHES * data},")
    per = BLOCKS // STAGES
    stages = ", ".join(f"layer[{i * per}..{i * per + per - 1}] -> pipe {i}"
                       for i in range(STAGES))
    mesh = f"pipe = {STAGES}" + (f", data = {data}" if data > 1 else "")
    sample = "  sample batch -> data\n" if data > 1 else ""
    return text + (f"\nparallel pp64 for gpt on mesh({mesh}) {{\n{sample}"
                   f"  operator {stages}\n"
                   f"  schedule 1f1b, microbatches = {MICROBATCHES}\n}}\n")


def timed(fn) -> tuple[float, float, float, object]:
    """(first call's CPU s, median wall s, median CPU s, last result) of REPEATS calls."""
    walls, cpus, out = [], [], None
    for _ in range(REPEATS):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return cpus[0], statistics.median(walls), statistics.median(cpus), out


def case(name: str, spec, layout: str) -> None:
    """Lower and prove one layout; print the timings (the compiler caches lowerings, so only
    its first call counts) and what the proof covered."""
    par = spec.parallel(layout)
    model = spec.model(par.model)
    lower, _, _, graph = timed(lambda: lower_graph(model, par))
    first, wall, cpu, proof = timed(lambda: prove_layout(model, graph))
    print(f"{name:<32} lower: cpu {lower:6.3f} s   prove: first cpu {first:6.3f} s, median "
          f"cpu {cpu:6.3f} s (wall {wall:6.3f} s)\n{'':<32} {proof.summary()}")


def main() -> int:
    case("gpt.par gpt8 (8 ranks)", load("examples/gpt.par"), "gpt8")
    case(f"{BLOCKS} blocks, {STAGES} stages, m={MICROBATCHES}",
         load(pipeline64(), filename="pipeline64.par"), "pp64")
    case(f"the same x data 4 ({STAGES * 4} ranks)",
         load(pipeline64(4), filename="pipeline64x4.par"), "pp64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
