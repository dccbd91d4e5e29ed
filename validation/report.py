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

import hashlib
import json
import math
import re
import statistics
from pathlib import Path

from validation import plot

SCHEMA = "attention-validation/1"
JSON_NAME = "validation.json"
JSON_GZ_NAME = JSON_NAME + ".gz"  # an archived run's report (``scripts/validate --archive``)
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


def build(*, cases, growth, defect_units, broken_suites, config, provenance, wall_seconds,
          quantization=None, work_groups=None):
    """The report dict. ``quantization``: the fp8 format's error table
    (``validation.fp8_quant.table``), rows shown in the summary as they are.
    ``work_groups``: each work group's wall time (``validation.cli.execute``'s
    ``timings``), the longest first."""
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
        "quantization": list(quantization or []),
        "work_groups": sorted(work_groups or [], key=_group_order),
    }
    report["verdict"] = verdict(report)
    return report


def _group_order(g):
    """Unfinished groups first (running, then not started), then by seconds, longest
    first."""
    rank = {"running": 0, "not started": 1}.get(g.get("state"), 2)
    return rank, -(g.get("seconds") or 0.0)


def work_group_line(report, top=5):
    """The summary's line on where the run's worker time went (None without
    timings): the longest groups, and those a --deadline cut off."""
    groups = report.get("work_groups") or []
    if not groups:
        return None
    done = [g for g in groups if g.get("state") == "done"]
    cut = [g for g in groups if g.get("state") in ("running", "not started")]
    text = f"{sum(g['seconds'] for g in done):.0f} worker-s in {len(done)} finished groups"
    if done:
        text += "; longest: " + ", ".join(f"{g['group']} {g['seconds']:.0f} s"
                                          for g in sorted(done, key=_group_order)[:top])
    if cut:
        running = [g["group"] for g in cut if g["state"] == "running"]
        text += (f"; at the deadline {len(running)} running or queued to a worker"
                 + (f" ({', '.join(running[:top])}{', ...' if len(running) > top else ''})"
                    if running else "")
                 + f", {len(cut) - len(running)} not started")
    crashed = [g["group"] for g in groups if g.get("state") == "crashed"]
    if crashed:
        text += f"; worker crashed in {len(crashed)} ({', '.join(crashed[:top])})"
    return text


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
    rows = resolving_rows(report)
    for r in rows:
        if r["errors"]:
            failures.append(f"mutant {r['kernel']}/{r['mutant']} raised on {len(r['errors'])} "
                            f"case(s), first {r['errors'][0]} (a crash is not a catch)")
    caught, detectable = resolving_power(report)
    if detectable and caught < MIN_RESOLVING_POWER * detectable:
        failures.append(f"resolving power: the judge caught {caught} of {detectable} "
                        f"detectable mutant cases, under {MIN_RESOLVING_POWER:.0%}")
    return {"passed": not failures, "failures": failures}


MIN_RESOLVING_POWER = 0.9  # of the detectable mutant cases, the judge must catch this share


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


def baseline_rows(report):
    """Per kernel: its baseline order(s) (``validation.baselines``), the outputs
    judged and how many break each rule, and the median kernel error over the
    oracle code's own float32 error (context: the order the oracle happens to use)."""
    rows = {}
    for c in report["cases"]:
        if c.get("status") not in ("pass", "fail"):
            continue
        r = rows.setdefault(c["kernel"], {"kernel": c["kernel"], "orders": set(), "outputs": 0,
                                          "max": 0, "mean": 0, "nonfinite": 0, "ratio": [],
                                          "plain": []})
        if c.get("baseline"):
            r["orders"].add(c["baseline"])
        for o in c.get("outputs", {}).values():
            r["outputs"] += 1
            for rule in o.get("failed_by", ()):
                r[rule] += 1
            if o.get("baseline_abs"):
                r["ratio"].append(o["max_abs"] / o["baseline_abs"])
            if o.get("plain_abs"):
                r["plain"].append(o["max_abs"] / o["plain_abs"])
    return list(rows.values())


