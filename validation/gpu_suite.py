"""Run the test suite on a GPU and write a JSON report with provenance.

    python -m validation.gpu_suite [--sanitizer memcheck|racecheck] [--name NAME]
                                   [--out reports/gpu] [-- pytest args...]
    python -m validation.gpu_suite --part i/n [--out reports/gpu/parts] [-- pytest args...]
    python -m validation.gpu_suite --merge PART.json... [--name suite] [--out reports/gpu]
    python -m validation.gpu_suite --from-log LOG [--provenance-from JSON] --name NAME [--part i/n]
    python -m validation.gpu_suite --resume PREV.json... [the run's options] [-- pytest args...]

The report (``reports/gpu/<name>.json``) holds the provenance of
``validation.provenance`` (git commit, kernel-source hash, GPU name, package
versions), the pytest command, its exit status, per-test outcomes and, under
compute-sanitizer, the tool and its error summary, and for memcheck and
racecheck the positive control (``validation.sanitizer_control``: a planted
out-of-bounds write or shared-memory race, run under the same tool first, which
the tool must flag). Exit status: pytest's (or non-zero when the sanitizer
reports errors, or misses its control).

A time limit may cut the run with SIGINT (``scripts/gpu_all``) or with a plain
``timeout``'s SIGTERM: either way pytest is interrupted and the report is still
written, ``"interrupted": true``; where pytest died before writing its outcomes
they are read from its streamed ``-v`` lines (and the report's ``note`` says so).

``--part i/n`` runs one of n parts of the test files (a machine held in slices
shorter than the whole suite); ``--merge`` joins the parts' reports into one.

``--from-log`` rebuilds such a report from the streamed ``pytest -v`` log of a
run that was cut short (the per-test lines are the evidence; the report says
``"interrupted": true`` when the log has no final pytest summary or shows the
SIGINT of a time limit, and a
sanitizer's verdict only when its ERROR SUMMARY line is there). The GPU side's
provenance comes from the log's first line where ``scripts/gpu_all`` wrote it
(``# gpu_all <stage>: {...}``), else from ``--provenance-from``: a report of the
same run on the same machine (e.g. ``reports/validation.json``). With ``--part`` the
report records the part its log ran, so ``--merge`` takes it. ``scripts/gpu_all``
rebuilds a test stage's report so when its time limit had to kill the stage.

``--resume PREV.json...`` continues a run that its time limit cut: pytest runs with
one ``--deselect`` a test the earlier reports hold (whatever its outcome: a failure
is a result, not rerun), and the report written is the union of theirs and this
run's (``resume_report``; ``provenance.resumed_from`` lists them). Reports of other
kernel sources than the tree's, of another sanitizer tool or of another part are
refused (exit 2, nothing run or written). When nothing is left (pytest deselected
every test and exits 5), the run still writes the union, with exit status 0 and a
``note`` saying so: one path for every resumed run, and a report that says the stage
is whole. ``--from-log LOG --resume PREV.json...`` writes the same union for a
resumed run its limit killed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from validation.cli import _shard
from validation.provenance import ROOT, kernel_source_hash, provenance


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sanitizer", choices=["memcheck", "racecheck", "initcheck", "synccheck"])
    ap.add_argument("--name", help="report file name (default: suite or sanitizer-<tool>)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu"))
    ap.add_argument("--from-log", metavar="LOG", help="rebuild the report from a pytest -v log")
    ap.add_argument("--provenance-from", metavar="JSON",
                    help="with --from-log: a report of the same GPU run holding its provenance")
    ap.add_argument("--part", type=_shard, metavar="i/n",
                    help="run part i of n: the test files dealt into n parts of about equal "
                         "size (part_files); the report records the part, and --merge joins "
                         "the n reports into one")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="join the reports of one run's parts (--part) into OUT/NAME.json")
    ap.add_argument("--resume", nargs="+", metavar="JSON",
                    help="continue the run these reports (of this tool and part) record: run "
                         "only the tests none of them holds, and write the union")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)
    if args.from_log:
        return from_log(args)
    if args.merge:
        return merge(args)
    prevs = None
    if args.resume:
        prevs, why = read_resumed(args.resume, args.sanitizer, args.part)
        if why:
            print(f"gpu_suite --resume: {why}", file=sys.stderr)
            return 2

    from attention.core.device import gpu_available

    if not gpu_available():
        print("gpu_suite: no CUDA GPU on this machine; nothing to run", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("suite" if not args.sanitizer else f"sanitizer-{args.sanitizer}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        outcomes_path = tmp.name
    pytest_args = list(args.pytest_args)
    if args.part:
        pytest_args = part_args(pytest_args, args.part)
        if pytest_args is None:  # more parts than files: run nothing (never all of tests/)
            report = {"provenance": provenance(wall_seconds=0.0), "interrupted": False,
                      "command": "(no test file in this part)", "exit_status": 0,
                      "mode": None, "counts": {}, "tests": [], "part": list(args.part)}
            path = out_dir / f"{name}.json"
            path.write_text(json.dumps(report, indent=1) + "\n")
            print(f"gpu_suite: part {args.part[0]}/{args.part[1]} holds no test file -> {path}")
            return 0
    cmd = [sys.executable, "-u", "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=15",
           *pytest_args]
    if args.sanitizer:
        cmd = [*sanitizer_prefix(args.sanitizer), "--target-processes", "all", *cmd]
    done = deselect_args(prevs, pytest_args) if prevs else []
    # the report names the deselected tests by their count (they are the earlier reports')
    shown = " ".join(cmd) + (f" --deselect ({len(done) // 2} tests of the resumed reports)"
                             if done else "")
    cmd = [*cmd, *done]
    env = dict(os.environ, ATTN_TEST_REPORT=outcomes_path)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    control = run_control(args.sanitizer, env) if args.sanitizer else None
    start = time.time()
    # Stream the output live (a hang must show where it is) and keep it for parsing.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    # A time limit interrupts the whole process group: pytest then stops and writes its
    # outcomes; this process ignores the interrupt (after the child started, so the
    # child does not inherit it) to still write the report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A plain ``timeout`` sends SIGTERM (to this process and, from GNU timeout, to
    # the whole group): it is taken as the limit's SIGINT. pytest is interrupted
    # (if the group's SIGTERM has not ended it already) and this process goes on to
    # write the report, from pytest's outcomes or, where pytest died before writing
    # them, from the streamed -v lines (``parse_log``).
    terminated = []

    def on_term(signum, frame):
        terminated.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_term)
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
    logged = [] if outcomes.get("tests") else parse_log(text)
    if logged:
        outcomes = {"tests": logged, "mode": outcomes.get("mode"), "from_log": True}
    counts = outcome_counts(outcomes.get("tests", []))
    report = {
        "provenance": provenance(wall_seconds=round(wall, 1)),
        "interrupted": proc.returncode == 2 or proc.returncode < 0 or bool(terminated),
        "command": shown,
        "exit_status": proc.returncode,
        "mode": outcomes.get("mode"),
        "counts": counts,
        "tests": outcomes.get("tests", []),
    }
    if outcomes.get("from_log"):
        cause = "a SIGTERM" if terminated else "interrupted or killed"
        report["note"] = (f"pytest ended before writing its outcomes ({cause}): the tests "
                          "are read from its -v lines")
    if args.part:
        report["part"] = list(args.part)
    if done and proc.returncode == 5:  # pytest ran nothing: every test was deselected
        report["exit_status"] = 0
        report["note"] = NOTHING_LEFT
    if args.sanitizer:
        summaries = sanitizer_summaries(text)
        report["sanitizer"] = {"tool": args.sanitizer, "error_summaries": len(summaries),
                               "errors": sum(summaries), "errors_reported_inline":
                               inline_errors(text), "control": control}
        if not summaries:
            report["sanitizer"]["note"] = (
                CUT_NOTE if report["interrupted"] and "COMPUTE-SANITIZER" in text
                else "no ERROR SUMMARY line found: did the tool run?")
    if prevs:
        report, status = resume_report(prevs, report, args.resume)
        counts = report["counts"]
    else:
        status = report_status(report)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_suite: {counts} -> {path}" + (
        f" (sanitizer errors: {report['sanitizer']['errors']})" if args.sanitizer else ""))
    return status


def report_status(report, last=None):
    """A run's exit status from its report: pytest's (or 1 where it is 0 or unknown and
    a test failed or erred), else 3 for sanitizer errors (summed or printed inline), 5
    for a positive control the tool missed, 4 when the run that ran last (``last``,
    default the report's own) finished with no ERROR SUMMARY line (did the tool
    run?). A cut run is not held to that line: it ends before the tool prints it,
    and the errors it printed count inline."""
    last = last if last is not None else report
    counts = report.get("counts") or {}
    status = report.get("exit_status") or (1 if counts.get("failed") or counts.get("error")
                                           else 0)
    san = report.get("sanitizer")
    if san:
        if san.get("errors") or san.get("errors_reported_inline"):
            status = status or 3
        control = san.get("control")
        if control is not None and not control.get("caught"):
            status = status or 5
        if not (last.get("sanitizer") or {}).get("error_summaries") and not last.get(
                "interrupted"):
            status = status or 4
    return status


# the note of a resumed run whose pytest had nothing left to run (its exit status 5)
NOTHING_LEFT = ("nothing left to run: pytest deselected every test (all in the resumed "
                "reports) and exited 5; this report is their union")


def read_resumed(paths, tool, part, kernel_hash=None):
    """(the reports ``--resume`` names, None), or (None, why this run cannot continue
    them): a file missing or not a report, other kernel sources than the tree's
    (their results would not be this code's), another sanitizer tool (``tool``, None
    without one) or another part (``part``, None for the whole run) than this run's."""
    kernel_hash = kernel_hash or kernel_source_hash()
    this_part = list(part) if part else None
    reports = []
    for p in paths:
        try:
            rep = json.loads(Path(p).read_text())
        except OSError as e:
            return None, f"cannot read {p}: {e.strerror or e}"
        except ValueError:
            return None, f"{p} is not a report (not JSON)"
        if not (isinstance(rep, dict) and isinstance(rep.get("provenance"), dict)
                and isinstance(rep.get("tests"), list)
                and all(isinstance(t, dict) and "test" in t and "outcome" in t
                        for t in rep["tests"])):
            return None, f"{p} is not a report (no provenance or per-test outcomes)"
        theirs = rep["provenance"].get("kernel_source_hash")
        if theirs != kernel_hash:
            return None, (f"{p} measured other kernel sources ({theirs}) than the tree's "
                          f"({kernel_hash})")
        their_tool = (rep.get("sanitizer") or {}).get("tool")
        if their_tool != tool:
            return None, (f"{p} ran under sanitizer {their_tool or '(none)'}, this run under "
                          f"{tool or '(none)'}")
        their_part = list(rep.get("part") or ()) or None
        if their_part != this_part:
            return None, f"{p} ran part {_part_name(their_part)}, this run {_part_name(this_part)}"
        reports.append(rep)
    return reports, None


