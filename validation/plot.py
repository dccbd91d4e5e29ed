"""Plots of a validation report, rebuilt from its JSON alone.

    python -m validation.plot [--json reports] [--out DIR]

* ``growth.png``: one panel per (growth run kernel, dtype): max abs error of
  the output against the float64 recompute at every decode step, log scale,
  the kernel beside the float32 baseline, with the pass bound (2 x baseline +
  floor) dotted. Exact steps (error 0) are left out of the log axis.
* ``ratios.png``: one panel per kernel family: every case's ratio (kernel error
  / baseline error, log scale) with the line ratio = 2; hollow markers are
  cases above 2 that pass by the rounding floor, red ones fail.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    """Write ``fig`` as a PNG of at most 256 colours (pillow's median cut): the
    growth figure's thousands of anti-aliased steps come out at a third of the
    bytes of the full-colour file (4.2 MB -> 1.5 MB for 26 runs of 1024 steps),
    and these files are kept in the repository. Full colour where pillow is
    missing."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    try:
        from PIL import Image
    except ImportError:
        Path(path).write_bytes(buf.getvalue())
        return
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
            path, format="PNG", optimize=True)


def _positive(values):
    return [v if (v is not None and v > 0 and math.isfinite(v)) else float("nan")
            for v in values]


def plot_growth(report, out_dir):
    runs = [g for g in report.get("growth", []) if g.get("series")]
    if not runs:
        return None
    plt = _pyplot()
    n = len(runs)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    # constrained layout places the figure title above the top row of panels
    # (tight_layout ignores suptitle, which then overlapped the first panel's title)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.0 * rows), squeeze=False,
                             layout="constrained")
    for ax, g in zip(axes.flat, runs):
        s = g["series"]
        lw = 1.2 if len(s["step"]) <= 200 else 0.6
        ax.plot(s["step"], _positive(s["out_err"]), "-", lw=lw, label="kernel")
        ax.plot(s["step"], _positive(s["out_base"]), "--", lw=lw, label="float32 baseline")
        ax.plot(s["step"], _positive(s["out_bound"]), ":", lw=1.0, color="grey",
                label="bound (2 x baseline + floor)")
        ax.set_yscale("log")
        ax.set_xlabel("decode step")
        ax.set_ylabel("max abs error vs float64")
        ax.set_title(f"{g['kernel']} ({g['dtype']}): {g['status']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    device = report.get("provenance", {}).get("device", "")
    fig.suptitle(f"Error growth over decode steps ({device})", fontsize=13)
    path = Path(out_dir) / "growth.png"
    _save(fig, path)
    plt.close(fig)
    return path.name


def plot_ratios(report, out_dir):
    fams = {}
    for c in report.get("cases", []):
        if c.get("status") in ("pass", "fail") and c.get("ratio") is not None:
            fams.setdefault(c["family"], []).append(c)
    if not fams:
        return None
    plt = _pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    n = len(fams)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, layout="constrained")
    for ax, (family, cs) in zip(axes.flat, sorted(fams.items())):
        shown = [c for c in cs if c["ratio"] > 0]  # ratio 0: kernel and baseline both exact
        finite = [c["ratio"] for c in shown if c["ratio"] < math.inf]
        top = max(finite + [2.0]) * 4
        for i, c in enumerate(shown):
            r = c["ratio"]
            y = top if r == math.inf else r
            if c["status"] == "fail":
                ax.plot(i, y, "o", color="red", ms=4)
            elif r > 2:
                ax.plot(i, y, "o", mfc="none", color="tab:blue", ms=4)
            else:
                ax.plot(i, y, "o", color="tab:blue", ms=3)
        ax.axhline(2.0, color="grey", ls="--", lw=1)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        exact = len(cs) - len(shown)
        ax.set_title(f"{family}: {len(cs)} cases" + (f" ({exact} exact)" if exact else ""))
        ax.set_xlabel("case")
        ax.set_ylabel("kernel err / baseline err")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("ratio per case (dashed: 2; hollow: above 2 but within the rounding floor; "
                 "red: fail; top edge: baseline exact)", fontsize=9)
    path = Path(out_dir) / "ratios.png"
    _save(fig, path)
    plt.close(fig)
    return path.name


def plot_all(report, out_dir):
    """Write every plot; returns the file names written."""
    names = [plot_growth(report, out_dir), plot_ratios(report, out_dir)]
    return [n for n in names if n]


def main(argv=None):
    from validation.provenance import ROOT

    ap = argparse.ArgumentParser(prog="scripts/plot",
                                 description="Rebuild the validation plots from the JSON report.")
    ap.add_argument("--json", default=str(ROOT / "reports"),
                    help="a report: its folder, validation.json or validation.json.gz "
                         "(default: reports)")
    ap.add_argument("--out", help="folder for the PNGs (default: the JSON's folder)")
    args = ap.parse_args(argv)
    path = Path(args.json)
    if not path.exists():
        print(f"plot: {path} does not exist (run scripts/validate first)", file=sys.stderr)
        return 2
    from validation.report import read

    report = read(path)
    out = Path(args.out) if args.out else (path if path.is_dir() else path.parent)
    out.mkdir(parents=True, exist_ok=True)
    for name in plot_all(report, out):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
