"""Every GPU report under ``reports/`` and which kernel sources each one measured.

``scripts/validate --check-fresh`` lists them, so a reader can tell at a glance
whether the suite, the sanitizer runs, the benchmark, the ncu profiles and the
stage logs describe the code in the tree or older code. Each file carries the
provenance of ``validation.provenance.provenance()`` in its own form:

=====================================  =================================================
file                                   where its provenance is
=====================================  =================================================
``validation.json``                    its ``provenance`` key (plus ``criterion_hash``)
``gpu/<name>.json`` (suite, sanitizers) its ``provenance`` key
``bench/summary.md``                   the JSON block under "Provenance:"
``bench/ncu/<name>.txt``               the JSON in the ``#`` comment lines at its top
``gpu/logs/<stage>.log``               its first line, ``# gpu_all <stage>: {json}``,
                                       written by ``scripts/gpu_all`` when the stage starts
=====================================  =================================================

A file is **fresh** when it measured the tree's kernel sources (and, for the
validation, its criterion), **partial** when it did but says its run was cut
short (``"interrupted": true`` in the report or its provenance, or a bench whose
provenance lists ``sections_skipped``; a stage log whose
``<stage>.rc`` is missing, 124 (the time limit's) or 130 (a bench cut by its
interrupt)), **stale** when it measured others, and
**unknown** when it states none (a log from before ``scripts/gpu_all`` wrote
the header).
Kept runs (``reports/gpu/runs/``) are history and have their own index
(``validation.runs_index``). Reads files only; no kernel runs.

    rows = inventory(ROOT / "reports")   # [{path, kind, commit, kernel_hash, ...}]
"""

from __future__ import annotations

import json
from pathlib import Path

from validation.provenance import LOG_HEADER


def _first_json_object(lines):
    """The first JSON object spread over ``lines`` (a '#' comment prefix is
    stripped), or None."""
    buf, depth = [], 0
    for raw in lines:
        line = raw[1:].strip() if raw.startswith("#") else raw.strip()
        if not buf and not line.startswith("{"):
            continue
        buf.append(line)
        depth += line.count("{") - line.count("}")
        if depth <= 0:
            try:
                return json.loads("\n".join(buf))
            except json.JSONDecodeError:
                return None
    return None


def stage_status(log):
    """A stage log's exit status from its ``<stage>.rc`` beside it (None if missing:
    the stage was cut off before it could write one)."""
    rc = Path(log).with_suffix(".rc")
    try:
        return int(rc.read_text().strip())
    except (OSError, ValueError):
        return None


CUT_STATUS = (None, 124, 130)  # no .rc written, timeout's status, an interrupted bench


def _provenance_and_cut(path, rc=None):
    """(the provenance ``path`` states or {}, whether its run was cut short, a note
    or ""): cut is a report's or its provenance's ``interrupted``, or a stage log
    whose exit status ``rc`` (``stage_status``) is missing or one of a cut run
    (``CUT_STATUS``); the note
    names a sanitizer report whose positive control the tool did not flag (its
    0 errors then say nothing). A JSON report is read once."""
    if _is_json(path):
        try:
            doc = _json_doc(path)
        except (OSError, ValueError, EOFError):
            return {}, False, ""
        prov = doc.get("provenance") or {}
        control = (doc.get("sanitizer") or {}).get("control")
        note = ("positive control not caught"
                if isinstance(control, dict) and not control.get("caught") else "")
        return prov, bool(doc.get("interrupted") or prov.get("interrupted")), note
    prov = read_provenance(path) or {}
    if path.suffix == ".log":
        return prov, rc in CUT_STATUS, ""
    # a bench run with sections skipped (``--skip``) is partial too, until a
    # ``--resume`` run adds them
    return prov, bool(prov.get("interrupted") or prov.get("sections_skipped")), ""


def _is_json(path):
    """Whether ``path`` names a JSON report (``.json``, or ``.json.gz`` compressed)."""
    return path.suffix == ".json" or path.name.endswith(".json.gz")