def _part_name(part):
    """A part as "i/n", or "(whole)" for none."""
    return f"{part[0]}/{part[1]}" if part else "(whole)"


def deselect_args(prev_reports, pytest_args=(), root=ROOT):
    """``--deselect NODEID`` for each test the earlier reports hold, once, whatever its
    outcome; only those of the test files ``pytest_args`` names (all, if they name
    none). pytest deselects by node-id prefix, so an unparametrized test whose name
    begins another test's name in its file (test_one and test_one_more) is left to
    run again: deselecting it would drop the other, never run."""
    named = {os.path.normpath(a) for a in pytest_args if a.endswith(".py")}
    out, seen = [], set()
    for rep in prev_reports:
        for t in rep.get("tests", []):
            nodeid = t["test"]
            path = os.path.normpath(nodeid.split("::")[0])
            if nodeid in seen or (named and path not in named):
                continue
            seen.add(nodeid)
            if nodeid.endswith("]") or not _prefix_of_another(nodeid, root):
                out += ["--deselect", nodeid]
    return out


def _prefix_of_another(nodeid, root=ROOT):
    """Whether the function an unparametrized node id names begins the name of another
    function defined in its file (so its id is a prefix of that test's)."""
    path, _, rest = nodeid.partition("::")
    func = rest.rsplit("::", 1)[-1]
    text = _source(str(Path(root) / path))
    return text is not None and re.search(rf"\bdef {re.escape(func)}\w", text) is not None


