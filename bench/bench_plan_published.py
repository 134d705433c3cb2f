"""The cost model against published runs: each row of bench/data/megatron_sc21_table1.json
(Megatron-LM PTD-P, SC'21 Table 1: GPT 1.7B..1T on A100 80GB, sequence 2048, vocab 51200,
full recompute) scored by `plan`'s cost model at the row's own layout, beside what was
published; the profile's fitted constants fitted again (`--fit`); and what `plan` chooses on
each row's GPUs (`--plan`).

The layout: the row's tensor and pipeline degrees, data parallel for the rest, 1F1B with
microbatches of one sample (Megatron's setting for these runs), ZeRO 0, `recompute layer`
(full recompute), bf16 (the A100's 16-bit peak: the paper ran fp16 at the same rate). The
predicted figures are the cost model's step time on the a100-80gb profile and explain's
memory for the fullest device.

Published TFLOP/s count the paper's F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration
(forward, backward and the recompute forward's GEMMs), so the comparison is made in that
convention: predicted TFLOP/s = F / (predicted step x GPUs); the published step is
F / (published TFLOP/s x GPUs). Beside them: the model TFLOP/s per device and MFU as `run`
and `explain --profile` count them (no recompute: 3/4 of F's layer terms).

Calibration: the rows are split in two. The odd rows (1, 3, 5, 7, 9) calibrate; the even rows
are held out, and the table marks them. `--fit` searches the profile's two fitted constants
(matmul_efficiency, op_overhead_us) on a grid, coarse then fine, for the least worst
|log(predicted / published)| over the calibration rows, and prints them beside profiles.json's.
torchtitan's Llama 3.1 rows (bench/data/torchtitan_llama3_h100.json) are scored too, on the
h100-96gb profile (their 500 W, 96 GB HBM2e H100s): each row's Llama at its layout (FSDP as
ZeRO-3 over data x cp, TP, PP, CP as the row states), bf16, the row's recompute (its
`selective` is torchtitan's op policy: soapstone's `recompute ops`), sequence 8192 where the
page leaves it to the benchmarked commit's configs, context parallel balanced (torchtitan ran
PyTorch's ring attention with its default load balancing: the data file's `cp_source`), fused
attention at the profile's measured attention curve; predicted TPS per GPU = published TPS x
published step / predicted step. Rows 1 and 9 calibrate h100-96gb's matmul_efficiency; every
other row is held out. The Float8 rows run `--precision float8` (the weight matmuls at the fp8
peak with their casts, the output projection in bf16 as torchtitan's converter leaves it; TP
with sequence parallelism, as torchtitan's TP plan); all are torch.compile rows, whose gain the
fit splits between eager and compiled rows as for bf16 (the model has no compile). TP's float8
all-gathers are modelled (e4m3 sequence-parallel gathers), FSDP's are not (soapstone's ZeRO-3
gathers bf16). AsyncTP rows score with `overlap tensor` (float8 rings: e4m3 chunks; row 12
beside ZeRO-3, rows 16-18 with sequence parallel inside balanced CP). The Megatron-LM README's
H100 rows are an image: its text states MFU ranges without layouts, nothing to score.

    .venv/bin/python bench/bench_plan_published.py [--fit] [--plan] [--json F] [--specs DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench/data/megatron_sc21_table1.json"
CALIBRATION = (0, 2, 4, 6, 8)  # 0-based: the paper's rows 1, 3, 5, 7, 9; the rest held out
TITAN = ROOT / "bench/data/torchtitan_llama3_h100.json"
TITAN_PROFILE = "h100-96gb"
TITAN_CALIBRATION_ROWS = (1, 9)  # the file's rows (bf16, FSDP 8 eager and FSDP 128 compiled)
# the one published pair that differs by AsyncTP alone (70B FSDP 32 x TP 8, float8, compiled):
# their ratio fits h100-96gb's ring_overlap; neither is held out of that fit
TITAN_RING_ROWS = (11, 12)
TITAN_EFFICIENCY = (0.20, 0.95)  # a 500 W H100: its grid reaches lower
# op_overhead_us held at 1 us, the grid's floor: the scored rows are one model at one batch
# per GPU, so they cannot tell a kernel's fixed cost from the matmul rate
TITAN_OVERHEAD_US = (1, 1)
EFFICIENCY = (0.50, 0.95)  # the grid's bounds: matmul_efficiency
# and op_overhead_us: at least 1 us, the gap a GPU leaves between two dependent kernels even
# when they are launched ahead (the fit is flat below it: it would say kernels cost nothing)
OVERHEAD_US = (1, 40)


def spec_text(row: dict, table: dict) -> str:
    """The row's GPT as .par text (tests/specs/gpt_1t.par's model with its sizes)."""
    h = row["hidden"]
    return f"""model gpt {{
  dim batch = {row['batch']}, seq = {table['seq']}, hidden = {h}, heads = {row['heads']}, \
ffn = {4 * h}, vocab = {table['vocab']}

  input tokens  : i64[batch, seq]
  input targets : i64[batch, seq]

  x = embedding(tokens, vocab -> hidden)
  repeat {row['layers']} as layer {{
    x = x + attention(layernorm(x), heads = heads, causal = true)
    x = x + mlp(layernorm(x), ffn, activation = gelu)
  }}
  logits = linear(layernorm(x), hidden -> vocab)
  output loss = cross_entropy(logits, targets)
}}
"""


def megatron_flops(row: dict, table: dict) -> float:
    """The paper's Eq. 3: one iteration's GEMM FLOPs with full recompute."""
    b, s, v = row["batch"], table["seq"], table["vocab"]
    l, h = row["layers"], row["hidden"]
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def published_step(row: dict, table: dict) -> float:
    """The published run's seconds per iteration, from its TFLOP/s per GPU."""
    return megatron_flops(row, table) / (row["tflops_per_gpu"] * 1e12 * row["gpus"])


