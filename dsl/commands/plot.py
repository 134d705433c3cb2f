"""`soapstone plot METRICS.jsonl... -o loss.png`: training curves from `run --metrics` files.

Two panels per image: the training loss and the eval loss (when the run evaluated) against the
step, and tokens/s. Several files are drawn over each other, labelled by file name. Needs
matplotlib (imported only here); a file that is not run's metrics is bad input (exit 2), and
so is an image path that cannot be written or has an extension matplotlib cannot write. Without
an extension the image gets matplotlib's default one, and the path printed is the one written.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.dsl.app.outputs import cannot_write, check_file
from soapstone.dsl.commands import fail
from soapstone.dsl.lang.errors import BadInput

# the keys drawn: each a number (run writes null for a non-finite loss); `step` an integer
DRAWN = ("loss", "eval_loss", "tokens_per_s")


def configure(parser: argparse.ArgumentParser) -> None:
    """METRICS..., -o."""
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl",
                        help="files `run --metrics` wrote")
    parser.add_argument("-o", "--output", required=True, metavar="PNG", help="the image")


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(step rows, eval rows) of a --metrics file; BadInput naming the line if malformed."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{path}: no such file")
    steps, evals = [], []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{n}: not a JSON line ({e.msg}); give the file "
                           "`run --metrics` wrote") from None
        if not isinstance(row, dict) or "step" not in row or \
                not ("loss" in row or "eval_loss" in row):
            raise BadInput(f"{path}:{n}: not a metrics line (no step and loss/eval_loss); "
                           "give the file `run --metrics` wrote")
        (evals if "eval_loss" in row else steps).append(checked_row(row, f"{path}:{n}"))
    if not steps:
        raise BadInput(f"{path}: no training steps in it")
    return steps, evals


def checked_row(row: dict, where: str) -> dict:
    """A metrics line whose step is an integer and whose drawn figures are numbers (null: NaN,
    a gap in the curve); BadInput naming the line otherwise."""
    step = row["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise BadInput(f"{where}: step {json.dumps(step)} is not a step number; give the file "
                       "`run --metrics` wrote")
    out = dict(row)
    for key in DRAWN:
        value = row.get(key, 0)
        if value is None:
            out[key] = math.nan
        elif not isinstance(value, int | float) or isinstance(value, bool):
            raise BadInput(f"{where}: {key} {json.dumps(value)} is not a number; give the "
                           "file `run --metrics` wrote")
    return out


def image_path(output: str) -> str:
    """The file savefig writes for -o OUTPUT: OUTPUT, or OUTPUT with matplotlib's default
    extension when it has none (BadInput: an extension matplotlib cannot write)."""
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    p = Path(output)
    if p.is_dir():  # check_file refuses it
        return output
    if not p.suffix:  # what savefig itself does with a bare name
        return f"{output.rstrip('.')}.{matplotlib.rcParams['savefig.format']}"
    kinds = FigureCanvasBase.get_supported_filetypes()
    if p.suffix[1:].lower() not in kinds:
        raise BadInput(f"-o {output}: matplotlib cannot write {p.suffix} images; give one of "
                       f"{', '.join('.' + k for k in sorted(kinds))}, e.g. -o "
                       f"{p.with_suffix('.png')}")
    return output


def main(args: argparse.Namespace) -> int:
    """Read every file, draw, write the image."""
    try:
        runs = [(Path(m).stem, *read_metrics(m)) for m in args.metrics]
        try:
            import matplotlib
        except ImportError:
            raise BadInput("plot needs matplotlib: pip install matplotlib") from None
        out = image_path(args.output)
        check_file(out, "-o", "loss.png", [("the metrics file", m) for m in args.metrics])
    except UserError as e:
        return fail(e)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, steps, evals in runs:
        x = [r["step"] + 1 for r in steps]
        line, = ax_loss.plot(x, [r["loss"] for r in steps], lw=1, label=f"{name} train")
        if evals:
            ax_loss.plot([r["step"] + 1 for r in evals], [r["eval_loss"] for r in evals], "o-",
                         color=line.get_color(), mfc="white", label=f"{name} eval")
        ax_speed.plot(x, [r.get("tokens_per_s", 0) for r in steps], lw=1,
                      color=line.get_color(), label=name)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_speed.set_ylabel("tokens/s")
    ax_speed.set_xlabel("step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        return fail(cannot_write("-o", out, e))
    print(f"plot: {out}")
    return 0