@functools.lru_cache(maxsize=None)
def _source(path):
    """A test file's text (None when it cannot be read), read once however many of
    its tests ``deselect_args`` looks up."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def resume_report(prev_reports, new_report, prev_paths):
    """(the union of a resumed run's report with the reports it continued, its exit
    status). Tests: theirs, then the new run's (one record a node id, the new run's
    where both hold one), counts recounted. The new run's provenance, wall seconds,
    ``interrupted``, command and part, with ``provenance.resumed_from`` recording each
    earlier report (path, timestamp, wall seconds, interrupted, exit status, counts,
    and its own ``resumed_from``). Exit status: the new run's, 1 where it is 0 and a
    test of the union failed or erred. Sanitizer: error summaries, errors and inline
    errors summed; the new run's control, caught only if every run's was; the new
    run's note, plus one naming the earlier reports' notes. The status follows
    ``report_status``, the ERROR SUMMARY judged on the new run (the earlier ones were
    cut: their errors count inline)."""
    tests = {}
    for rep in [*prev_reports, new_report]:
        for t in rep.get("tests", []):
            tests.pop(t["test"], None)
            tests[t["test"]] = t
    tests = list(tests.values())
    counts = outcome_counts(tests)
    report = dict(new_report, tests=tests, counts=counts)
    report["provenance"] = dict(new_report.get("provenance") or {}, resumed_from=[
        _resumed_entry(p, r) for p, r in zip(prev_paths, prev_reports)])
    if report.get("exit_status") == 0 and (counts.get("failed") or counts.get("error")):
        report["exit_status"] = 1
    runs = [*prev_reports, new_report]
    sans = [r["sanitizer"] for r in runs if r.get("sanitizer")]
    if sans:
        report["sanitizer"] = _sanitizer_union(sans, new_report, prev_reports, prev_paths)
    return report, report_status(report, last=new_report)


def _resumed_entry(path, rep):
    """What a resumed report's union records of one earlier report."""
    prov = rep.get("provenance") or {}
    entry = {"path": str(path), "timestamp": prov.get("timestamp") or prov.get("timestamps"),
             "wall_seconds": prov.get("wall_seconds"), "interrupted": rep.get("interrupted"),
             "exit_status": rep.get("exit_status"), "counts": rep.get("counts")}
    if prov.get("resumed_from"):  # itself a union: the runs before it
        entry["resumed_from"] = prov["resumed_from"]
    return entry