def load_table() -> dict:
    """The Table 1 data file."""
    return json.loads(DATA.read_text())


class Rows:
    """Each row's model, planner and published layout, compiled once; scored on any
    profile (the fit swaps the profile's constants, not the compiles)."""

    def __init__(self, table: dict, profile=None):
        from soapstone.dsl import load
        from soapstone.dsl.search.plan_search import Planner
        from soapstone.dsl.search.space import Candidate
        from soapstone.shard.plan.analysis.hardware import load_profile

        self.table = table
        self.profile = profile or load_profile(table["device"])
        self.items = []
        for row in table["rows"]:
            model = load(spec_text(row, table)).model()
            planner = Planner(model, self.profile, precision="bf16", recompute=("layer",),
                              always_recompute=True)
            t, p = row["tensor"], row["pipeline"]
            d = row["gpus"] // (t * p)
            c = Candidate(d, t, p, schedule="1f1b", microbatches=row["batch"] // d, zero=0,
                          recompute="layer")
            self.items.append((row, planner, c))

    def results(self, profile=None, rows=None) -> list:
        """Each row's costed published layout (plan_search.Result) on `profile` (of `rows`,
        indices, only where given: None in the others' places)."""
        out = []
        for i, (_, planner, c) in enumerate(self.items):
            if rows is not None and i not in rows:
                out.append(None)
                continue
            planner.profile = profile or self.profile
            out.append(planner.cost(c))
        return out

    def published(self, i: int) -> float:
        """Row i's published seconds per step."""
        return published_step(self.items[i][0], self.table)

    def ratios(self, profile=None, rows=None) -> list[float]:
        """Predicted / published step time of `rows` (indices; all by default)."""
        got = self.results(profile, rows)
        return [got[i].time.total / self.published(i)
                for i in (range(len(got)) if rows is None else rows)]


# ---- torchtitan's Llama 3.1 rows on H100 ------------------------------------------------


def llama_text(geom: dict, batch: int, seq: int, vocab: int, rope: float) -> str:
    """A Llama 3.1 model as .par text (examples/llama.par's blocks with the row's sizes); its
    output projection keeps bf16 under float8, as torchtitan's Float8 converter skips it
    (`module_filter_fn=lambda mod, fqn: fqn != "output"`)."""
    return f"""model llama {{
  dim batch = {batch}, seq = {seq}, hidden = {geom['hidden']}, heads = {geom['heads']}, \
kv_heads = {geom['kv_heads']}, ffn = {geom['ffn']}, vocab = {vocab}

  input tokens  : i64[batch, seq]
  input targets : i64[batch, seq]

  x = embedding(tokens, vocab -> hidden)
  repeat {geom['layers']} as layer {{
    x = x + attention(rmsnorm(x), heads = heads, kv_heads = kv_heads, rope = {rope},
                      bias = false)
    x = x + mlp(rmsnorm(x), ffn, activation = silu, gated = true, bias = false)
  }}
  logits = linear(rmsnorm(x), hidden -> vocab, bias = false, float8 = false)
  output loss = cross_entropy(logits, targets)
}}
"""


