"""explain's activation memory per transformer layer against Korthikanti et al.'s formulas.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198, Section 4 and Table 2) count the bytes one transformer layer keeps for
backward, per microbatch of b sequences, with 16-bit activations and 1-byte dropout masks.
bench/data/korthikanti_activations.json holds the formulas, their source and the rows evaluated
at the paper's four geometries (its Table 3: 22B, 175B, 530B, 1T, t = 8, microbatch 1);
`--write` regenerates it.

soapstone's figure for a row is explain's (`activation_figures`, under --precision bf16) for
tests/specs/korthikanti_gpt.par's layout of the same name at that geometry: the difference
between 2 and 1 layers, so one layer's bytes. Torch-free and quick:

    .venv/bin/python bench/bench_activations.py [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "korthikanti_activations.json"
SPEC = ROOT / "tests" / "specs" / "korthikanti_gpt.par"

SOURCE = ("V. A. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, "
          "B. Catanzaro, \"Reducing Activation Recomputation in Large Transformer Models\", "
          "MLSys 2023, arXiv:2205.05198: Section 4 (activation memory per layer) and Table 2; "
          "geometries from its Table 3")
CHECKED = ("checked 2026-11-26 through the search tool (pages and docs): sbh(34 + 5as/h), "
           "and that layernorms and dropouts stay whole under tensor parallelism, against "
           "awsdocs-neuron-readthedocs (neuronx-distributed, activation_memory_reduction); the "
           "attention breakdown (QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, its "
           "dropout mask as^2b, ...) against notes.haroldbenoit.com (activation-checkpointing); "
           "ar5iv.labs.arxiv.org/html/2205.05198 hosts the paper. The tensor-parallel, "
           "sequence-parallel, selective and full rows are Table 2's as recalled and re-derived "
           "from that breakdown (10sbh = layernorm inputs 4 + dropout masks 2 + first-linear "
           "inputs 4 stays whole under tensor parallelism alone), not read off the page; the "
           "geometries were typed from memory of Table 3: verify both against the PDF")

# technique -> (Table 2's formula, bytes per layer as a function of s, b, h, a, t)
FORMULAS = {
    "none": ("sbh(34 + 5as/h)", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    "tp": ("sbh(10 + 24/t + 5as/(ht))",
           lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    "tp_sp": ("sbh/t (34 + 5as/h)",
              lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    "tp_selective": ("sbh(10 + 24/t)", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    "tp_sp_selective": ("sbh(34/t)", lambda s, b, h, a, t: s * b * h * 34 / t),
    "tp_full": ("2sbh", lambda s, b, h, a, t: 2 * s * b * h),
    # the paper's full recompute keeps the layer's input; under sequence parallelism that
    # input is itself split over the t ranks (Megatron checkpoints the split tensor)
    "tp_sp_full": ("2sbh/t (Table 2's 2sbh, its input split by sequence parallelism)",
                   lambda s, b, h, a, t: 2 * s * b * h / t),
}
GEOMETRIES = [  # the paper's Table 3 (t = 8 throughout); microbatch b = 1
    {"name": "22B", "a": 64, "h": 6144, "L": 48, "s": 2048, "b": 1, "t": 8},
    {"name": "175B", "a": 96, "h": 12288, "L": 96, "s": 2048, "b": 1, "t": 8},
    {"name": "530B", "a": 128, "h": 20480, "L": 105, "s": 2048, "b": 1, "t": 8},
    {"name": "1T", "a": 160, "h": 25600, "L": 128, "s": 2048, "b": 1, "t": 8},
]


def formula_bytes(technique: str, g: dict) -> float:
    """Table 2's bytes per layer for `technique` at geometry `g`."""
    return FORMULAS[technique][1](g["s"], g["b"], g["h"], g["a"], g["t"])


def explain_bytes(layout: str, g: dict) -> int:
    """explain's activation bytes (bf16) of one layer of korthikanti_gpt.par's `layout`."""
    from soapstone import dsl
    from soapstone.dsl.compile.stages import lower_graph
    from soapstone.shard.plan.analysis.activations import activation_figures
    from soapstone.shard.plan.analysis.precision import program_as_run

    dims = {"batch": g["b"], "seq": g["s"], "hidden": g["h"], "heads": g["a"],
            "ffn": 4 * g["h"]}
    per = []
    for layers in (1, 2):
        spec = dsl.load(str(SPEC), dims={**dims, "layers": layers})
        par = spec.parallel(layout)
        program = lower_graph(spec.model(par.model), par).stages[0].program
        per.append(activation_figures(program_as_run(program, "bf16"))[0])
    return per[1] - per[0]


def rows() -> list[dict]:
    """Every geometry x technique: the formula, explain's bytes, and the error."""
    out = []
    for g in GEOMETRIES:
        for tech in FORMULAS:
            f = formula_bytes(tech, g)
            e = explain_bytes(tech, g)
            out.append({"geometry": g["name"], "technique": tech,
                        "formula": FORMULAS[tech][0], "formula_bytes": round(f),
                        "explain_bytes": e, "error": e / f - 1})
    return out


def table(rs: list[dict]) -> str:
    """The rows as a Markdown table (MiB per layer)."""
    out = ["| model | technique | formula | formula MiB | explain MiB | error |",
           "|---|---|---|---|---|---|"]
    for r in rs:
        out.append(f"| {r['geometry']} | {r['technique']} | {r['formula']} | "
                   f"{r['formula_bytes'] / 2**20:.1f} | {r['explain_bytes'] / 2**20:.1f} | "
                   f"{r['error']:+.1%} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"regenerate {DATA.name}")
    args = ap.parse_args()
    rs = rows()
    sys.stdout.write(table(rs))
    if args.write:
        DATA.write_text(json.dumps({
            "source": SOURCE, "checked": CHECKED,
            "units": "bytes one transformer layer keeps for backward, per microbatch of b "
                     "sequences: 16-bit activations, 1-byte dropout masks",
            "symbols": {"s": "sequence length", "b": "microbatch size", "h": "hidden size",
                        "a": "attention heads", "t": "tensor-parallel size",
                        "L": "layers (not in the per-layer formulas)"},
            "formulas": {k: v[0] for k, v in FORMULAS.items()},
            "geometries": GEOMETRIES,
            "rows": [{"geometry": g["name"], "technique": tech,
                      "bytes_per_layer": round(formula_bytes(tech, g))}
                     for g in GEOMETRIES for tech in FORMULAS],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
