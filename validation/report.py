"""The validation report: ``validation.json``, ``summary.md`` and PNG plots.

Files written to the output folder (``reports/`` for a GPU run, the committed
one; ``reports/sim/`` for a simulator run, git-ignored):

* ``validation.json``: everything measured (every case's metrics, every
  growth series, every planted-defect result), the run's configuration (seeds,
  dtypes, steps, command) and its provenance (``validation.provenance``: git
  commit, kernel-source hash, device name or "simulator", package versions,
  wall time). ``scripts/plot`` rebuilds the plots from it.
* ``summary.md``: the verdict, a table per kernel family (cases, worst ratio,
  worst abs error, defects caught/planted), the growth and ratio plots, the
  failures, and a ``kernel_source_hash:`` line.
* ``growth.png`` (one panel per kernel and dtype) and ``ratios.png``.

Freshness: a report describes the kernel sources it measured. When the code's
``kernel_source_hash()`` differs from the committed report's, the report is
stale; ``mark_stale`` (``scripts/validate --mark-stale``) writes a banner that
says so at the top of ``summary.md`` (and removes it when the hashes agree);
``tests/test_report_freshness.py`` fails while a stale report lacks it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from validation import plot
from validation.tolerance import RATIO

SCHEMA = "attention-validation/1"
JSON_NAME = "validation.json"
SUMMARY_NAME = "summary.md"
HASH_LINE = re.compile(r"kernel_source_hash:\s*`?([0-9a-f]+)`?")
STALE_MARK = "**STALE**"
STALE_START = "<!-- stale-banner -->"
STALE_END = "<!-- /stale-banner -->"
FAILING_CASE = ("fail", "error", "broken")
FAILING_GROWTH = ("fail", "error", "broken")
FAMILY_ORDER = ("decode", "batched_decode", "prefill", "mla", "mla_gemm")


# ---------------------------------------------------------------------------
# assembling and judging
# ---------------------------------------------------------------------------


def build(*, cases, growth, defect_units, broken_suites, config, provenance, wall_seconds):
    from validation.defects import aggregate

    report = {
        "schema": SCHEMA,
        "provenance": provenance,
        "config": config,
        "wall_seconds": wall_seconds,
        "cases": cases,
        "growth": growth,
        "defect_units": defect_units,
        "defects": aggregate(defect_units, broken_suites),
    }
    report["verdict"] = verdict(report)
    return report


def verdict(report):
    """{"passed": bool, "failures": [text]}: failing cases, growth runs and defect families."""
    failures = []
    for c in report["cases"]:
        if c["status"] in FAILING_CASE:
            failures.append(f"case {c['id']}: {c['status']}: {_first_line(c.get('detail', ''))}")
    for g in report["growth"]:
        if g["status"] in FAILING_GROWTH:
            failures.append(f"{g['id']}: {g['status']}: {_first_line(g.get('detail', ''))}")
    for f in report["defects"]:
        if not f["passed"]:
            why = []
            if f["escaped"]:
                why.append("escaped: " + ", ".join(f["escaped"]))
            if not f["clean_ok"]:
                why.append("clean run did not pass")
            if f["errors"]:
                why.append(f"{len(f['errors'])} error(s), first: "
                           f"{_first_line(str(f['errors'][0]))}")
            failures.append(f"defects {f['family']}: " + "; ".join(why))
    return {"passed": not failures, "failures": failures}


def _first_line(text):
    text = (text or "").strip()
    lines = text.splitlines()
    if not lines:
        return ""
    # tracebacks: the last line says what was raised
    return (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:300]


# ---------------------------------------------------------------------------
# family tables
# ---------------------------------------------------------------------------


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def spread_rows(report):
    """Per fixture, how far the sweep's baselines spread (``validation.baselines``):
    over the outputs of judged cases, the largest baseline error over the oracle
    order's (where that is not exact), and the passing cases that would fail
    against the oracle order alone (an output above 2 x its error + floor)."""
    rows = {}
    for c in report["cases"]:
        if c.get("status") not in ("pass", "fail"):
            continue
        outs = [o for o in c.get("outputs", {}).values() if "baseline_first_abs" in o]
        r = rows.setdefault(c["fixture"], {"fixture": c["fixture"], "outputs": 0,
                                           "spread": [], "by_envelope": []})
        r["outputs"] += len(outs)
        r["spread"] += [o["baseline_abs"] / o["baseline_first_abs"] for o in outs
                        if o["baseline_first_abs"] > 0]
        if c["status"] == "pass" and any(
                o["max_abs"] > RATIO * o["baseline_first_abs"] + o["floor"] for o in outs):
            r["by_envelope"].append(c["id"])
    return list(rows.values())


def family_rows(report):
    """One summary row per kernel family (ordered), from cases and defects."""
    fams = {}
    for c in report["cases"]:
        f = fams.setdefault(c["family"], {"family": c["family"], "kernels": [], "cases": 0,
                                          "pass": 0, "fail": 0, "unsupported": 0,
                                          "not available": 0, "worst_ratio": None,
                                          "worst_margin": None, "worst_abs": None,
                                          "worst_cos": None, "worst_case": None})
        if c["kernel"] not in f["kernels"]:
            f["kernels"].append(c["kernel"])
        st = c["status"]
        if st in ("pass", "fail", "error", "broken"):
            f["cases"] += 1
            f["pass" if st == "pass" else "fail"] += 1
        elif st in f:
            f[st] += 1
        if st in ("pass", "fail"):
            for key, field in (("worst_ratio", "ratio"), ("worst_margin", "margin"),
                               ("worst_abs", "max_abs"), ("worst_cos", "cos_diff")):
                v = c.get(field)
                if v is not None and (f[key] is None or v > f[key]):
                    f[key] = v
                    if key == "worst_margin":
                        f["worst_case"] = c["id"]
    for d in report["defects"]:
        f = fams.setdefault(d["family"], {"family": d["family"], "kernels": [], "cases": 0,
                                          "pass": 0, "fail": 0, "unsupported": 0,
                                          "not available": 0, "worst_ratio": None,
                                          "worst_margin": None, "worst_abs": None,
                                          "worst_cos": None, "worst_case": None})
        f["defects"] = d
    order = {name: i for i, name in enumerate(FAMILY_ORDER)}
    return sorted(fams.values(), key=lambda f: (order.get(f["family"], 99), f["family"]))


def _defect_cell(f, suites_ran=True):
    d = f.get("defects")
    if not d:
        return "no suite" if suites_ran else "not run"
    cell = f"{d['caught']}/{d['planted']}"
    if d["escaped"]:
        cell += f" (escaped: {', '.join(d['escaped'])})"
    if not d["clean_ok"]:
        cell += " (clean run failed)"
    if d["errors"]:
        cell += f" ({len(d['errors'])} error)"
    return cell


def kernel_shape_rows(report, family):
    """Per (kernel, shape) rows of one family: cases and worst metrics."""
    rows = {}
    for c in report["cases"]:
        if c["family"] != family or c["shape"] == "*":
            continue
        r = rows.setdefault((c["kernel"], c["shape"]), {
            "kernel": c["kernel"], "shape": c["shape"], "dims": c.get("dims"), "cases": 0,
            "pass": 0, "bad": 0, "unsupported": 0, "ratio": None, "margin": None, "abs": None,
            "cos": None})
        if c["status"] == "unsupported":
            r["unsupported"] += 1
            continue
        r["cases"] += 1
        r["pass" if c["status"] == "pass" else "bad"] += 1
        for key, field in (("ratio", "ratio"), ("margin", "margin"), ("abs", "max_abs"),
                           ("cos", "cos_diff")):
            v = c.get(field)
            if v is not None and (r[key] is None or v > r[key]):
                r[key] = v
    return list(rows.values())


def _dims_short(d):
    if not d:
        return ""
    parts = []
    for k, v in d.items():
        if isinstance(v, list):
            v = "[" + ",".join(str(x) for x in v[:6]) + (",..." if len(v) > 6 else "") + "]"
        parts.append(f"{k}={v}")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# summary.md
# ---------------------------------------------------------------------------


def summary_markdown(report, images):
    p, cfg, v = report["provenance"], report["config"], report["verdict"]
    cases = report["cases"]
    ran = [c for c in cases if c["status"] in ("pass", "fail", "error", "broken")]
    n_pass = sum(c["status"] == "pass" for c in cases)
    n_unsup = sum(c["status"] == "unsupported" for c in cases)
    n_na = sum(c["status"] == "not available" for c in cases)
    planted = sum(f["planted"] for f in report["defects"])
    caught_n = sum(f["caught"] for f in report["defects"])
    growth_ok = sum(g["status"] == "pass" for g in report["growth"])
    growth_ran = sum(g["status"] in ("pass", "fail", "error") for g in report["growth"])
    sim = p.get("device") == "simulator"
    L = []
    L.append("# Validation report")
    L.append("")
    L.append(f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}**. "
             f"{len(ran)} cases run, {n_pass} pass, {len(ran) - n_pass} fail; "
             f"{n_unsup} unsupported (dtype rejected by the kernel), "
             f"{n_na} kernel(s) not available. Error growth: {growth_ok}/{growth_ran} runs pass. "
             f"Planted defects caught: {caught_n}/{planted}.")
    L.append("")
    if sim:
        L.append("This run is on the **CUDA simulator** at small shapes (a quick check of "
                 "the pipeline, not the GPU evidence).")
        L.append("")
    L.append(f"kernel_source_hash: `{p.get('kernel_source_hash')}`")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    L.append(f"| git commit | `{p.get('git_commit')}` |")
    L.append(f"| device | {p.get('device')} |")
    versions = ", ".join(f"{k} {val}" for k, val in p.get("versions", {}).items())
    L.append(f"| versions | {versions} |")
    L.append(f"| host, time | {p.get('host')}, {p.get('timestamp')} |")
    L.append(f"| seeds | {', '.join(str(s) for s in cfg.get('seeds', []))} |")
    L.append(f"| dtypes | {', '.join(cfg.get('dtypes', []))} |")
    L.append(f"| sizes | {'simulator (small)' if cfg.get('small') else 'GPU (full)'}"
             f"{', quick subset' if cfg.get('quick') else ''} |")
    L.append(f"| growth steps | {cfg.get('steps')} |")
    L.append(f"| wall time | {report.get('wall_seconds', 0):.1f} s |")
    L.append(f"| command | `{cfg.get('command', '')}` |")
    L.append("")
    L.append("## How a case is judged")
    L.append("")
    L.append("Each output (attention output and LSE) is compared with the float64 oracle "
             "(`attention.oracle`, `mla.oracle`) and so are float32 baselines: the same oracle "
             "arithmetic run in float32 on the same inputs, with the q.k scores summed in each "
             "standard order (BLAS as the oracle's `@`, numpy's pairwise `sum`, a running "
             "sum) and the softmax scale applied after the dot product or folded into q "
             "(`validation/baselines.py`); the baseline error is the largest of the six. At "
             "well-conditioned scores they agree; at a near tie of large scores they differ "
             "several-fold, and one order alone would fail a correct kernel by chance. "
             "**ratio** = kernel max abs error / baseline max abs error. A case passes when "
             "NaN/inf sit where the oracle has them and kernel error <= 2 x baseline error + "
             "floor, i.e. ratio <= 2 up to the floor; "
             "**err/bound** is kernel error over that bound (<= 1 passes). "
             "floor = 8 x unit roundoff of the storage dtype x max(1, max|oracle|) "
             "(`validation/tolerance.py`): where the baseline is exact (one cached position; "
             "all-equal scores) a kernel that rounds a few more times (fast-math `exp`, an "
             "approximate reciprocal, another summation order) is a few roundings away and "
             "would otherwise show an infinite ratio; every planted defect is orders of "
             "magnitude above it. Hostile fixtures: NaN in unused cache slots and beyond each "
             "length, shuffled slot tables, scores up to +-1e4 (`large`), all-equal scores "
             "(`equal`).")
    L.append("")
    spread = [r for r in spread_rows(report) if r["outputs"]]
    if spread:
        L.append("| fixture | outputs judged | baseline spread (largest / oracle order), "
                 "median | max | cases passed by the spread alone |")
        L.append("|---|---|---|---|---|")
        for r in spread:
            sp = r["spread"]
            L.append(f"| {r['fixture']} | {r['outputs']} | "
                     f"{_fmt(statistics.median(sp) if sp else None)} | "
                     f"{_fmt(max(sp) if sp else None)} | {len(r['by_envelope'])} |")
        alone = [i for r in spread for i in r["by_envelope"]]
        if alone:
            L.append("")
            L.append("Passed by the spread alone (over 2 x the oracle order's error + floor): "
                     + ", ".join(f"`{i}`" for i in alone) + ".")
        L.append("")
    L.append("## Kernel families")
    L.append("")
    L.append("| family | kernels | cases | pass | fail | unsupported | worst ratio | "
             "worst err/bound | worst abs err | worst cos diff | defects caught/planted |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    fam_rows = family_rows(report)
    for f in fam_rows:
        L.append(f"| {f['family']} | {', '.join(f['kernels']) or '-'} | {f['cases']} | "
                 f"{f['pass']} | {f['fail']} | {f['unsupported']} | {_fmt(f['worst_ratio'])} | "
                 f"{_fmt(f['worst_margin'])} | {_fmt(f['worst_abs'], '.2e')} | "
                 f"{_fmt(f['worst_cos'], '.1e')} | "
                 f"{_defect_cell(f, bool(cfg.get('suites', True)))} |")
    L.append("")
    if "ratios.png" in images:
        L.append("![ratio per case](ratios.png)")
        L.append("")
    for f in fam_rows:
        rows = kernel_shape_rows(report, f["family"])
        if not rows:
            continue
        L.append(f"### {f['family']}")
        L.append("")
        L.append("| kernel | shape | dims | cases | pass | unsupported | worst ratio | "
                 "worst err/bound | worst abs err | worst cos diff |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            L.append(f"| {r['kernel']} | {r['shape']} | {_dims_short(r['dims'])} | {r['cases']} | "
                     f"{r['pass']} | {r['unsupported']} | {_fmt(r['ratio'])} | "
                     f"{_fmt(r['margin'])} | {_fmt(r['abs'], '.2e')} | {_fmt(r['cos'], '.1e')} |")
        L.append("")
    L.append("## Error growth over decode steps")
    L.append("")
    if report["growth"]:
        L.append("Each step appends one token through the real scatter/append kernels and "
                 "compares the output with the float64 full recompute (baseline: the float32 "
                 "recompute). The cache check compares the device cache after the run with the "
                 "rows appended, bit for bit, NaN everywhere else.")
        L.append("")
        L.append("| run | dtype | steps | status | final err | final baseline err | worst ratio | "
                 "worst err/bound | cache check | seconds |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for g in report["growth"]:
            L.append(f"| {g['kernel']} | {g['dtype']} | {g['steps']} | {g['status']} | "
                     f"{_fmt(g.get('final_err'), '.2e')} | {_fmt(g.get('final_base'), '.2e')} | "
                     f"{_fmt(g.get('worst_ratio'))} | {_fmt(g.get('worst_margin'))} | "
                     f"{'ok' if g.get('cache_ok') else ('-' if 'cache_ok' not in g else 'FAIL')} | "
                     f"{_fmt(g.get('seconds'), '.1f')} |")
        L.append("")
        if "growth.png" in images:
            L.append("![error growth](growth.png)")
            L.append("")
    else:
        L.append("No growth runs in this report.")
        L.append("")
    L.append("## Planted defects")
    L.append("")
    if report["defects"]:
        L.append("| family | clean run | caught/planted | defects | seconds |")
        L.append("|---|---|---|---|---|")
        for d in report["defects"]:
            names = ", ".join(f"{k}: {s}" for k, s in d["defects"].items()) or "-"
            L.append(f"| {d['family']} | {'pass' if d['clean_ok'] else 'FAIL'} | "
                     f"{d['caught']}/{d['planted']} | {names} | {_fmt(d.get('seconds'), '.1f')} |")
        L.append("")
    else:
        L.append("No planted-defect suites in this report.")
        L.append("")
    if v["failures"]:
        L.append("## Failures")
        L.append("")
        for text in v["failures"][:60]:
            L.append(f"- {text}")
        if len(v["failures"]) > 60:
            L.append(f"- ... and {len(v['failures']) - 60} more (validation.json)")
        L.append("")
    skipped = [c for c in cases if c["status"] in ("unsupported", "not available")]
    if skipped:
        L.append("## Not run")
        L.append("")
        seen = {}
        for c in skipped:
            key = (c["kernel"], c["dtype"] if c["status"] == "unsupported" else "*", c["status"])
            seen.setdefault(key, [0, _first_line(c.get("detail", ""))])[0] += 1
        for (kernel, dtype, status), (n, why) in seen.items():
            L.append(f"- {kernel} ({dtype}): {status}, {n} case(s): {why}")
        for g in report["growth"]:
            if g["status"] in ("unsupported", "not available"):
                L.append(f"- growth {g['kernel']} ({g['dtype']}): {g['status']}: "
                         f"{_first_line(g.get('detail', ''))}")
        L.append("")
    return "\n".join(L)


def write(report, out_dir):
    """Write validation.json, the plots and summary.md into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / JSON_NAME, "w") as fh:
        json.dump(report, fh, indent=1, default=_json_default)
    images = plot.plot_all(report, out)
    (out / SUMMARY_NAME).write_text(summary_markdown(report, images) + "\n")
    return out