def load_titan() -> dict:
    """The torchtitan data file."""
    return json.loads(TITAN.read_text())


def titan_precision(row: dict) -> str:
    """The row's --precision: float8 where torchtitan ran its linears in Float8, else bf16."""
    return "float8" if "float8" in row["techniques"] else "bf16"


def titan_candidate(row: dict):
    """The row's layout as a plan Candidate: FSDP as ZeRO-3 over data x cp (torchtitan
    reshards after forward), TP with sequence parallelism (torchtitan's TP plan shards the
    norms' sequence: SequenceParallel), the local batch in one microbatch (or the pipeline
    degree's microbatches), selective recompute as `recompute ops` (module doc)."""
    from soapstone.dsl.search.space import Candidate

    # torchtitan's `selective` is its op policy: soapstone's `recompute ops`
    recompute = "ops" if row["recompute"] == "selective" else "layer"
    p = row["pipeline"]
    zero = 3 if p == 1 else 2
    # AsyncTP as `overlap tensor`, float8 rings included
    overlap = "AsyncTP" in row["techniques"] and row["tensor"] > 1
    return Candidate(row["fsdp"], row["tensor"], p, sequence=row["tensor"] > 1,
                     zero=zero, overlap=overlap,
                     schedule="interleaved" if row.get("schedule") == "interleaved" else "1f1b",
                     microbatches=row.get("microbatches", 1),
                     chunks=2 if row.get("schedule") == "interleaved" else 1,
                     context=row["context"], recompute=recompute)


class TitanRows(Rows):
    """torchtitan's rows (bf16, or float8 where they ran Float8 linears), compiled once."""

    def __init__(self, table: dict, profile=None):
        from soapstone.dsl import load
        from soapstone.dsl.search.plan_search import Planner
        from soapstone.shard.plan.analysis.hardware import load_profile

        self.table = table
        self.profile = profile or load_profile(TITAN_PROFILE)
        self.items = []
        geom = table["geometry"]
        for row in table["rows"]:
            dp = row["fsdp"]
            text = llama_text(geom[row["model"]], row["local_batch"] * dp, row["seq"],
                              geom["vocab"], geom["rope"])
            c = titan_candidate(row)
            planner = Planner(load(text).model(), self.profile, precision=titan_precision(row),
                              recompute=(c.recompute,), always_recompute=True)
            self.items.append((row, planner, c))
        self.numbers = list(range(1, len(table["rows"]) + 1))  # every row is scored
        # the calibration rows' places among the scored ones (matmul_efficiency's; and the
        # pair ring_overlap is fitted to)
        self.calibration = tuple(self.numbers.index(n) for n in TITAN_CALIBRATION_ROWS)
        self.ring_pair = tuple(self.numbers.index(n) for n in TITAN_RING_ROWS)

    def published(self, i: int) -> float:
        """Row i's published seconds per step: its local batch's tokens (every GPU of a
        data-parallel group shares them) over TPS/GPU x the group's GPUs."""
        row = self.items[i][0]
        group = row["tensor"] * row["pipeline"] * row["context"]
        return row["local_batch"] * row["seq"] / (row["tps_per_gpu"] * group)


def titan_rows_scored(rows: TitanRows) -> list[dict]:
    """Each scored torchtitan row: predicted vs published TPS per GPU and memory."""
    out = []
    for i, ((row, _, c), r) in enumerate(zip(rows.items, rows.results(), strict=True)):
        pub = rows.published(i)
        out.append({"row": rows.numbers[i], "model": row["model"], "layout": c.label,
                    "gpus": row["gpus"], "techniques": row["techniques"],
                    "held_out": i not in rows.calibration + rows.ring_pair,
                    "published_tps": row["tps_per_gpu"],
                    "predicted_tps": row["tps_per_gpu"] * pub / r.time.total,
                    "ratio": pub / r.time.total, "published_step_s": pub,
                    "predicted_step_s": r.time.total, "mfu": r.score.mfu,
                    "published_memory_gib": row["memory_gib"],
                    "memory_gib": r.memory / 2**30, "fits": r.fits,
                    "exposed_comm_s": r.time.param_gathers + r.time.grad_sync,
                    "source": row["source"]})
    return out