def _sanitizer_union(sans, new_report, prev_reports, prev_paths):
    """The sanitizer record of a resumed report's union (``resume_report``)."""
    san = dict(new_report.get("sanitizer") or {"tool": sans[0].get("tool")})
    for key in ("error_summaries", "errors", "errors_reported_inline"):
        san[key] = sum(x.get(key) or 0 for x in sans)
    controls = [x["control"] for x in sans if x.get("control") is not None]
    if controls:
        mine = (new_report.get("sanitizer") or {}).get("control") or controls[-1]
        san["control"] = dict(mine, caught=all(c.get("caught") for c in controls))
    notes = [san["note"]] if san.get("note") else []
    theirs = [f"{p}: {r['sanitizer']['note']}" for p, r in zip(prev_paths, prev_reports)
              if (r.get("sanitizer") or {}).get("note")]
    if theirs:
        notes.append("a resumed report has a note (" + "; ".join(theirs) + ")")
    san.pop("note", None)
    if notes:
        san["note"] = "; ".join(notes)
    return san


def outcome_counts(tests):
    """{outcome: number of tests} of a report's test records."""
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return counts


CONTROLLED = ("memcheck", "racecheck")


def sanitizer_prefix(tool):
    """The compute-sanitizer command line the suite and its positive control share."""
    return ["compute-sanitizer", "--tool", tool, "--print-limit", "20"]


def run_control(tool, env):
    """Run ``validation.sanitizer_control``'s planted defect under ``tool`` with the
    suite's options; {"errors", "caught", "command"} (None for a tool without one).
    Its output goes to this stage's log, ahead of the suite's."""
    if tool not in CONTROLLED:
        return None
    cmd = [*sanitizer_prefix(tool), sys.executable, "-m", "validation.sanitizer_control", tool]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        text = done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"(control did not run: {e})"
    text = text if text.endswith("\n") else text + "\n"
    print(f"== positive control: {' '.join(cmd)}\n{text}== end of control", flush=True)
    return control_verdict(text, cmd)