def _json_default(x):
    import numpy as np

    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def load(out_dir):
    with open(Path(out_dir) / JSON_NAME) as fh:
        return json.load(fh)


# ---------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------


def shard_path(out_dir, index, count):
    return Path(out_dir) / "shards" / f"shard-{index}-of-{count}.json"


def merge(out_dir):
    """Merge ``<out_dir>/shards/shard-*-of-N.json`` into one report (not written).
    Raises ValueError when shards are missing or measured different code."""
    files = sorted((Path(out_dir) / "shards").glob("shard-*-of-*.json"))
    if not files:
        raise ValueError(f"no shard files in {Path(out_dir) / 'shards'}")
    parts = [json.load(open(f)) for f in files]
    counts = {p["config"]["shard"][1] for p in parts}
    if len(counts) != 1:
        raise ValueError(f"shard files of different splits: {sorted(counts)}")
    count = counts.pop()
    have = sorted(p["config"]["shard"][0] for p in parts)
    if have != list(range(count)):
        raise ValueError(f"shards present {have}, expected 0..{count - 1}")
    hashes = {p["provenance"]["kernel_source_hash"] for p in parts}
    if len(hashes) != 1:
        raise ValueError(f"shards measured different kernel sources: {sorted(hashes)}")
    cases, seen = [], set()
    growth, units, broken = [], [], []
    for p in parts:
        for c in p["cases"]:
            if c["id"] not in seen:
                seen.add(c["id"])
                cases.append(c)
        growth.extend(p["growth"])
        units.extend(p["defect_units"])
        broken.extend(b for b in p.get("broken_suites", []) if b not in broken)
    config = dict(parts[0]["config"], shard=None, merged_from=[str(f) for f in files])
    prov = dict(parts[0]["provenance"], devices=sorted({p["provenance"]["device"] for p in parts}))
    wall = max(p["wall_seconds"] for p in parts)
    return build(cases=cases, growth=growth, defect_units=units, broken_suites=broken,
                 config=config, provenance=prov, wall_seconds=wall)