def resolving_rows(report):
    """The judge's resolving power, per (kernel, mutant), from the cases that ran
    their precision mutants: applicable cases (the mutant changed the output),
    how many exceed the baseline's error, how many are detectable (over 2x it),
    how many of those the judge caught, and the detectable cases it missed."""
    rows = {}
    for c in report["cases"]:
        for name, m in (c.get("mutants") or {}).items():
            r = rows.setdefault((c["kernel"], name), {
                "kernel": c["kernel"], "mutant": name, "cases": 0, "inert": 0, "errors": [],
                "exceeds": 0, "detectable": 0, "caught_detectable": 0, "caught_other": 0,
                "missed": [], "by_rule": {}})
            if "error" in m:
                r["errors"].append(c["id"])
                continue
            if m["inert"]:
                r["inert"] += 1
                continue
            r["cases"] += 1
            r["exceeds"] += m["exceeds"]
            if m["detectable"]:
                r["detectable"] += 1
                if m["caught"]:
                    r["caught_detectable"] += 1
                else:
                    r["missed"].append(c["id"])
            elif m["caught"]:
                r["caught_other"] += 1
            for rule in m.get("failed_by", ()):
                r["by_rule"][rule] = r["by_rule"].get(rule, 0) + 1
    return sorted(rows.values(), key=lambda r: (r["kernel"], r["mutant"]))


def resolving_power(report):
    """(caught, detectable) over every (kernel, mutant) of the report."""
    rows = resolving_rows(report)
    return (sum(r["caught_detectable"] for r in rows), sum(r["detectable"] for r in rows))


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


def headline_counts(report):
    """The counts of the summary's headline: cases ``ran`` (pass, fail, error,
    broken) and ``passed``, ``unsupported``, ``not_available``; growth runs
    ``growth_ok`` of ``growth_ran``; planted defects ``caught`` of ``planted``.
    (``validation.runs_index`` reads them from every kept report too.)"""
    cases, growth = report.get("cases") or [], report.get("growth") or []
    defects = report.get("defects") or []
    return {
        "ran": sum(c.get("status") in ("pass", "fail", "error", "broken") for c in cases),
        "passed": sum(c.get("status") == "pass" for c in cases),
        "unsupported": sum(c.get("status") == "unsupported" for c in cases),
        "not_available": sum(c.get("status") == "not available" for c in cases),
        "growth_ok": sum(g.get("status") == "pass" for g in growth),
        "growth_ran": sum(g.get("status") in ("pass", "fail", "error") for g in growth),
        "caught": sum(f.get("caught", 0) for f in defects),
        "planted": sum(f.get("planted", 0) for f in defects),
    }


