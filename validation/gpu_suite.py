"""Run the test suite on a GPU and write a JSON report with provenance.

    python -m validation.gpu_suite [--sanitizer memcheck|racecheck] [--name NAME]
                                   [--out reports/gpu] [-- pytest args...]
    python -m validation.gpu_suite --from-log LOG [--provenance-from JSON] --name NAME

The report (``reports/gpu/<name>.json``) holds the provenance of
``validation.provenance`` (git commit, kernel-source hash, GPU name, package
versions), the pytest command, its exit status, per-test outcomes and, under
compute-sanitizer, the tool and its error summary. Exit status: pytest's (or
non-zero when the sanitizer reports errors).

``--from-log`` rebuilds such a report from the streamed ``pytest -v`` log of a
run that was cut short (the per-test lines are the evidence; the report says
``"interrupted": true`` when the log has no final pytest summary or shows the
SIGINT of a time limit, and a
sanitizer's verdict only when its ERROR SUMMARY line is there). The GPU side's
provenance comes from the log's first line where ``scripts/gpu_all`` wrote it
(``# gpu_all <stage>: {...}``), else from ``--provenance-from``: a report of the
same run on the same machine (e.g. ``reports/validation.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from validation.provenance import ROOT, provenance


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sanitizer", choices=["memcheck", "racecheck", "initcheck", "synccheck"])
    ap.add_argument("--name", help="report file name (default: suite or sanitizer-<tool>)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu"))
    ap.add_argument("--from-log", metavar="LOG", help="rebuild the report from a pytest -v log")
    ap.add_argument("--provenance-from", metavar="JSON",
                    help="with --from-log: a report of the same GPU run holding its provenance")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)
    if args.from_log:
        return from_log(args)

    from attention.core.device import gpu_available

    if not gpu_available():
        print("gpu_suite: no CUDA GPU on this machine; nothing to run", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("suite" if not args.sanitizer else f"sanitizer-{args.sanitizer}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        outcomes_path = tmp.name
    cmd = [sys.executable, "-u", "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=15",
           *args.pytest_args]
    if args.sanitizer:
        cmd = ["compute-sanitizer", "--tool", args.sanitizer, "--print-limit", "20",
               "--target-processes", "all", *cmd]
    env = dict(os.environ, ATTN_TEST_REPORT=outcomes_path)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    start = time.time()
    # Stream the output live (a hang must show where it is) and keep it for parsing.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    # A time limit interrupts the whole process group: pytest then stops and writes its
    # outcomes; this process ignores the interrupt (after the child started, so the
    # child does not inherit it) to still write the report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    proc.wait()
    text = "".join(lines)
    wall = time.time() - start
    try:
        outcomes = json.load(open(outcomes_path))
    except (OSError, ValueError):
        outcomes = {"tests": [], "mode": "unknown"}
    counts = {}
    for t in outcomes.get("tests", []):
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    report = {
        "provenance": provenance(wall_seconds=round(wall, 1)),
        "interrupted": proc.returncode == 2 or proc.returncode < 0,
        "command": " ".join(cmd),
        "exit_status": proc.returncode,
        "mode": outcomes.get("mode"),
        "counts": counts,
        "tests": outcomes.get("tests", []),
    }
    status = proc.returncode
    if args.sanitizer:
        summaries = sanitizer_summaries(text)
        errors = sum(summaries)
        report["sanitizer"] = {"tool": args.sanitizer, "error_summaries": len(summaries),
                               "errors": errors}
        if errors:
            status = status or 3
        if not summaries:
            report["sanitizer"]["note"] = "no ERROR SUMMARY line found: did the tool run?"
            status = status or 4
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_suite: {counts} -> {path}" + (
        f" (sanitizer errors: {report['sanitizer']['errors']})" if args.sanitizer else ""))
    return status


_OUTCOME = re.compile(
    r"^(?:\[gw\d+\] \[ *\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/.+?)\s*$"
    r"|(tests/.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: +\[ *\d+%\])?\s*$)")


def sanitizer_summaries(text):
    """Error counts of compute-sanitizer's closing lines: ``ERROR SUMMARY: N errors``
    (memcheck, initcheck, synccheck) or ``RACECHECK SUMMARY: N hazards displayed
    (E errors, W warnings)`` (racecheck: hazards count, warnings included)."""
    found = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    found += [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)]
    return found


def parse_log(text):
    """Per-test outcomes of a ``pytest -v`` log (plain or pytest-xdist lines)."""
    tests = {}
    for line in text.splitlines():
        m = _OUTCOME.match(line.strip())
        if m:
            outcome, nodeid = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            tests[nodeid] = outcome.lower()
    return [{"test": k, "outcome": v} for k, v in tests.items()]


def from_log(args):
    text = Path(args.from_log).read_text(errors="replace")
    tests = parse_log(text)
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    summaries = sanitizer_summaries(text)
    header = re.search(r"attention test mode: (\S+) \(device: ([^)]*)\)", text)
    prov = {}
    if args.provenance_from:
        prov = json.loads(Path(args.provenance_from).read_text()).get("provenance", {})
    else:  # a scripts/gpu_all log states its run's provenance on its first line
        from validation.gpu_reports import read_provenance

        prov = read_provenance(Path(args.from_log)) or {}
    prov = dict(prov, reconstructed_from_log=str(args.from_log))
    if header:
        prov["device"] = header.group(2)
    # pytest prints its summary line after a SIGINT too (a stage's time limit):
    # a run is finished only with the summary and no KeyboardInterrupt banner
    finished = (re.search(r"^=+ .*\b(passed|failed)\b.* in [\d.]+s", text, re.M) is not None
                and re.search(r"^!+ KeyboardInterrupt !+$", text, re.M) is None)
    report = {"provenance": prov, "command": f"(reconstructed from {args.from_log})",
              "exit_status": None, "interrupted": not finished,
              "mode": header.group(1) if header else None, "counts": counts, "tests": tests}
    status = 1 if counts.get("failed") or counts.get("error") or sum(summaries) else 0
    if "COMPUTE-SANITIZER" in text:
        errors_inline = len(re.findall(r"^========= (Invalid|Race|Error|Program hit)", text, re.M))
        report["sanitizer"] = {
            # sanitizer-<tool>[-<what>]: e.g. sanitizer-memcheck-full
            "tool": args.name.replace("sanitizer-", "").split("-")[0] if args.name else None,
            "error_summaries": len(summaries), "errors": sum(summaries),
            "errors_reported_inline": errors_inline,
            "note": "" if summaries else "the run was cut before the tool's ERROR SUMMARY; "
                    "errors_reported_inline counts the error records it printed until then"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or 'suite'}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_suite: {counts} (interrupted: {not finished}) -> {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
