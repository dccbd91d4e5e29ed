"""Run the test suite on a GPU and write a JSON report with provenance.

    python -m validation.gpu_suite [--sanitizer memcheck|racecheck] [--name NAME]
                                   [--out reports/gpu] [-- pytest args...]

The report (``reports/gpu/<name>.json``) holds the provenance of
``validation.provenance`` (git commit, kernel-source hash, GPU name, package
versions), the pytest command, its exit status, per-test outcomes and, under
compute-sanitizer, the tool and its error summary. Exit status: pytest's (or
non-zero when the sanitizer reports errors).
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
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)

    from attention.device import gpu_available

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
        summaries = re.findall(r"ERROR SUMMARY: (\d+) error", text)
        errors = sum(int(n) for n in summaries)
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


if __name__ == "__main__":
    sys.exit(main())
