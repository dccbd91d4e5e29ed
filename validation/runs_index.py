"""An index of the GPU runs kept under ``reports/gpu/runs/`` (``scripts/validate --index``).

Each run folder holds what one or more device calls wrote: a validation report
(``validation.json``, possibly in a subfolder, with its ``summary.md``), bench
logs, profiles, re-judging scripts. The index (``INDEX.md`` in that folder,
written anew each time, never by hand) gives one row a validation report,
newest first: its commit, GPU, date, seeds, verdict and counts, and whether
it measured the kernel sources and criterion of the checkout that wrote the
index (``fresh``) or older ones (``stale``). Folders without a report are
listed with their files, so a bench-only run is findable too.

Counts as in the report's headline (``report.headline_counts``): cases run
(pass / fail, of which "not run" were cut by a ``--deadline``), growth runs
passed of those run, planted defects caught of those planted.
"""

from __future__ import annotations

from pathlib import Path

from validation.cli import NOT_RUN_DETAIL
from validation.report import JSON_GZ_NAME, JSON_NAME, headline_counts, read, report_file

INDEX_NAME = "INDEX.md"


def run_row(path, code_hash, crit_hash):
    """A dict describing the validation report at ``path`` (a validation.json or
    an archived validation.json.gz)."""
    rep = read(path)
    prov = rep.get("provenance") or {}
    n = headline_counts(rep)
    cut = sum(c.get("status") == "error" and c.get("detail") == NOT_RUN_DETAIL
              for c in rep.get("cases") or [])
    kh, ch = prov.get("kernel_source_hash"), prov.get("criterion_hash")
    return {
        "path": str(path),
        "commit": str(prov.get("git_commit") or "?")[:7],
        "device": ", ".join(prov.get("devices") or [prov.get("device") or "?"]),
        "time": prov.get("timestamp") or "",
        "seeds": ",".join(str(s) for s in (prov.get("seeds") or [])),
        "passed": bool((rep.get("verdict") or {}).get("passed")),
        "ran": n["ran"],
        "pass": n["passed"],
        "cut": cut,
        "growth": (n["growth_ok"], n["growth_ran"]),
        "defects": (n["caught"], n["planted"]),
        "kernel_hash": kh,
        "fresh": kh == code_hash and ch == crit_hash,
        "same_kernels": kh == code_hash,
    }


def _state(r):
    if r["fresh"]:
        return "fresh"
    return "stale (criterion)" if r["same_kernels"] else "stale"


def index_markdown(runs_dir, code_hash, crit_hash):
    """The index's text for ``runs_dir``, against these current hashes."""
    runs_dir = Path(runs_dir)
    rows, other = [], []
    for d in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        # one report a folder (report_file: the plain one where both are there)
        found = sorted({report_file(f.parent) for f in [*d.rglob(JSON_NAME),
                                                         *d.rglob(JSON_GZ_NAME)]})
        for f in found:
            rows.append(run_row(f, code_hash, crit_hash))
        if not found:
            files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
            other.append((d.name, files))
    rows.sort(key=lambda r: r["time"], reverse=True)
    L = ["# GPU runs", "",
         f"Written by `scripts/validate --index` (`validation/runs_index.py`); current kernel "
         f"sources `{code_hash}`, criterion `{crit_hash}`. **fresh**: the run measured these; "
         "**stale**: older kernel sources; **stale (criterion)**: these kernels, an older "
         "criterion. The committed report of record is `reports/summary.md`.", "",
         "| run | commit | GPU | time (UTC) | seeds | verdict | cases run: pass / fail "
         "(not run) | growth | defects | state |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = Path(r["path"]).parent.relative_to(runs_dir)
        fail = r["ran"] - r["pass"]
        cut = f" ({r['cut']})" if r["cut"] else ""
        when = r["time"].replace("T", " ").rstrip("Z")
        L.append(f"| [{rel}]({rel}/) | `{r['commit']}` | {r['device']} | {when} | "
                 f"{r['seeds']} | {'PASS' if r['passed'] else 'FAIL'} | "
                 f"{r['ran']}: {r['pass']} / {fail}{cut} | "
                 f"{r['growth'][0]}/{r['growth'][1]} | {r['defects'][0]}/{r['defects'][1]} | "
                 f"{_state(r)} |")
    if other:
        L += ["", "## Runs without a validation report", ""]
        for name, files in other:
            shown = ", ".join(f"`{f}`" for f in files[:8])
            more = f" and {len(files) - 8} more" if len(files) > 8 else ""
            L.append(f"- [{name}]({name}/): {shown}{more}")
    return "\n".join(L) + "\n"


def write_index(runs_dir):
    """Write ``INDEX.md`` in ``runs_dir`` for the current sources; returns its path."""
    from validation.provenance import criterion_hash, kernel_source_hash

    path = Path(runs_dir) / INDEX_NAME
    path.write_text(index_markdown(runs_dir, kernel_source_hash(), criterion_hash()))
    return path