# ---------------------------------------------------------------------------
# freshness
# ---------------------------------------------------------------------------


def summary_hash(text):
    """The kernel_source_hash a summary.md states (None if it states none)."""
    m = HASH_LINE.search(text)
    return m.group(1) if m else None


def has_stale_banner(text):
    return STALE_START in text and STALE_MARK in text


def _strip_banner(text):
    if STALE_START in text and STALE_END in text:
        head, rest = text.split(STALE_START, 1)
        _, tail = rest.split(STALE_END, 1)
        return (head + tail.lstrip("\n"))
    return text


def stale_banner(report_hash, code_hash):
    return (f"{STALE_START}\n> {STALE_MARK} This report measured kernel sources "
            f"`{report_hash}`; the code now hashes to `{code_hash}` "
            f"(`validation.provenance.kernel_source_hash()`). Its numbers describe older "
            f"kernels: re-run `scripts/validate` on a GPU to refresh it.\n{STALE_END}\n\n")


def freshness(out_dir):
    """{"state": "fresh"|"stale"|"missing", report_hash, code_hash, marked}."""
    from validation.provenance import kernel_source_hash

    out = Path(out_dir)
    code = kernel_source_hash()
    if not (out / JSON_NAME).exists():
        return {"state": "missing", "report_hash": None, "code_hash": code, "marked": False}
    rep = load(out)
    rh = rep["provenance"]["kernel_source_hash"]
    summary = (out / SUMMARY_NAME).read_text() if (out / SUMMARY_NAME).exists() else ""
    return {"state": "fresh" if rh == code else "stale", "report_hash": rh, "code_hash": code,
            "marked": has_stale_banner(summary), "device": rep["provenance"].get("device")}


def mark_stale(out_dir):
    """Add (stale) or remove (fresh) the STALE banner at the top of summary.md.
    Returns the freshness record after the change."""
    out = Path(out_dir)
    f = freshness(out)
    if f["state"] == "missing":
        return f
    path = out / SUMMARY_NAME
    text = _strip_banner(path.read_text() if path.exists() else "")
    if f["state"] == "stale":
        text = stale_banner(f["report_hash"], f["code_hash"]) + text
    path.write_text(text)
    return freshness(out)