def control_verdict(text, cmd=()):
    """The control's record from its output: caught when the tool's summary counts
    at least one error (memcheck) or hazard (racecheck)."""
    errors = sum(sanitizer_summaries(text))
    return {"errors": errors, "caught": errors > 0, "command": " ".join(cmd)}


def part_files(i, n, root=ROOT, files=None):
    """The test files of part ``i`` of ``n``: ``files`` (default every
    ``tests/test_*.py``) dealt, largest first, to the part with the fewest bytes so
    far (file size stands in for the work; the parts of one tree are the same on
    every machine), in name order."""
    files = files if files is not None else list((root / "tests").glob("test_*.py"))
    files = sorted(set(files), key=lambda f: (-f.stat().st_size, f.name))
    loads, parts = [0] * n, [[] for _ in range(n)]
    for f in files:
        k = min(range(n), key=lambda j: (loads[j], j))
        loads[k] += f.stat().st_size
        parts[k].append(f)
    return sorted(parts[i])


def part_args(pytest_args, part, root=ROOT):
    """``pytest_args`` for part ``(i, n)``: the test files it names (all of
    ``tests/`` if it names none) replaced by this part's share of them; None when
    the part holds no file."""
    named = [a for a in pytest_args if a.endswith(".py") and (root / a).is_file()]
    mine = part_files(*part, root=root, files=[root / a for a in named] or None)
    if not mine:
        return None
    return ([a for a in pytest_args if a not in named]
            + [f.relative_to(root).as_posix() for f in mine])


def merge(args):
    """Join the reports of the parts of one run into ``OUT/NAME.json``: the tests and
    counts of all, interrupted if any part was or one is missing, the first
    non-zero exit status. Parts of different commits or kernel sources are refused."""
    reps = [json.loads(Path(p).read_text()) for p in args.merge]
    keys = {(r["provenance"].get("git_commit"), r["provenance"].get("kernel_source_hash"))
            for r in reps}
    if len(keys) != 1:
        print(f"gpu_suite --merge: the parts measured different code: {sorted(keys)}",
              file=sys.stderr)
        return 2
    parts = [tuple(r.get("part") or ()) for r in reps]
    ns = {p[1] for p in parts if p}
    if len(ns) != 1 or len(set(parts)) != len(parts) or not all(parts):
        print(f"gpu_suite --merge: expected the parts i/n of one --part run, got {parts}",
              file=sys.stderr)
        return 2
    n = ns.pop()
    missing = sorted(set(range(n)) - {p[0] for p in parts})
    tests = [t for r in reps for t in r.get("tests", [])]
    counts = outcome_counts(tests)
    statuses = [r.get("exit_status") for r in reps]
    prov = dict(reps[0]["provenance"])
    prov["wall_seconds"] = round(sum(r["provenance"].get("wall_seconds") or 0 for r in reps), 1)
    prov["timestamps"] = [r["provenance"].get("timestamp") for r in reps]
    report = {
        "provenance": prov,
        "interrupted": bool(missing) or any(r.get("interrupted") for r in reps),
        "command": " ; ".join(r.get("command", "") for r in reps),
        "exit_status": next((s for s in statuses if s), 0 if None not in statuses else None),
        "mode": reps[0].get("mode"),
        "counts": counts,
        "tests": tests,
        "parts": [{"part": f"{p[0]}/{p[1]}", "wall_seconds": r["provenance"].get("wall_seconds"),
                   "interrupted": r.get("interrupted"), "exit_status": r.get("exit_status"),
                   "counts": r.get("counts")} for p, r in zip(parts, reps)],
        "parts_missing": missing,
    }
    sans = [r["sanitizer"] for r in reps if "sanitizer" in r]
    if sans:
        report["sanitizer"] = {
            "tool": sans[0].get("tool"),
            "error_summaries": sum(x.get("error_summaries") or 0 for x in sans),
            "errors": sum(x.get("errors") or 0 for x in sans)}
        notes = []
        if len(sans) != len(reps) or any(not x.get("error_summaries") for x in sans):
            notes.append("a part has no ERROR SUMMARY line: did the tool run?")
        controls = [x.get("control") for x in sans]
        if any(c is not None for c in controls):
            report["sanitizer"]["control"] = {
                "caught": all(c is not None and c.get("caught") for c in controls),
                "errors": [c and c.get("errors") for c in controls]}
            if not report["sanitizer"]["control"]["caught"]:
                notes.append("a part's positive control was not caught")
        if notes:
            report["sanitizer"]["note"] = "; ".join(notes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or 'suite'}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_suite: {counts} from {len(reps)} of {n} parts -> {path}")
    san = report.get("sanitizer") or {}
    return 1 if (missing or report["interrupted"] or counts.get("failed")
                 or counts.get("error") or report["exit_status"] or san.get("errors")
                 or san.get("note")) else 0