def summary_markdown(report, images):
    p, cfg, v = report["provenance"], report["config"], report["verdict"]
    cases = report["cases"]
    n = headline_counts(report)
    n_pass, n_unsup, n_na = n["passed"], n["unsupported"], n["not_available"]
    planted, caught_n = n["planted"], n["caught"]
    growth_ok, growth_ran = n["growth_ok"], n["growth_ran"]
    sim = p.get("device") == "simulator"
    L = []
    L.append("# Validation report")
    L.append("")
    L.append(f"**Verdict: {'PASS' if v['passed'] else 'FAIL'}**. "
             f"{n['ran']} cases run, {n_pass} pass, {n['ran'] - n_pass} fail; "
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
    L.append(f"criterion_hash: `{p.get('criterion_hash')}`")
    L.append("")
    if p.get("suites_hash"):  # the defect suites' sources (recorded by runs after 504265b)
        L.append(f"suites_hash: `{p['suites_hash']}`")
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
    walls = cfg.get("shard_wall_seconds")
    if walls:  # a merged run: its parts ran apart, in separate processes or machines
        resumed = any(RESUME_NAME.fullmatch(Path(f).name) for f in cfg.get("merged_from", []))
        L.append(f"| wall time | {report.get('wall_seconds', 0):.1f} s, the longest of "
                 f"{len(walls)} {'parts' if resumed else 'shards'} ({sum(walls):.1f} s in all) |")
    else:
        L.append(f"| wall time | {report.get('wall_seconds', 0):.1f} s |")
    groups = work_group_line(report)
    if groups:
        L.append(f"| work groups | {groups} |")
    L.append(f"| command | `{cfg.get('command', '')}` |")
    L.append("")
    L.append("## How a case is judged")
    L.append("")
    L.append("Each output (attention output and LSE) is compared with the float64 oracle "
             "(`attention.oracle`, `mla.oracle`) and with one same-precision baseline: the "
             "oracle's arithmetic in float32 on the same inputs, with the q.k scores (and MLA's "
             "absorbed query) summed in the order the kernel's family documents and the "
             "softmax scale applied where the kernel applies it (`validation/baselines.py`; "
             "the order of each kernel is in the table below). An output passes when NaN/inf "
             "sit where the oracle has them, **max** |err| <= 2 x the baseline's max + floor "
             "and **mean** |err| <= 1.5 x the baseline's mean + floor / n "
             "(`validation/tolerance.py`). floor = 2 float32 ulps of max|oracle|: every kernel "
             "computes in float32 (16-bit caches are upcast exactly), so the floor is "
             "float32's whatever the storage dtype. **ratio** = kernel max error / baseline "
             "max error; **err/bound** = kernel max error over its bound (<= 1 passes). "
             "Hostile fixtures: NaN in unused cache slots and beyond each length, shuffled "
             "slot tables, scores up to +-1e4 (`large`), all-equal scores (`equal`).")
    L.append("")
    brows = baseline_rows(report)
    if brows:
        L.append("| kernel | baseline order | outputs | over max rule | over mean rule | "
                 "NaN/inf misplaced | median ratio | median err / oracle-code float32 err |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in brows:
            L.append(f"| {r['kernel']} | {', '.join(sorted(r['orders']))} | {r['outputs']} | "
                     f"{r['max']} | {r['mean']} | {r['nonfinite']} | "
                     f"{_fmt(statistics.median(r['ratio']) if r['ratio'] else None)} | "
                     f"{_fmt(statistics.median(r['plain']) if r['plain'] else None)} |")
        L.append("")
    rrows = resolving_rows(report)
    if rrows:
        caught, detectable = resolving_power(report)
        L.append("## Resolving power: precision mutants")
        L.append("")
        L.append("Each product kernel carries compile-time precision mutants (P or q rounded to "
                 "16 bits, a coarser `exp`, compensation dropped, an off-by-one split, a stale "
                 "ring stage, ...; `validation/registry.py` `MUTANT_SOURCES`). On every case of "
                 f"the mutant seed(s) {report['config'].get('mutant_seeds')} each mutant runs on "
                 "the same inputs and is judged like the kernel. A mutant is *detectable* on a "
                 "case when its max error is over 2 x the baseline's or its mean error over "
                 "2 x the baseline's mean (or NaN/inf appear); *inert* cases (output "
                 "bit-identical to the kernel's: the mutant cannot act there) are left out. "
                 f"**Caught {caught} of {detectable} detectable cases"
                 f" ({_fmt(100.0 * caught / detectable if detectable else None, '.1f')} %).**")
        L.append("")
        L.append("| kernel | mutant | cases | exceed baseline | detectable | caught of detectable "
                 "| resolving power | caught, not detectable | rules that caught | inert | "
                 "errors |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rrows:
            n = r["cases"]
            power = 100.0 * r["caught_detectable"] / r["detectable"] if r["detectable"] else None
            rules = ", ".join(f"{k} {v}" for k, v in sorted(r["by_rule"].items())) or "-"
            L.append(f"| {r['kernel']} | {r['mutant']} | {n} | "
                     f"{_fmt(100.0 * r['exceeds'] / n if n else None, '.0f')} % | "
                     f"{r['detectable']} | {r['caught_detectable']} | "
                     f"{_fmt(power, '.0f')}{' %' if power is not None else ''} | "
                     f"{r['caught_other']} | {rules} | {r['inert']} | {len(r['errors'])} |")
        missed = [(r["kernel"], r["mutant"], i) for r in rrows for i in r["missed"]]
        if missed:
            L.append("")
            L.append("Detectable cases the judge missed: " + ", ".join(
                f"`{m}` on `{i}`" for _, m, i in missed[:40])
                + (f" and {len(missed) - 40} more" if len(missed) > 40 else "") + ".")
        errs = [(r["mutant"], i) for r in rrows for i in r["errors"]]
        if errs:
            L.append("")
            L.append("Mutant runs that raised (not counted as caught): " + ", ".join(
                f"`{m}` on `{i}`" for m, i in errs[:20]) + ".")
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
    L += quantization_section(report)
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
    L += findings_section(report)
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


def quantization_section(report):
    """Markdown lines of the fp8 quantization-error table (none without rows)."""
    rows = [r for r in report.get("quantization") or [] if r.get("kind", "decode") == "decode"]
    mla_rows = [r for r in report.get("quantization") or [] if r.get("kind") == "mla"]
    if not rows:
        return mla_quantization_lines(mla_rows)
    L = ["## fp8 e4m3 quantization error (a property of the format, not of a kernel)", ""]
    L.append("Per decode shape and fixture (first seed): the float64 attention over the cache "
             "quantized by the reference encoder and dequantized, against the float64 "
             "attention over the unquantized cache; |error| of `out`. Per tensor: one scale "
             "for K and one for V (amax / 448); per (token, kv head): each row's amax / 448. "
             "The fp8 kernels (`decode_fp8`, `decode_fp8_tok`) are judged over the "
             "dequantized cache, so none of this error is theirs.")
    L.append("")
    L.append("| shape | fixture | max abs out | per tensor: max err | per tensor: mean err | "
             "per token-head: max err | per token-head: mean err |")
    L.append("|---|---|---|---|---|---|---|")
    for r in rows:
        L.append(f"| {r['shape']} | {_quant_fixture(r)} | {_fmt(r.get('max_out'), '.3g')} | "
                 f"{_fmt(r.get('tensor_max'), '.2e')} | {_fmt(r.get('tensor_mean'), '.2e')} | "
                 f"{_fmt(r.get('token_head_max'), '.2e')} | "
                 f"{_fmt(r.get('token_head_mean'), '.2e')} |")
    L.append("")
    return L + mla_quantization_lines(mla_rows)


def _quant_fixture(row):
    """The fixture cell of a quantization row; a row whose unit did not run says why."""
    return row["fixture"] + (f" (not computed: {row['detail']})" if "detail" in row else "")


def mla_quantization_lines(rows):
    """Markdown lines of the fp8 latent cache's quantization-error table
    (``validation.fp8_quant.QuantUnit`` rows of kind "mla"; none without rows)."""
    if not rows:
        return []
    L = ["### MLA: the fp8 latent cache (mla.fp8)", ""]
    L.append("Per MLA shape and fixture (first seed): the float64 MLA attention over c_kv "
             "quantized to e4m3 and dequantized (k_pe stored as float16), against the float64 "
             "attention over the float32 inputs; |error| of `out`. Per tensor: one scale "
             "(amax / 448); per token: each cached row's amax / 448. `mla_fp8` and "
             "`mla_fp8_tok` are judged over the dequantized cache.")
    L.append("")
    L.append("| shape | fixture | max abs out | per tensor: max err | per tensor: mean err | "
             "per token: max err | per token: mean err |")
    L.append("|---|---|---|---|---|---|---|")
    for r in rows:
        L.append(f"| {r['shape']} | {_quant_fixture(r)} | {_fmt(r.get('max_out'), '.3g')} | "
                 f"{_fmt(r.get('tensor_max'), '.2e')} | {_fmt(r.get('tensor_mean'), '.2e')} | "
                 f"{_fmt(r.get('token_max'), '.2e')} | {_fmt(r.get('token_mean'), '.2e')} |")
    L.append("")
    return L


def findings_section(report):
    """Markdown lines: the failing cases and growth runs grouped by the finding
    that explains them (``validation.findings``), and those no finding covers.
    A finding explains a rule's failure (status ``fail``); a case or run that
    was not judged (``error``, ``broken``: a crash, or not run before a
    --deadline) is listed apart with its reason, never under a finding."""
    from validation.findings import explain

    recs = [c for c in report["cases"] if c["status"] in FAILING_CASE]
    recs += [g for g in report["growth"] if g["status"] in FAILING_GROWTH]
    failing = [r["id"] for r in recs if r["status"] == "fail"]
    unjudged = {}
    for r in recs:
        if r["status"] != "fail":
            why = str(r.get("detail") or r["status"]).strip().splitlines()
            unjudged.setdefault(why[-1][:160] if why else r["status"], []).append(r["id"])
    if not recs:
        return []
    groups, unexplained = {}, []
    for unit_id in failing:
        f = explain(unit_id)
        if f is None:
            unexplained.append(unit_id)
        else:
            groups.setdefault(f.name, (f, []))[1].append(unit_id)
    L = ["## Findings", "",
         "Every failure stays a failure; these are the ones looked into "
         "(`validation/findings.py`, measurements in `notes/validation.md`).", ""]
    for name, (f, ids) in groups.items():
        L.append(f"**{name}** ({len(ids)}: {f.rule}). {f.what} *Next:* {f.next_step}")
        L.append("")
        L.append("Covers: " + ", ".join(f"`{i}`" for i in ids) + ".")
        L.append("")
    if unexplained:
        L.append(f"**Unexplained** ({len(unexplained)}): "
                 + ", ".join(f"`{i}`" for i in unexplained) + ".")
        L.append("")
    for why, ids in unjudged.items():
        L.append(f"**Not judged** ({len(ids)}: {why}): "
                 + ", ".join(f"`{i}`" for i in ids[:12])
                 + (f", and {len(ids) - 12} more" if len(ids) > 12 else "") + ".")
        L.append("")
    return L


def write(report, out_dir):
    """Write validation.json, the plots and summary.md into ``out_dir``. A folder
    that keeps its report compressed (``validation.json.gz``: a kept run, and the
    report of record under ``reports/``, whose plain JSON is most of the tree's
    bytes) gets it compressed again (``archive``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    compressed = (out / JSON_GZ_NAME).exists()
    with open(out / JSON_NAME, "w") as fh:
        json.dump(report, fh, indent=1, default=_json_default)
    images = plot.plot_all(report, out)
    (out / SUMMARY_NAME).write_text(summary_markdown(report, images) + "\n")
    if compressed:
        archive(out)
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


def report_file(path):
    """The report file of ``path``: the path itself when it is a file, else the
    folder's ``validation.json`` or, failing that, its ``validation.json.gz``
    (an archived run). None when the folder holds neither."""
    p = Path(path)
    if not p.is_dir():
        return p if p.exists() else None
    for name in (JSON_NAME, JSON_GZ_NAME):
        if (p / name).exists():
            return p / name
    return None


def read_bytes(path):
    """The JSON text (bytes, decompressed) of the report at ``path`` (a folder,
    ``validation.json`` or ``validation.json.gz``). Raises FileNotFoundError
    naming the path when there is none."""
    f = report_file(path)
    if f is None:
        raise FileNotFoundError(f"no {JSON_NAME} or {JSON_GZ_NAME} at {path}")
    return file_bytes(f)


def file_bytes(path):
    """A file's bytes, gzip-decompressed when its name ends in ``.gz`` (a kept
    report, a kept shard or resume part)."""
    raw = Path(path).read_bytes()
    if Path(path).name.endswith(".gz"):
        import gzip

        raw = gzip.decompress(raw)
    return raw


def read(path):
    """The report (a dict) at ``path``: a folder, ``validation.json`` or ``.json.gz``."""
    return json.loads(read_bytes(path))


def archive(out_dir):
    """Compress ``out_dir/validation.json`` into ``validation.json.gz`` (gzip level 9,
    no timestamp, so the same report gives the same bytes) and remove the plain
    file. Every reader here (``--rebuild``, ``--costs``, ``--index``,
    ``validation.plot``) takes either. Returns the new file's path."""
    import gzip

    out = Path(out_dir)
    src = out / JSON_NAME
    raw = src.read_bytes()
    json.loads(raw)  # refuse to archive what is not a report
    dst = out / JSON_GZ_NAME
    with open(dst, "wb") as fh:
        with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=fh, mtime=0) as gz:
            gz.write(raw)
    src.unlink()
    return dst


# ---------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------


def shard_path(out_dir, index, count):
    return Path(out_dir) / "shards" / f"shard-{index}-of-{count}.json"


def resume_path(out_dir, index):
    """The K-th part of ``scripts/validate --resume`` (1-based)."""
    return Path(out_dir) / "shards" / f"resume-{index}.json"


# a part may be kept gzip-compressed (``.json.gz``, a tenth of the bytes) between runs
SHARD_NAME = re.compile(r"shard-(\d+)-of-(\d+)\.json(?:\.gz)?")
RESUME_NAME = re.compile(r"resume-(\d+)\.json(?:\.gz)?")


def next_resume(out_dir):
    """(K, path) of the next resume part: K one past the highest there, from 1."""
    have = [int(m.group(1)) for f in (Path(out_dir) / "shards").glob("resume-*.json*")
            if (m := RESUME_NAME.fullmatch(f.name))]
    k = 1 + max(have, default=0)
    return k, resume_path(out_dir, k)


def part_files(out_dir):
    """The parts of a run in ``<out_dir>/shards``, in the order they ran: the shard
    files by index, then the resume files by K."""
    folder = Path(out_dir) / "shards"
    shards = [(int(m.group(1)), f) for f in folder.glob("shard-*-of-*.json*")
              if (m := SHARD_NAME.fullmatch(f.name))]
    resumes = [(int(m.group(1)), f) for f in folder.glob("resume-*.json*")
               if (m := RESUME_NAME.fullmatch(f.name))]
    twice = sorted(f.name for _, f in shards + resumes if f.with_name(f.name + ".gz").exists())
    if twice:
        raise ValueError(f"parts both plain and compressed in {folder}: "
                         f"{', '.join(n + '(.gz)' for n in twice)}; keep one of each")
    return [f for _, f in sorted(shards)] + [f for _, f in sorted(resumes)]


def read_part(path):
    """A shard or resume part (a dict; ``.json`` or ``.json.gz``); ValueError naming
    the file when it is not JSON (a part cut while being written)."""
    try:
        return json.loads(file_bytes(path))
    except (ValueError, OSError, EOFError) as exc:  # not JSON, not gzip, cut short
        raise ValueError(f"{Path(path).name} is not a part: {exc}") from None


def plan_of(ids):
    """A run's plan, which every part records in its config (``"plan"``): the number of
    units of the whole run and a digest of their sorted ids, so a merge of shard and
    resume parts can tell whether they hold every unit (``merge``)."""
    ids = sorted(set(ids))
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
    return {"units": len(ids), "digest": digest}


# the settings every shard of one run shares (``merge`` refuses parts that differ)
MERGE_SAME = ("device", "small", "quick", "seeds", "dtypes", "steps", "kernels", "growth",
              "suites", "mutant_seeds", "costs")


def check_one_run(named):
    """Raise ValueError naming what differs unless the (name, part) pairs are parts
    of one run: the same kernel sources and criterion, the same ``MERGE_SAME``
    settings and, among those that record one, the same plan. ``scripts/validate
    --resume`` passes the tree and its command as one more part."""
    def differ(get, among=named):
        values = {}
        for name, p in among:
            values.setdefault(get(p), []).append(name)
        return None if len(values) <= 1 else "; ".join(
            f"{v} in {', '.join(names)}" for v, names in sorted(values.items()))

    why = differ(lambda p: p["provenance"]["kernel_source_hash"])
    if why:
        raise ValueError(f"parts measured different kernel sources: {why}")
    why = differ(lambda p: str(p["provenance"].get("criterion_hash")))
    if why:
        raise ValueError(f"parts were judged under different criteria: {why}")
    for key in MERGE_SAME:  # one run's settings, split: the same in every part
        why = differ(lambda p: json.dumps(p["config"].get(key), sort_keys=True))
        if why:
            raise ValueError(f"parts of different runs: config {key!r} differs ({why})")
    why = differ(lambda p: json.dumps(p["config"]["plan"], sort_keys=True),
                 [(n, p) for n, p in named if p["config"].get("plan")])
    if why:
        raise ValueError(f"parts of different plans (their units differ): {why}")


def record_id(kind, rec):
    """A record's unit id (``.id`` of the unit that made it): a quantization row has
    none of its own, so it is ``fp8_quant.QuantUnit.id``'s form."""
    if kind == "quantization":
        return f"fp8_quant/{rec['kind']}/{rec['shape']}/{rec['fixture']}"
    return rec["id"]


RECORD_KINDS = ("cases", "growth", "defect_units", "quantization")


def finished(rec):
    """Whether a record is a result: all are but those of units a --deadline cut
    (a worker's crash is a result, and is not run again)."""
    from validation.cli import NOT_RUN_DETAIL

    return rec.get("detail") != NOT_RUN_DETAIL


def finished_ids(parts):
    """The unit ids some part holds a finished record for (``finished``)."""
    return {record_id(kind, r) for p in parts for kind in RECORD_KINDS
            for r in p.get(kind) or [] if finished(r)}


def unit_ids(parts):
    """The ids of the units the parts recorded, finished or cut: every record but a
    kernel's not-available case (``sweep.not_available_record``, shape "*"), which
    stands for no unit of the plan."""
    return {record_id(kind, r) for p in parts for kind in RECORD_KINDS
            for r in p.get(kind) or [] if not (kind == "cases" and r.get("shape") == "*")}


def pick_records(kind, records):
    """One record a unit id, in the order ids first appear: its first finished
    record, else (every record of it cut) its first. Parts of a resumed run hold
    a unit cut in one and finished in another, in either file order."""
    out = {}
    for r in records:
        key = record_id(kind, r)
        if key not in out or (finished(r) and not finished(out[key])):
            out[key] = r
    return list(out.values())


def _check_shards(parts, resumed):
    """The shard files among the parts: of one split and, unless the run was
    resumed (whose resume parts ran what shards lack), all of it."""
    shards = [p["config"]["shard"] for p in parts if p["config"].get("shard")]
    counts = {n for _, n in shards}
    if len(counts) > 1:
        raise ValueError(f"shard files of different splits: {sorted(counts)}")
    if resumed or not counts:
        return
    count = counts.pop()
    have = sorted(i for i, _ in shards)
    if have != list(range(count)):
        raise ValueError(f"shards present {have}, expected 0..{count - 1}")


def _check_cover(parts):
    """Raise ValueError unless the parts record (finished or cut) every unit of
    their plan: the sorted ids of their unit records must hash to the plan's
    digest (``plan_of``), so a missing, extra or renamed unit is caught."""
    plans = [p["config"]["plan"] for p in parts if p["config"].get("plan")]
    if not plans:
        raise ValueError("no part records the run's plan: merge its shards without the "
                         "resume parts")
    plan, have = plans[0], unit_ids(parts)
    if plan_of(have) == plan:
        return
    if len(have) < plan["units"]:
        raise ValueError(f"parts cover {len(have)} of the plan's {plan['units']} units; "
                         f"run --resume again")
    raise ValueError(f"parts record {len(have)} units, not the plan's {plan['units']} "
                     f"(digest {plan_of(have)['digest']}, plan {plan['digest']})")


def _work_groups(parts, resumed):
    """The merged work-group timings: every part's finished and crashed groups;
    of the groups a deadline cut, a resumed run keeps its last part's alone (it
    ran every unit unfinished until then: the earlier cuts were run again)."""
    last = len(parts) - 1
    return [g for n, p in enumerate(parts) for g in p.get("work_groups") or []
            if not resumed or n == last or g.get("state") not in ("running", "not started")]


def merge(out_dir):
    """Merge the parts in ``<out_dir>/shards`` into one report (not written): the
    shard files ``shard-I-of-N.json`` and the parts of ``scripts/validate
    --resume``, ``resume-K.json``. Without resume parts every shard 0..N-1 must
    be there; with them the parts must record every unit of the run's plan
    (``_check_cover``), and a unit's finished record is kept over a cut one.
    Raises ValueError when parts are missing, measured different code, were
    judged under different criteria or ran with different settings."""
    files = part_files(out_dir)
    if not files:
        raise ValueError(f"no shard files in {Path(out_dir) / 'shards'}")
    parts = [read_part(f) for f in files]
    resumed = any(RESUME_NAME.fullmatch(f.name) for f in files)
    _check_shards(parts, resumed)
    check_one_run([(f.name, p) for f, p in zip(files, parts)])
    if resumed:
        _check_cover(parts)
    merged = {kind: pick_records(kind, [r for p in parts for r in p.get(kind) or []])
              for kind in RECORD_KINDS}
    broken = []
    for p in parts:
        broken.extend(b for b in p.get("broken_suites", []) if b not in broken)
    config = dict(parts[0]["config"], shard=None, merged_from=[str(f) for f in files],
                  shard_wall_seconds=[p["wall_seconds"] for p in parts])
    config.pop("resumed_from", None)
    prov = dict(parts[0]["provenance"], devices=sorted({p["provenance"]["device"] for p in parts}))
    wall = max(p["wall_seconds"] for p in parts)
    return build(cases=merged["cases"], growth=merged["growth"],
                 defect_units=merged["defect_units"], broken_suites=broken, config=config,
                 provenance=prov, wall_seconds=wall, quantization=merged["quantization"],
                 work_groups=_work_groups(parts, resumed))


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


def stale_banner(report_hash, code_hash, report_criterion=None, code_criterion=None):
    why = (f"This report measured kernel sources `{report_hash}`; the code now hashes to "
           f"`{code_hash}` (`validation.provenance.kernel_source_hash()`). Its numbers "
           f"describe older kernels")
    if report_hash == code_hash:
        why = (f"This report was judged under criterion `{report_criterion}`; the judging code "
               f"now hashes to `{code_criterion}` (`validation.provenance.criterion_hash()`). "
               f"Its verdicts follow an older rule")
    return (f"{STALE_START}\n> {STALE_MARK} {why}: re-run `scripts/validate` on a GPU to "
            f"refresh it.\n{STALE_END}\n\n")


def freshness(out_dir):
    """{"state": "fresh"|"stale"|"missing", report_hash, code_hash, marked}."""
    from validation.provenance import criterion_hash, kernel_source_hash

    out = Path(out_dir)
    code, crit = kernel_source_hash(), criterion_hash()
    if report_file(out) is None:
        return {"state": "missing", "report_hash": None, "code_hash": code,
                "report_criterion": None, "code_criterion": crit, "marked": False}
    rep = read(out)
    rh = rep["provenance"]["kernel_source_hash"]
    rc = rep["provenance"].get("criterion_hash")
    summary = (out / SUMMARY_NAME).read_text() if (out / SUMMARY_NAME).exists() else ""
    return {"state": "fresh" if (rh == code and rc == crit) else "stale", "report_hash": rh,
            "code_hash": code, "report_criterion": rc, "code_criterion": crit,
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
        text = stale_banner(f["report_hash"], f["code_hash"], f["report_criterion"],
                            f["code_criterion"]) + text
    path.write_text(text)
    return freshness(out)