def titan_text(scored: list[dict]) -> str:
    """The torchtitan rows as a markdown table."""
    out = ["| row | model | techniques | layout | GPUs | published TPS/GPU | predicted | "
           "pred / pub | step s pub / pred | MFU | memory GiB pub / pred |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in scored:
        mark = " (held out)" if r["held_out"] else ""
        out.append(f"| {r['row']}{mark} | {r['model']} | {r['techniques']} | {r['layout']} | "
                   f"{r['gpus']} | {r['published_tps']} | {r['predicted_tps']:.0f} | "
                   f"{r['ratio']:.3f} | {r['published_step_s']:.2f} / "
                   f"{r['predicted_step_s']:.2f} | {r['mfu']:.0%} | "
                   f"{r['published_memory_gib']} / {r['memory_gib']:.1f}"
                   f"{'' if r['fits'] else ' (no fit)'} |")
    out.append("")
    return "\n".join(out) + "\n"


def worst(ratios: list[float]) -> float:
    """The fit's objective: the largest |log(predicted / published)|."""
    return max(abs(math.log(r)) for r in ratios)


def fit(rows, which=CALIBRATION, efficiency=EFFICIENCY, overhead_us=OVERHEAD_US) -> dict:
    """The constants that minimise `worst` over the rows `which`: a grid of matmul_efficiency
    (step 0.05, then 0.01 around the best) x op_overhead_us (step 5, then 1 around it),
    within the bounds `efficiency` and `overhead_us`."""
    def score(eff: float, us: float) -> tuple[float, float, float]:
        prof = attrs.evolve(rows.profile, matmul_efficiency=eff, op_overhead_s=us * 1e-6)
        return worst(rows.ratios(prof, which)), eff, us

    lo, hi = efficiency
    coarse = min(score(round(lo + 0.05 * i, 2), float(us))
                 for i in range(round((hi - lo) / 0.05) + 1)
                 for us in range(overhead_us[0], overhead_us[1] + 1, 5))
    _, e0, u0 = coarse
    fine = min(score(round(e0 + 0.01 * i, 2), float(us))
               for i in range(-4, 5) if lo <= e0 + 0.01 * i <= hi
               for us in range(max(overhead_us[0], int(u0) - 4),
                               min(overhead_us[1], int(u0) + 4) + 1))
    best, eff, us = fine
    prof = attrs.evolve(rows.profile, matmul_efficiency=eff, op_overhead_s=us * 1e-6)
    r = rows.ratios(prof, which)
    return {"matmul_efficiency": eff, "op_overhead_us": us, "worst_log": best,
            "ratio_min": min(r), "ratio_max": max(r)}


def fit_ring_overlap(rows: TitanRows) -> dict:
    """The profile's ring_overlap that gives the AsyncTP pair (TITAN_RING_ROWS) its published
    step ratio: a grid 0..1 (step 0.01) least |log(predicted ratio / published ratio)|; the
    pair's other constants as the profile has them."""
    a, b = rows.ring_pair

    def miss(f: float) -> float:
        prof = attrs.evolve(rows.profile, ring_overlap=f)
        got = rows.results(prof, [a, b])
        pred = got[b].time.total / got[a].time.total
        return abs(math.log(pred / (rows.published(b) / rows.published(a))))

    best = min((miss(i / 100), i / 100) for i in range(101))
    return {"ring_overlap": best[1], "worst_log": best[0],
            "published_gain": rows.published(a) / rows.published(b)}


def score_rows(rows: Rows) -> list[dict]:
    """The cost model's figures for each published row at its layout."""
    out = []
    for i, ((row, _, c), r) in enumerate(zip(rows.items, rows.results(), strict=True)):
        f = megatron_flops(row, rows.table)
        predicted = f / (r.time.total * row["gpus"]) / 1e12
        out.append({"params_b": row["params_b"], "layout": c.label, "gpus": row["gpus"],
                    "held_out": i not in CALIBRATION,
                    "published_tflops": row["tflops_per_gpu"], "predicted_tflops": predicted,
                    "ratio": predicted / row["tflops_per_gpu"],
                    "published_step_s": published_step(row, rows.table),
                    "predicted_step_s": r.time.total,
                    "model_tflops": r.score.tflops_per_device, "mfu": r.score.mfu,
                    "memory_bytes": r.memory, "fits": r.fits, "bubble": r.estimate.bubble,
                    "source": row["source"]})
    return out


def plan_rows(rows: Rows) -> list[dict]:
    """What `plan` chooses on each row's GPUs (recompute always, as the runs did), against the
    row's own tensor x pipeline degrees; and the headroom bounds each row puts on the
    profile's `fit.memory_fraction` (`memory_bounds`)."""
    from soapstone.dsl.search.plan_search import search, versus_published

    out = []
    for row, planner, _ in rows.items:
        planner.profile = rows.profile
        plan = search(planner, row["gpus"])
        c = plan.best.candidate
        lo, hi = memory_bounds(plan, row["tensor"], row["pipeline"])
        out.append({"params_b": row["params_b"], "published": f"t{row['tensor']} "
                    f"p{row['pipeline']}", "chosen": c.label,
                    "same": (c.tensor, c.pipe) == (row["tensor"], row["pipeline"]),
                    "versus": versus_published(plan, row["tensor"], row["pipeline"]),
                    "memory_fraction_bounds": [lo, hi]})
    return out


def memory_bounds(plan, tensor: int, pipe: int) -> tuple[float | None, float | None]:
    """The headroom (fraction of usable memory, `fit.memory_fraction`) at which plan keeps the
    row's tensor x pipeline split (plan_search.winner_first on the row's costed layouts): the
    least and the most on a grid 0.50..1.00, step 0.005; None where no value keeps it."""
    from soapstone.dsl.search.plan_search import winner_first

    ranked = sorted(plan.ranked, key=lambda r: r.time.total)
    keeps = []
    for i in range(101):
        f = round(0.5 + 0.005 * i, 3)
        prof = attrs.evolve(plan.profile, fit=plan.profile.fit | {"memory_fraction": f})
        c = winner_first(ranked, prof, len(plan.model.blocks))[0].candidate
        if (c.tensor, c.pipe) == (tensor, pipe):
            keeps.append(f)
    return (min(keeps), max(keeps)) if keeps else (None, None)


def table_text(scored: list[dict]) -> str:
    """The rows as a markdown table."""
    out = ["| params | layout | GPUs | published TFLOP/s | predicted | pred / pub | step s pub "
           "/ pred | model TFLOP/s, MFU | memory/GPU |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in scored:
        mark = " (held out)" if r["held_out"] else ""
        out.append(f"| {r['params_b']}B{mark} | {r['layout']} | {r['gpus']} | "
                   f"{r['published_tflops']} | {r['predicted_tflops']:.0f} | "
                   f"{r['ratio']:.3f} | {r['published_step_s']:.1f} / "
                   f"{r['predicted_step_s']:.1f} | {r['model_tflops']:.0f}, {r['mfu']:.0%} | "
                   f"{r['memory_bytes'] / 2**30:.1f} GiB{'' if r['fits'] else ' (no fit)'} |")
    return "\n".join(out) + "\n"


def plan_text(planned: list[dict]) -> str:
    """What plan chose per row, as a markdown table."""
    out = ["| params | published | plan chose | same TP x PP | versus the published |",
           "|---|---|---|---|---|"]
    out += [f"| {p['params_b']}B | {p['published']} | {p['chosen']} | "
            f"{'yes' if p['same'] else 'no'} | {p['versus']} |" for p in planned]
    same = sum(p["same"] for p in planned)
    cal = [planned[i]["memory_fraction_bounds"] for i in CALIBRATION]
    lo = max((b[0] for b in cal if b[0] is not None), default=0.0)
    hi = min((b[1] for b in cal if b[1] is not None), default=1.0)
    return "\n".join(out) + f"\n\nplan returns the published TP x PP on {same} of " \
        f"{len(planned)} rows; the calibration rows bound fit.memory_fraction to " \
        f"{lo:.3f}..{hi:.3f}\n"


def titan_report(fit_again: bool) -> tuple[str, dict]:
    """torchtitan's rows scored on h100-96gb (and its constants fitted again)."""
    table = load_titan()
    rows = TitanRows(table)
    prof = rows.profile
    scored = titan_rows_scored(rows)
    cal = [r["ratio"] for r in scored if not r["held_out"]]
    held = [r["ratio"] for r in scored if r["held_out"]]
    text = (f"{table['source']}; {prof.name} (matmul_efficiency {prof.matmul_efficiency}, "
            f"op_overhead_us {prof.op_overhead_s * 1e6:g}), bf16 or float8 as the row ran "
            f"(float8's MFU over the bf16 peak), seq and layouts as the data file states\n\n" +
            titan_text(scored) +
            f"\npredicted / published TPS per GPU: calibration rows {min(cal):.3f}.."
            f"{max(cal):.3f}, held-out rows {min(held):.3f}..{max(held):.3f}\n")
    data: dict = {"rows": scored}
    if fit_again:
        got = fit(rows, rows.calibration, TITAN_EFFICIENCY, TITAN_OVERHEAD_US)
        text += (f"\nfit on rows {', '.join(str(rows.numbers[i]) for i in rows.calibration)}"
                 f": matmul_efficiency {got['matmul_efficiency']} (op_overhead_us held at "
                 f"{got['op_overhead_us']:g}; worst |log ratio| {got['worst_log']:.4f}, ratios "
                 f"{got['ratio_min']:.3f}..{got['ratio_max']:.3f}); profiles.json has "
                 f"{prof.matmul_efficiency}, {prof.op_overhead_s * 1e6:g}\n")
        data["fit"] = got
        ring = fit_ring_overlap(rows)
        text += (f"ring_overlap fit on rows {TITAN_RING_ROWS[0]} and {TITAN_RING_ROWS[1]} "
                 f"(AsyncTP's published gain {ring['published_gain']:.3f}x): "
                 f"{ring['ring_overlap']} (|log| miss {ring['worst_log']:.4f}); profiles.json "
                 f"has {prof.ring_overlap}\n")
        data["ring_fit"] = ring
    return text, data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true",
                    help="fit the profile's constants on the calibration rows again")
    ap.add_argument("--plan", action="store_true", help="run plan on each row's GPUs")
    ap.add_argument("--json", metavar="F", help="also write the rows as JSON")
    ap.add_argument("--specs", metavar="DIR",
                    help="write each row's model as DIR/gpt_<params>b.par and print the "
                         "`soapstone plan` command for it")
    args = ap.parse_args()
    table = load_table()
    if args.specs:
        Path(args.specs).mkdir(parents=True, exist_ok=True)
        for row in table["rows"]:
            path = Path(args.specs) / f"gpt_{row['params_b']:g}b.par"
            path.write_text(spec_text(row, table))
            print(f"soapstone plan {path} --world {row['gpus']} --profile {table['device']} "
                  "--precision bf16 --recompute always")
        return 0
    rows = Rows(table)
    prof = rows.profile
    scored = score_rows(rows)
    cal = [r["ratio"] for r in scored if not r["held_out"]]
    held = [r["ratio"] for r in scored if r["held_out"]]
    sys.stdout.write(
        f"{table['source']}; {table['device']} (matmul_efficiency {prof.matmul_efficiency}, "
        f"op_overhead_us {prof.op_overhead_s * 1e6:g}), seq {table['seq']}, vocab "
        f"{table['vocab']}, full recompute\n\n" + table_text(scored) +
        f"\npredicted / published TFLOP/s: calibration rows {min(cal):.3f}..{max(cal):.3f}, "
        f"held-out rows {min(held):.3f}..{max(held):.3f}\n")
    data: dict = {"rows": scored}
    if args.fit:
        got = fit(rows)
        sys.stdout.write(f"\nfit on rows {', '.join(str(i + 1) for i in CALIBRATION)}: "
                         f"matmul_efficiency {got['matmul_efficiency']}, op_overhead_us "
                         f"{got['op_overhead_us']:g} (worst |log ratio| "
                         f"{got['worst_log']:.4f}, ratios {got['ratio_min']:.3f}.."
                         f"{got['ratio_max']:.3f}); profiles.json has "
                         f"{prof.matmul_efficiency}, {prof.op_overhead_s * 1e6:g}\n")
        data["fit"] = got
    text, data["torchtitan"] = titan_report(args.fit)
    sys.stdout.write("\n" + text)
    if args.plan:
        planned = plan_rows(rows)
        sys.stdout.write("\n" + plan_text(planned))
        data["plan"] = planned
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
