"""explain's activation memory per transformer layer against Korthikanti et al.'s formulas.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198, Section 4 and Table 2) count the bytes one transformer layer keeps for
backward, per microbatch of b sequences, with 16-bit activations and 1-byte dropout masks.
bench/data/korthikanti_activations.json holds the formulas, their source and the rows evaluated
at the paper's four geometries (its Table 3: 22B, 175B, 530B, 1T, t = 8, microbatch 4 for
22B and 1 for the others);
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
DOC = [
    "Korthikanti et al.'s activation memory per transformer layer (bench/bench_activations.py "
    "compares explain with it; --write regenerates this file).",
    "Checked 2026-11-26 with the search tool; the PDF itself was not reachable. Formulas: "
    "every row agrees with aws-neuron/aws-neuron-sdk, "
    "libraries/neuronx-distributed/activation_memory_reduction.rst (sbh(34 + 5as/h); 10sbh "
    "left whole by tensor parallelism; sbh/t (34 + 5as/h) with sequence parallelism; 2sbh a "
    "layer under full recompute, 'a factor of t' less with tensor parallelism; 34sbh/t "
    "under selective recompute) and with a public transcription of the paper's Section 4.1, "
    "Eqs. 1-6 and Table 2 (found by its text; the tool named no repository), which quotes "
    "Section 4.1's breakdown word for word: attention 11sbh + 5as^2b, MLP 19sbh, layernorms "
    "4sbh; Table 2: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), sbh(34/t + 5as/(ht)), "
    "sbh(10 + 24/t), sbh(34/t), sbh(2). tp_sp_full (2sbh/t) is not a Table 2 row: Table 2 "
    "gives full recompute as 2sbh; with sequence parallelism the checkpointed layer input is "
    "itself split over t (as the neuron page says and Megatron does).",
    "Geometries: Table 3 as that transcription gives it (heads, hidden, layers, t, p, GPUs, "
    "global batch, microbatch): 22B 64, 6144, 48, 8, 1, 8, 4, 4; 175B 96, 12288, 96, 8, 8, "
    "64, 64, 1; 530B 128, 20480, 105, 8, 35, 280, 280, 1; 1T 160, 25600, 128, 8, 64, 512, "
    "512, 1; s = 2048, v = 51200 throughout. The hidden, heads and layers of 530B and 1T "
    "also match the Megatron SC'21 Table 1 rows (megatron_sc21_table1.json). Fixed against "
    "the first version of this file: 22B's microbatch is 4, not 1 (its rows are 4x).",
]

# technique -> (Table 2's formula, bytes per layer as a function of s, b, h, a, t)
FORMULAS = {
    "none": ("sbh(34 + 5as/h)", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    "tp": ("sbh(10 + 24/t + 5as/(ht))",
           lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    "tp_sp": ("sbh(34/t + 5as/(ht))",
              lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    "tp_selective": ("sbh(10 + 24/t)", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    "tp_sp_selective": ("sbh(34/t)", lambda s, b, h, a, t: s * b * h * 34 / t),
    "tp_full": ("2sbh", lambda s, b, h, a, t: 2 * s * b * h),
    # not a Table 2 row: full recompute keeps the layer's input (2sbh); under sequence
    # parallelism that input is itself split over the t ranks (Megatron checkpoints the split
    # tensor)
    "tp_sp_full": ("2sbh/t (Table 2's 2sbh, its input split by sequence parallelism)",
                   lambda s, b, h, a, t: 2 * s * b * h / t),
}
GEOMETRIES = [  # the paper's Table 3: b its microbatch, p pipeline, B global batch
    {"name": "22B", "a": 64, "h": 6144, "L": 48, "s": 2048, "b": 4, "t": 8, "p": 1,
     "gpus": 8, "B": 4},
    {"name": "175B", "a": 96, "h": 12288, "L": 96, "s": 2048, "b": 1, "t": 8, "p": 8,
     "gpus": 64, "B": 64},
    {"name": "530B", "a": 128, "h": 20480, "L": 105, "s": 2048, "b": 1, "t": 8, "p": 35,
     "gpus": 280, "B": 280},
    {"name": "1T", "a": 160, "h": 25600, "L": 128, "s": 2048, "b": 1, "t": 8, "p": 64,
     "gpus": 512, "B": 512},
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
            "_doc": DOC, "source": SOURCE,
            "units": "bytes one transformer layer keeps for backward, per microbatch of b "
                     "sequences: 16-bit activations, 1-byte dropout masks",
            "symbols": {"s": "sequence length", "b": "microbatch size", "h": "hidden size",
                        "a": "attention heads", "t": "tensor-parallel size",
                        "L": "layers (not in the per-layer formulas)",
                        "p": "pipeline-parallel size (not in them)",
                        "gpus": "GPUs of the run (not in them)",
                        "B": "global batch (not in them)"},
            "formulas": {k: v[0] for k, v in FORMULAS.items()},
            "geometries": GEOMETRIES,
            "rows": [{"geometry": g["name"], "technique": tech,
                      "bytes_per_layer": round(formula_bytes(tech, g))}
                     for g in GEOMETRIES for tech in FORMULAS],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