_OUTCOME = re.compile(
    r"^(?:\[gw\d+\] \[ *\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/.+?)\s*$"
    r"|(tests/.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: +\[ *\d+%\])?\s*$)")


# a run cut by its time limit (SIGINT) ends before compute-sanitizer prints its summary
CUT_NOTE = ("the run was cut before the tool's ERROR SUMMARY; errors_reported_inline counts "
            "the error records it printed until then")


def inline_errors(text):
    """Error records compute-sanitizer printed as they happened (one a hazard or bad
    access: ``========= Invalid ...``, ``Race ...``, ``Error ...``, ``Warning: Race
    ...`` (racecheck's summary counts its warnings too), ``Program hit ...``); with no
    closing summary (a cut run) they are what the log can tell."""
    return len(re.findall(r"^========= (Invalid|Race|Error|Warning: Race|Program hit)", text,
                          re.M))


def sanitizer_summaries(text):
    """Error counts of compute-sanitizer's closing lines: ``ERROR SUMMARY: N errors``
    (memcheck, initcheck, synccheck) or ``RACECHECK SUMMARY: N hazards displayed
    (E errors, W warnings)`` (racecheck: hazards count, warnings included)."""
    found = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    found += [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)]
    return found


# pytest -v's words for an expected failure, named as its summary line names them
# (and as tests/conftest.py records them)
_OUTCOME_NAMES = {"XFAIL": "xfailed", "XPASS": "xpassed"}


def parse_log(text):
    """Per-test outcomes of a ``pytest -v`` log (plain or pytest-xdist lines)."""
    tests = {}
    for line in text.splitlines():
        m = _OUTCOME.match(line.strip())
        if m:
            outcome, nodeid = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            tests[nodeid] = _OUTCOME_NAMES.get(outcome, outcome.lower())
    return [{"test": k, "outcome": v} for k, v in tests.items()]


CONTROL_BLOCK = re.compile(r"^== positive control: (.*?)\n(.*?)^== end of control\n?", re.M | re.S)


def split_control(text):
    """(the log without its positive-control block, the control's record or None)."""
    m = CONTROL_BLOCK.search(text)
    if not m:
        return text, None
    return text[:m.start()] + text[m.end():], control_verdict(m.group(2), m.group(1).split())


def from_log(args):
    """Write the report of a cut run from its streamed log (with ``--resume``, its
    union with the reports that run continued); returns its exit status."""
    prevs = None
    if args.resume:  # the run's tool: its option, else its report's name (gpu_all's form)
        name_tool = (args.name.replace("sanitizer-", "").split("-")[0]
                     if (args.name or "").startswith("sanitizer-") else None)
        prevs, why = read_resumed(args.resume, args.sanitizer or name_tool, args.part)
        if why:
            print(f"gpu_suite --from-log --resume: {why}", file=sys.stderr)
            return 2
    text, control = split_control(Path(args.from_log).read_text(errors="replace"))
    tests = parse_log(text)
    counts = outcome_counts(tests)
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
    if args.part:  # the log of one part of a --part run: --merge joins it with the others
        report["part"] = list(args.part)
    status = 1 if counts.get("failed") or counts.get("error") or sum(summaries) else 0
    if control is not None and not control["caught"]:
        status = status or 5
    if "COMPUTE-SANITIZER" in text:
        report["sanitizer"] = {
            # sanitizer-<tool>[-<what>]: e.g. sanitizer-memcheck-full
            "tool": args.name.replace("sanitizer-", "").split("-")[0] if args.name else None,
            "error_summaries": len(summaries), "errors": sum(summaries),
            "errors_reported_inline": inline_errors(text), "control": control,
            "note": "" if summaries else CUT_NOTE}
    if prevs:
        report, status = resume_report(prevs, report, args.resume)
        counts = report["counts"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or 'suite'}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_suite: {counts} (interrupted: {not finished}) -> {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