def _json_doc(path):
    """A JSON report's document (``.json``, or ``.json.gz`` compressed)."""
    from validation.report import file_bytes

    return json.loads(file_bytes(path))


def read_provenance(path):
    """The provenance dict ``path`` states, or None."""
    path = Path(path)
    try:
        if _is_json(path):
            return _json_doc(path).get("provenance")
        with path.open(errors="replace") as fh:
            head = [next(fh, "") for _ in range(400)]  # a resumed bench's is long
    except (OSError, ValueError, AttributeError, EOFError):
        return None
    if path.suffix == ".log":  # only the header gpu_all writes counts
        first = head[0]
        if not first.startswith(LOG_HEADER) or ": " not in first:
            return None
        try:
            return json.loads(first.split(": ", 1)[1])
        except json.JSONDecodeError:
            return None
    return _first_json_object(head)


def _files(reports):
    from validation.report import report_file

    r = Path(reports)
    out = []
    rep = report_file(r) if r.is_dir() else None  # validation.json or its .gz
    if rep is not None:
        out.append(("validation", rep))
    out += [("gpu report", p) for p in sorted((r / "gpu").glob("*.json"))]
    if (r / "bench" / "summary.md").exists():
        out.append(("bench", r / "bench" / "summary.md"))
    out += [("ncu profile", p) for p in sorted((r / "bench" / "ncu").glob("*.txt"))]
    out += [("stage log", p) for p in sorted((r / "gpu" / "logs").glob("*.log"))]
    return out


def inventory(reports, code_hash=None, crit_hash=None, suite_hash=None):
    """One dict a GPU report under ``reports``: path (relative to ``reports``),
    kind, commit, kernel_hash, device, time, state ("fresh" | "partial" | "stale" |
    "unknown"), rc (stage logs), note ("" or what the report's verdict lacks; for
    the validation, also whether the defect suites it ran are the tree's:
    ``validation.provenance.suites_hash``, recorded by runs after 504265b)."""
    from validation.provenance import criterion_hash, kernel_source_hash, suites_hash

    code_hash = code_hash or kernel_source_hash()
    crit_hash = crit_hash or criterion_hash()
    suite_hash = suite_hash or suites_hash()
    rows = []
    for kind, path in _files(reports):
        rc = stage_status(path) if kind == "stage log" else None
        prov, cut, note = _provenance_and_cut(path, rc)
        if kind == "validation":
            said = prov.get("suites_hash")
            if said is None:
                suites = "its defect suites' sources are not recorded"
            elif said != suite_hash:
                suites = f"its defect suites have changed since: {said} -> {suite_hash}"
            else:
                suites = ""
            note = "; ".join(x for x in (note, suites) if x)
        kh = prov.get("kernel_source_hash")
        if kh is None:
            state = "unknown"
        elif kh != code_hash:
            state = "stale"
        elif kind == "validation" and prov.get("criterion_hash") != crit_hash:
            state = "stale"
        elif cut:
            state = "partial"
        else:
            state = "fresh"
        rows.append({
            "path": path.relative_to(reports).as_posix(),
            "kind": kind,
            "commit": str(prov.get("git_commit") or "?")[:7],
            "kernel_hash": kh,
            "device": ", ".join(prov.get("devices") or [prov.get("device") or "?"]),
            "time": prov.get("timestamp") or "",
            "state": state,
            "rc": rc,
            "note": note,
        })
    return rows


def table(rows):
    """The rows as aligned text lines."""
    if not rows:
        return ["(no GPU reports)"]
    w = max(len(r["path"]) for r in rows)
    return [f"{r['state']:7}  {r['path']:{w}}  {r['commit']:7}  {r['kernel_hash'] or '-':16}  "
            f"{r['device']}  {r['time']}"
            + ("" if r["kind"] != "stage log" else
               f"  exit {'(none)' if r['rc'] is None else r['rc']}")
            + (f"  ({r['note']})" if r.get("note") else "") for r in rows]
