"""The GPU suite report: parsing a streamed pytest log and compute-sanitizer's verdicts.

A GPU run cut short leaves only its log; these tests make sure that log is read
faithfully (a failure is never lost, test ids with spaces stay whole) and that a
sanitizer's summary line is recognised for both tools, hazards included. A run
resumed from a cut one (``--resume``) runs only what that report lacks and reports
the union of both.
"""

import json
from pathlib import Path

import pytest

from validation.gpu_suite import main, parse_log, sanitizer_summaries

XDIST_LOG = """\
attention test mode: gpu (device: NVIDIA H200)
[gw0] [ 10%] PASSED tests/test_a.py::test_one[q rank]
[gw1] [ 20%] FAILED tests/test_a.py::test_two[32-8-64-4096]
[gw1] [ 30%] SKIPPED tests/test_b.py::test_three
"""

PLAIN_LOG = """\
========= COMPUTE-SANITIZER
attention test mode: gpu-small (device: NVIDIA H200)
tests/test_a.py::test_one PASSED                                        [ 50%]
tests/test_a.py::test_two[x y] PASSED                                   [100%]
==== 2 passed in 3.50s ====
========= RACECHECK SUMMARY: 2 hazards displayed (1 errors, 1 warnings)
"""


def test_parse_xdist_and_plain_lines():
    got = {t["test"]: t["outcome"] for t in parse_log(XDIST_LOG)}
    assert got == {"tests/test_a.py::test_one[q rank]": "passed",
                   "tests/test_a.py::test_two[32-8-64-4096]": "failed",
                   "tests/test_b.py::test_three": "skipped"}
    got = {t["test"]: t["outcome"] for t in parse_log(PLAIN_LOG)}
    assert got == {"tests/test_a.py::test_one": "passed",
                   "tests/test_a.py::test_two[x y]": "passed"}


def test_sanitizer_summaries_of_both_tools():
    assert sanitizer_summaries("========= ERROR SUMMARY: 3 errors") == [3]
    assert sanitizer_summaries(PLAIN_LOG) == [2]
    assert sanitizer_summaries("no summary here") == []


def test_report_from_a_cut_log_keeps_the_failure(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text(XDIST_LOG)
    prov = tmp_path / "run.json"
    prov.write_text(json.dumps({"provenance": {"git_commit": "abc", "kernel_source_hash": "h"}}))
    status = main(["--from-log", str(log), "--provenance-from", str(prov), "--name", "suite",
                   "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "suite.json").read_text())
    assert status == 1, "a failed test must make the rebuilt report fail"
    assert rep["interrupted"] is True and rep["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert rep["provenance"]["device"] == "NVIDIA H200"
    assert rep["provenance"]["git_commit"] == "abc"


def test_report_from_a_sanitizer_log_counts_hazards(tmp_path):
    log = tmp_path / "racecheck.log"
    log.write_text(PLAIN_LOG)
    assert main(["--from-log", str(log), "--name", "sanitizer-racecheck",
                 "--out", str(tmp_path)]) == 1
    rep = json.loads((tmp_path / "sanitizer-racecheck.json").read_text())
    assert rep["interrupted"] is False
    assert rep["sanitizer"]["errors"] == 2


def test_report_from_a_log_cut_by_sigint_says_interrupted(tmp_path):
    """pytest still prints its summary line after the SIGINT of a stage's time
    limit: the KeyboardInterrupt banner marks the run as cut all the same."""
    banner = "!" * 30 + " KeyboardInterrupt " + "!" * 30
    cut = PLAIN_LOG.replace("\n=", f"\n{banner}\n=", 1)
    for text, want in ((PLAIN_LOG, False), (cut, True)):
        log = tmp_path / "racecheck.log"
        log.write_text(text)
        main(["--from-log", str(log), "--name", "sanitizer-racecheck", "--out", str(tmp_path)])
        rep = json.loads((tmp_path / "sanitizer-racecheck.json").read_text())
        assert rep["interrupted"] is want
    main(["--from-log", str(log), "--name", "sanitizer-racecheck-partial", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "sanitizer-racecheck-partial.json").read_text())
    assert rep["sanitizer"]["tool"] == "racecheck"


def test_report_from_a_gpu_all_log_takes_the_provenance_of_its_header(tmp_path):
    header = json.dumps({"git_commit": "f00d", "kernel_source_hash": "k" * 16,
                         "device": "NVIDIA H200"})
    log = tmp_path / "suite.log"
    log.write_text(f"# gpu_all suite: {header}\n" + XDIST_LOG)
    main(["--from-log", str(log), "--name", "suite", "--out", str(tmp_path)])
    prov = json.loads((tmp_path / "suite.json").read_text())["provenance"]
    assert (prov["git_commit"], prov["kernel_source_hash"]) == ("f00d", "k" * 16)
    # control: the same log without its header states no commit
    log.write_text(XDIST_LOG)
    main(["--from-log", str(log), "--name", "suite", "--out", str(tmp_path)])
    assert "git_commit" not in json.loads((tmp_path / "suite.json").read_text())["provenance"]


def test_parts_deal_every_test_file_once_and_evenly():
    from validation.gpu_suite import part_files
    from validation.provenance import ROOT

    every = sorted((ROOT / "tests").glob("test_*.py"))
    biggest = max(f.stat().st_size for f in every)
    for n in (1, 2, 3, 4):
        parts = [part_files(i, n) for i in range(n)]
        assert sorted(f for p in parts for f in p) == every, n
        sizes = [sum(f.stat().st_size for f in p) for p in parts]
        assert max(sizes) - min(sizes) <= biggest, (n, sizes)
        assert parts == [part_files(i, n) for i in range(n)], "the deal must be deterministic"


def _part_report(tmp_path, i, n, outcomes, commit="c1", interrupted=False):
    rep = {"provenance": {"git_commit": commit, "kernel_source_hash": "k", "wall_seconds": 100.0,
                          "timestamp": f"t{i}"},
           "interrupted": interrupted, "command": f"pytest part {i}",
           "exit_status": 1 if "failed" in outcomes else 0, "mode": "gpu", "part": [i, n],
           "tests": [{"test": f"tests/test_{i}.py::t{k}", "outcome": o}
                     for k, o in enumerate(outcomes)]}
    rep["counts"] = {o: outcomes.count(o) for o in set(outcomes)}
    path = tmp_path / f"part{i}-{commit}.json"
    path.write_text(json.dumps(rep))
    return str(path)


def test_merge_joins_the_parts_and_fails_when_one_is_missing_failed_or_of_other_code(tmp_path):
    def run(*paths):
        status = main(["--merge", *paths, "--name", "suite", "--out", str(tmp_path)])
        return status, json.loads((tmp_path / "suite.json").read_text())

    a = _part_report(tmp_path, 0, 2, ["passed", "passed", "skipped"])
    b = _part_report(tmp_path, 1, 2, ["passed"])
    status, rep = run(a, b)
    assert status == 0 and not rep["interrupted"] and rep["parts_missing"] == []
    assert rep["counts"] == {"passed": 3, "skipped": 1} and len(rep["tests"]) == 4
    assert rep["provenance"]["wall_seconds"] == 200.0
    # controls: each of these must fail the merged report
    status, rep = run(a)  # part 1 of 2 missing
    assert status == 1 and rep["interrupted"] and rep["parts_missing"] == [1]
    status, rep = run(a, _part_report(tmp_path, 1, 2, ["failed"]))
    assert status == 1 and rep["counts"]["failed"] == 1
    status, rep = run(a, _part_report(tmp_path, 1, 2, ["passed"], interrupted=True))
    assert status == 1 and rep["interrupted"]
    assert main(["--merge", a, _part_report(tmp_path, 1, 2, ["passed"], commit="c2"),
                 "--out", str(tmp_path)]) == 2  # parts of different commits
    assert main(["--merge", a, a, "--out", str(tmp_path)]) == 2  # the same part twice


def test_a_part_of_named_files_keeps_the_other_arguments_and_never_runs_all():
    from validation.gpu_suite import part_args

    args = ["-m", "device", "--timeout=150", "tests/test_decode.py", "tests/test_kv_cache.py",
            "-k", "not suite"]
    parts = [part_args(args, (i, 2)) for i in range(2)]
    for p in parts:
        assert p[:3] == ["-m", "device", "--timeout=150"] and p[3:5] == ["-k", "not suite"]
    assert sorted(p[5] for p in parts) == ["tests/test_decode.py", "tests/test_kv_cache.py"]
    assert part_args(args, (2, 3)) is None  # two files, three parts: the third runs nothing
    whole = part_args(["-n", "12"], (0, 1))  # no file named: all of tests/
    assert whole[:2] == ["-n", "12"] and "tests/test_decode.py" in whole


def test_merged_sanitizer_parts_sum_their_errors(tmp_path):
    paths = []
    for i, errors in enumerate((0, 2)):
        rep = json.loads(open(_part_report(tmp_path, i, 2, ["passed"])).read())
        rep["sanitizer"] = {"tool": "memcheck", "error_summaries": 1, "errors": errors}
        path = tmp_path / f"san{i}.json"
        path.write_text(json.dumps(rep))
        paths.append(str(path))
    assert main(["--merge", *paths, "--name", "m", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "m.json").read_text())["sanitizer"]["errors"] == 2
    rep = json.loads(open(paths[1]).read())
    rep["sanitizer"]["errors"] = 0
    open(paths[1], "w").write(json.dumps(rep))
    assert main(["--merge", *paths, "--name", "m", "--out", str(tmp_path)]) == 0  # control


CONTROL = """\
== positive control: compute-sanitizer --tool memcheck python -m validation.sanitizer_control memcheck
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at oob_write+0x90
========= ERROR SUMMARY: {n} errors
== end of control
"""  # noqa: E501 (the control's command line, as the log holds it)


def test_a_sanitizer_log_keeps_its_control_apart_from_the_suite(tmp_path):
    """The control's planted errors must not count against the suite, and a control
    the tool did not catch must fail the stage."""
    from validation.gpu_suite import split_control

    suite = PLAIN_LOG.replace("RACECHECK SUMMARY: 2 hazards displayed (1 errors, 1 warnings)",
                              "ERROR SUMMARY: 0 errors")
    rest, control = split_control(CONTROL.format(n=32) + suite)
    assert rest == suite and control["caught"] and control["errors"] == 32
    log = tmp_path / "memcheck.log"
    for n, want_status in ((32, 0), (0, 5)):
        log.write_text(CONTROL.format(n=n) + suite)
        assert main(["--from-log", str(log), "--name", "sanitizer-memcheck",
                     "--out", str(tmp_path)]) == want_status, n
        san = json.loads((tmp_path / "sanitizer-memcheck.json").read_text())["sanitizer"]
        assert san["errors"] == 0 and san["control"]["caught"] is (n > 0)
    assert split_control(suite) == (suite, None)


def test_merged_sanitizer_note_keeps_every_reason(tmp_path):
    """A part with no summary and a part whose control was not caught: the merged
    note names both (the second no longer replaces the first); control: parts with
    summaries and caught controls merge with no note."""
    def part(i, summaries, caught):
        rep = json.loads(open(_part_report(tmp_path, i, 2, ["passed"])).read())
        rep["sanitizer"] = {"tool": "racecheck", "error_summaries": summaries, "errors": 0,
                            "control": {"errors": int(caught), "caught": caught}}
        path = tmp_path / f"note{i}.json"
        path.write_text(json.dumps(rep))
        return str(path)

    def merged(*paths):
        status = main(["--merge", *paths, "--name", "n", "--out", str(tmp_path)])
        return status, json.loads((tmp_path / "n.json").read_text())["sanitizer"]

    status, san = merged(part(0, 0, True), part(1, 1, False))
    assert status == 1
    assert "no ERROR SUMMARY" in san["note"] and "control was not caught" in san["note"]
    status, san = merged(part(0, 1, True), part(1, 1, True))
    assert status == 0 and "note" not in san


FAKE_INTERPRETER = """\
#!/bin/bash
# stands in for the GPU image's python in scripts/gpu_all: the suite stage ignores
# the limit's SIGINT, as compute-sanitizer still tearing down after pytest did
case "$*" in
  *--log-header*) echo '# gpu_all stage: {"git_commit": "f00d"}' ;;
  *--from-log*) exec "{real}" "$@" ;;
  *validation.gpu_suite*)
    trap '' INT
    echo "attention test mode: gpu-small (device: fake)"
    echo "tests/test_a.py::test_one PASSED                            [ 50%]"
    sleep 4 ;;
  *) exit 3 ;;
esac
"""



def _gpu_all_copy(tmp_path):
    """A copy of scripts/gpu_all in ``tmp_path`` whose interpreter is the fake one
    (``FAKE_INTERPRETER``), killed 1 s past a 1-s memcheck limit; returns the
    environment to run it with. The caller's ATTN_* settings do not reach the copy:
    ATTN_PART (set when gpu_all runs the suite in parts) would rename the stage's log
    and .rc files."""
    import os
    import shutil
    import sys

    from validation.provenance import ROOT

    (tmp_path / "scripts").mkdir()
    for name in ("gpu_all", "_env.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    fake = tmp_path / "python"
    fake.write_text(FAKE_INTERPRETER.replace("{real}", sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_")}
    env.update(ATTN_PYTHON=str(fake), ATTN_KILL_AFTER="1", ATTN_MEMCHECK_SECONDS="1",
               PYTHONPATH=str(ROOT))
    return env

def test_gpu_all_rebuilds_the_report_of_a_stage_its_limit_killed(tmp_path):
    """A test stage that ignores the limit's SIGINT is killed (137) without writing
    its report; gpu_all then rebuilds the report from the stage's log. Control: a
    stage that ends by itself within its limit is left alone (no rebuild)."""
    import subprocess

    env = _gpu_all_copy(tmp_path)
    logs = tmp_path / "reports" / "gpu" / "logs"
    report = tmp_path / "reports" / "gpu" / "sanitizer-memcheck.json"
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_all"), "memcheck"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert (logs / "memcheck.rc").read_text().strip() == "137", done.stdout + done.stderr
    assert "report rebuilt from this log" in (logs / "memcheck.log").read_text()
    rebuilt = json.loads(report.read_text())
    assert rebuilt["interrupted"] and rebuilt["counts"] == {"passed": 1}
    assert rebuilt["provenance"]["git_commit"] == "f00d"
    # control: within its limit the stage ends 0 and nothing is rebuilt
    report.unlink()
    env["ATTN_MEMCHECK_SECONDS"] = "30"
    subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_all"), "memcheck"],
                   env=env, capture_output=True, text=True, timeout=60)
    assert (logs / "memcheck.rc").read_text().strip() == "0"
    assert not report.exists()
    assert "rebuilt" not in (logs / "memcheck.log").read_text()


ARGS_INTERPRETER = """\
#!/bin/bash
# stands in for the GPU image's python in scripts/gpu_all: a test stage prints its
# command line
case "$*" in
  *--log-header*) echo '# gpu_all stage: {"git_commit": "f00d"}' ;;
  *validation.gpu_suite*|"-m bench"*) echo "ARGS: $*" ;;
  *) exit 3 ;;
esac
"""


def _args_copy(tmp_path):
    """A copy of scripts/gpu_all (and tests/, whose files it lists) run by
    ``ARGS_INTERPRETER``: (run(stages, **env) -> {stage: its command line})."""
    import os
    import shutil
    import subprocess

    from validation.provenance import ROOT

    (tmp_path / "scripts").mkdir()
    for name in ("gpu_all", "_env.sh", "bench"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copytree(ROOT / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    fake = tmp_path / "python"
    fake.write_text(ARGS_INTERPRETER)
    fake.chmod(0o755)
    logs = tmp_path / "reports" / "gpu" / "logs"

    def run(stages, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_")}
        env.update(ATTN_PYTHON=str(fake), PYTHONPATH=str(ROOT), **extra)
        subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_all"), *stages], env=env,
                       capture_output=True, text=True, timeout=60)
        part = extra.get("ATTN_PART")  # a part's log: <stage>-part-i-of-n.log
        sfx = "-part-{}-of-{}".format(*part.split("/")) if part else ""
        return {stage: next(line for line in (logs / f"{stage}{sfx}.log").read_text()
                            .splitlines() if line.startswith("ARGS: "))
                for stage in stages}

    return run


def test_gpu_all_runs_the_sanitizer_stages_in_workers_when_asked(tmp_path):
    """ATTN_SANITIZER_WORKERS=3 gives the memcheck and racecheck stages' pytest three
    xdist workers a file each (``-n 3 --dist loadfile``), the tensor-core files
    still named first. Control: unset, their command lines hold no ``-n``."""
    run = _args_copy(tmp_path)
    for stage, line in run(["memcheck", "racecheck"], ATTN_SANITIZER_WORKERS="3").items():
        assert " -n 3 --dist loadfile tests/test_tgemm.py " in line, (stage, line)
        assert f"--sanitizer {stage}" in line
    for stage, line in run(["memcheck", "racecheck"]).items():
        assert " -n " not in line and "--dist" not in line, (stage, line)
        assert " tests/test_tgemm.py " in line


def test_gpu_all_tc_stages_take_the_tensor_core_files_alone(tmp_path):
    """The memcheck_tc and racecheck_tc stages run their sanitizer over the tensor-core
    kernels' test files and no other, each into its own report. Control: the memcheck
    and racecheck stages take those files and others."""
    lines = _args_copy(tmp_path)(["memcheck_tc", "memcheck", "racecheck_tc", "racecheck"])
    tc = ("test_tgemm", "test_mma16", "test_mla_mma", "test_decode_mma", "test_prefill_mma",
          "test_prefill_tf32", "test_decode_mma_fp8", "test_decode_plan_mma",
          "test_registry_mma")
    for tool in ("memcheck", "racecheck"):
        named = [w for w in lines[f"{tool}_tc"].split() if w.startswith("tests/")]
        assert sorted(named) == sorted(f"tests/{f}.py" for f in tc), (tool, named)
        assert f"--name sanitizer-{tool}-tensorcore" in lines[f"{tool}_tc"]
        assert f"--sanitizer {tool}" in lines[f"{tool}_tc"]
        rest = [w for w in lines[tool].split() if w.startswith("tests/")]
        assert set(named) < set(rest) and "tests/test_prefill.py" in rest, tool


def test_gpu_all_passes_the_bench_its_own_options(tmp_path):
    """ATTN_BENCH_ARGS reach the bench's command line word by word (the whole bench in
    two calls: --skip, then --resume). Control: unset, the bench gets no option."""
    run = _args_copy(tmp_path)
    line = run(["bench"], ATTN_BENCH_ARGS="--skip paged,mla_multi,prefill_mma")["bench"]
    assert line == "ARGS: -m bench --skip paged,mla_multi,prefill_mma", line
    assert run(["bench"], ATTN_BENCH_ARGS="--resume")["bench"] == "ARGS: -m bench --resume"
    assert run(["bench"])["bench"] == "ARGS: -m bench"


def test_expected_failures_are_recorded_as_such_not_as_skips():
    """An xfail-marked test that fails is "xfailed" (with its reason), in the plugin's
    record and in a log rebuilt report; pytest itself calls it skipped. Control: a
    real skip stays "skipped"."""
    from types import SimpleNamespace

    import tests.conftest as plugin

    def report(outcome, **kw):
        return SimpleNamespace(when="call", outcome=outcome, skipped=outcome == "skipped",
                               nodeid=f"tests/test_x.py::t_{outcome}_{len(kw)}", duration=0.1,
                               longrepr=("f", 1, "Skipped: why"), **kw)

    before = len(plugin._outcomes)
    plugin.pytest_runtest_logreport(report("skipped", wasxfail="a finding"))
    plugin.pytest_runtest_logreport(report("passed", wasxfail="a finding"))
    plugin.pytest_runtest_logreport(report("skipped"))
    got = [(t["outcome"], t["detail"]) for t in plugin._outcomes[before:]]
    del plugin._outcomes[before:]
    assert got == [("xfailed", "a finding"), ("xpassed", "a finding"), ("skipped", "Skipped: why")]
    log = ("[gw1] [ 86%] XFAIL tests/test_a.py::test_one[x] \n"
           "tests/test_a.py::test_two XPASS                               [100%]\n")
    assert {t["outcome"] for t in parse_log(log)} == {"xfailed", "xpassed"}


def test_inline_error_records_are_counted_and_the_banner_is_not():
    """A cut sanitizer run has no ERROR SUMMARY: its report counts the error records
    compute-sanitizer printed as they happened. Control: the tool's banner and
    pytest's own ``=====`` lines count as none."""
    from validation.gpu_suite import inline_errors

    clean = ("========= COMPUTE-SANITIZER\n"
             "============================= test session starts ==============================\n"
             "tests/test_a.py::test_one PASSED\n")
    assert inline_errors(clean) == 0
    dirty = clean + ("========= Invalid __global__ write of size 4 bytes\n"
                     "=========     at kernel+0xd0\n"
                     "========= Error: Race reported between Write access at k+0x10\n"
                     "========= Warning: Race reported between Read access at k+0x20\n")
    assert inline_errors(dirty) == 3


# ---- --resume: a stage cut by its limit continues from its report ----

def _run_report(tests, exit_status=0, interrupted=False, kernel="k", stamp="t0", wall=100.0,
                sanitizer=None, part=None):
    """A gpu_suite report of ``tests`` ({node id: outcome})."""
    rep = {"provenance": {"git_commit": "c", "kernel_source_hash": kernel, "timestamp": stamp,
                          "wall_seconds": wall},
           "interrupted": interrupted, "command": "pytest", "exit_status": exit_status,
           "mode": "gpu", "tests": [{"test": k, "outcome": v} for k, v in tests.items()]}
    rep["counts"] = {o: list(tests.values()).count(o) for o in set(tests.values())}
    if sanitizer:
        rep["sanitizer"] = sanitizer
    if part:
        rep["part"] = list(part)
    return rep


def test_resume_union_keeps_both_runs_outcomes_and_an_earlier_failure_fails_it():
    """The union holds the cut run's tests (its failure too) and the new run's, counted
    again, with the cut run in ``resumed_from``; the earlier failure makes the union's
    status non-zero though the new run passed. Control: an earlier run with no failure
    gives status 0."""
    from validation.gpu_suite import resume_report

    prev = _run_report({"tests/test_a.py::t1": "passed", "tests/test_a.py::t2": "failed"},
                       exit_status=2, interrupted=True, stamp="t-prev", wall=590.0)
    new = _run_report({"tests/test_b.py::t3": "passed", "tests/test_b.py::t4": "skipped"},
                      stamp="t-new", wall=40.0)
    rep, status = resume_report([prev], new, ["reports/gpu/suite.json"])
    assert [t["test"] for t in rep["tests"]] == ["tests/test_a.py::t1", "tests/test_a.py::t2",
                                                 "tests/test_b.py::t3", "tests/test_b.py::t4"]
    assert rep["counts"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert status == 1 and rep["exit_status"] == 1
    assert rep["interrupted"] is False and rep["provenance"]["wall_seconds"] == 40.0
    assert rep["provenance"]["timestamp"] == "t-new"
    assert rep["provenance"]["resumed_from"] == [
        {"path": "reports/gpu/suite.json", "timestamp": "t-prev", "wall_seconds": 590.0,
         "interrupted": True, "exit_status": 2, "counts": {"passed": 1, "failed": 1}}]
    # a node id both hold keeps the new run's record, once
    again = _run_report({"tests/test_a.py::t2": "passed"})
    rep, _ = resume_report([prev], again, ["p"])
    assert rep["tests"][-1] == {"test": "tests/test_a.py::t2", "outcome": "passed"}
    assert rep["counts"] == {"passed": 2}
    # control: nothing failed in either run
    clean = _run_report({"tests/test_a.py::t1": "passed"}, exit_status=2, interrupted=True)
    rep, status = resume_report([clean], new, ["p"])
    assert status == 0 and rep["exit_status"] == 0 and rep["counts"] == {"passed": 2,
                                                                         "skipped": 1}
    # a new run still cut keeps its own status and says interrupted
    cut = _run_report({"tests/test_b.py::t3": "passed"}, exit_status=2, interrupted=True)
    rep, status = resume_report([clean], cut, ["p"])
    assert status == 2 and rep["interrupted"] is True


def _san(summaries, errors, inline=0, caught=True, note=None):
    san = {"tool": "memcheck", "error_summaries": summaries, "errors": errors,
           "errors_reported_inline": inline,
           "control": {"errors": 9 if caught else 0, "caught": caught, "command": "ctl"}}
    if note:
        san["note"] = note
    return san


def test_resume_union_sums_the_sanitizer_and_catches_the_control_only_if_every_run_did():
    """Error summaries, errors and inline errors add up over the cut run and the new
    one; the control counts as caught only if both runs caught theirs; the cut run's
    note is kept. Controls: both controls caught and no error gives status 0; a new run
    that finished with no ERROR SUMMARY gives 4."""
    from validation.gpu_suite import CUT_NOTE, resume_report

    prev = _run_report({"tests/test_a.py::t1": "passed"}, exit_status=2, interrupted=True,
                       sanitizer=_san(0, 0, inline=2, note=CUT_NOTE))
    new = _run_report({"tests/test_b.py::t2": "passed"}, sanitizer=_san(1, 1, inline=1))
    rep, status = resume_report([prev], new, ["reports/gpu/sanitizer-memcheck.json"])
    san = rep["sanitizer"]
    assert (san["error_summaries"], san["errors"], san["errors_reported_inline"]) == (1, 1, 3)
    assert san["control"]["caught"] is True and san["tool"] == "memcheck"
    assert "sanitizer-memcheck.json: " + CUT_NOTE in san["note"]
    assert status == 3
    # a control missed by the cut run: not caught, though the new run caught its own
    prev["sanitizer"] = _san(0, 0, caught=False, note=CUT_NOTE)
    new["sanitizer"] = _san(1, 0)
    rep, status = resume_report([prev], new, ["p"])
    assert rep["sanitizer"]["control"]["caught"] is False and status == 5
    # control: every control caught, no error anywhere
    prev["sanitizer"] = _san(0, 0, note=CUT_NOTE)
    rep, status = resume_report([prev], new, ["p"])
    assert rep["sanitizer"]["control"]["caught"] is True and status == 0
    new["sanitizer"] = _san(0, 0, note="no ERROR SUMMARY line found: did the tool run?")
    rep, status = resume_report([prev], new, ["p"])
    assert status == 4 and rep["sanitizer"]["note"].startswith("no ERROR SUMMARY")


def test_deselect_args_name_the_earlier_reports_tests_and_no_other(tmp_path):
    """One ``--deselect`` a test the earlier reports hold, failed ones included, none
    for a test they lack or outside the files this run names. pytest deselects by
    prefix: an unparametrized test whose name begins another's in its file is left to
    run again. Control: with no files named, every recorded test is deselected."""
    from validation.gpu_suite import deselect_args

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "def test_one():\n    pass\n\n\ndef test_one_more():\n    pass\n\n\n"
        "def test_two(x):\n    pass\n\n\ndef test_three():\n    pass\n")
    prev = [_run_report({"tests/test_a.py::test_two[1]": "failed",
                         "tests/test_a.py::test_three": "passed",
                         "tests/test_a.py::test_one": "passed"}),
            _run_report({"tests/test_b.py::test_x": "skipped",
                         "tests/test_a.py::test_three": "passed"})]
    args = deselect_args(prev, ["-m", "device", "tests/test_a.py", "-k", "not suite"],
                         root=tmp_path)
    assert args == ["--deselect", "tests/test_a.py::test_two[1]",
                    "--deselect", "tests/test_a.py::test_three"]
    args = deselect_args(prev, ["-n", "4"], root=tmp_path)
    assert args[1::2] == ["tests/test_a.py::test_two[1]", "tests/test_a.py::test_three",
                          "tests/test_b.py::test_x"] and args[::2] == ["--deselect"] * 3


class _FakePytest:
    """Stands in for the pytest process of ``gpu_suite.main``: runs (records as
    passed) each of ``TESTS`` that no ``--deselect`` prefix drops, as pytest does, and
    exits 5 when none is left."""
    TESTS = []
    calls = []

    def __init__(self, cmd, env=None, **kw):
        _FakePytest.calls.append(cmd)
        gone = tuple(cmd[i + 1] for i, a in enumerate(cmd) if a == "--deselect")
        ran = [t for t in self.TESTS if not t.startswith(gone)]
        Path(env["ATTN_TEST_REPORT"]).write_text(json.dumps(
            {"mode": "gpu", "tests": [{"test": t, "outcome": "passed"} for t in ran]}))
        lines = [f"{t} PASSED\n" for t in ran]
        if "compute-sanitizer" in cmd:
            lines = ["========= COMPUTE-SANITIZER\n", *lines, "========= ERROR SUMMARY: 0 errors\n"]
        self.stdout = iter(lines)
        self.returncode = 0 if ran else 5

    def wait(self):
        return self.returncode


def _fake_gpu(monkeypatch, tests):
    """``gpu_suite.main`` on this machine as on a GPU one, its pytest ``_FakePytest``
    running ``tests`` and its sanitizer control caught."""
    import subprocess
    from types import SimpleNamespace

    import attention.core.device
    import validation.gpu_suite as gs

    monkeypatch.setattr(attention.core.device, "gpu_available", lambda: True)
    monkeypatch.setattr(gs, "subprocess", SimpleNamespace(  # the module's own only
        Popen=_FakePytest, PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT))
    # (the real provenance would ask the absent GPU its name)
    monkeypatch.setattr(gs, "provenance", lambda **kw: dict(
        git_commit="c", kernel_source_hash=gs.kernel_source_hash(), timestamp="now", **kw))
    monkeypatch.setattr(gs.signal, "signal", lambda *a: None)
    monkeypatch.setattr(gs, "run_control",
                        lambda tool, env: {"errors": 3, "caught": True, "command": "ctl"})
    monkeypatch.setattr(_FakePytest, "TESTS", list(tests))
    monkeypatch.setattr(_FakePytest, "calls", [])


def test_resume_refuses_reports_of_other_code_tool_or_part_and_runs_nothing(
        tmp_path, monkeypatch, capsys):
    """A missing report, a file that is no report, other kernel sources, another
    sanitizer tool or another part: exit 2, naming the difference, with no pytest run
    and nothing written. Control: a report of this tree, tool and part runs."""
    from validation.provenance import kernel_source_hash

    _fake_gpu(monkeypatch, ["tests/test_a.py::t1"])
    mine = kernel_source_hash()

    def prev(name, **kw):
        path = tmp_path / name
        path.write_text(json.dumps(_run_report({"tests/test_a.py::t0": "passed"}, **kw)))
        return str(path)

    junk = tmp_path / "junk.json"
    junk.write_text('{"hello": 1}')
    out = tmp_path / "out"
    cases = [
        (["--resume", str(tmp_path / "gone.json")], "cannot read"),
        (["--resume", str(junk)], "not a report"),
        (["--resume", prev("k.json", kernel="0" * 16)], "other kernel sources"),
        (["--resume", prev("s.json", kernel=mine, sanitizer=_san(1, 0)),
          "--sanitizer", "racecheck"], "sanitizer memcheck, this run under racecheck"),
        (["--resume", prev("n.json", kernel=mine), "--sanitizer", "memcheck"],
         "sanitizer (none), this run under memcheck"),
        (["--resume", prev("p.json", kernel=mine, part=(0, 2)), "--part", "1/2"],
         "ran part 0/2, this run 1/2"),
        (["--resume", prev("w.json", kernel=mine), "--part", "0/2"],
         "ran part (whole), this run 0/2"),
    ]
    for argv, why in cases:
        capsys.readouterr()
        assert main([*argv, "--out", str(out), "--", "tests/test_a.py"]) == 2, argv
        assert why in capsys.readouterr().err, argv
        assert _FakePytest.calls == [] and not out.exists(), argv
    # control: the same tree, tool and part
    assert main(["--resume", prev("ok.json", kernel=mine, sanitizer=_san(1, 0)), "--sanitizer",
                 "memcheck", "--out", str(out), "--", "tests/test_a.py"]) == 0
    assert len(_FakePytest.calls) == 1 and (out / "sanitizer-memcheck.json").exists()


def test_resume_runs_only_what_the_reports_lack_and_writes_the_union(tmp_path, monkeypatch):
    """A resumed run deselects the cut run's tests (its failure included), runs the
    others and writes the union, failing on the earlier failure. When nothing is left
    (pytest exits 5) the union is still written, with status 0 and a note. Control:
    without --resume every test runs."""
    from validation.gpu_suite import NOTHING_LEFT
    from validation.provenance import kernel_source_hash

    every = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t3[x]"]
    _fake_gpu(monkeypatch, every)
    out = tmp_path / "out"
    assert main(["--out", str(out), "--", "-m", "device"]) == 0  # control: a whole run
    assert json.loads((out / "suite.json").read_text())["counts"] == {"passed": 3}
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(_run_report(
        {"tests/test_a.py::t1": "passed", "tests/test_a.py::t2": "failed"}, exit_status=2,
        interrupted=True, kernel=kernel_source_hash())))
    assert main(["--resume", str(prev), "--out", str(out), "--", "-m", "device"]) == 1
    cmd = _FakePytest.calls[-1]
    assert cmd[cmd.index("-m", 3):][:2] == ["-m", "device"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--deselect"] == every[:2]
    rep = json.loads((out / "suite.json").read_text())
    assert rep["counts"] == {"passed": 2, "failed": 1} and rep["exit_status"] == 1
    assert rep["tests"][-1]["test"] == "tests/test_b.py::t3[x]"
    assert rep["provenance"]["resumed_from"][0]["path"] == str(prev)
    assert "--deselect (2 tests of the resumed reports)" in rep["command"]
    # resumed again from the union: nothing left, the union stands with a note
    union = tmp_path / "union.json"
    union.write_text(json.dumps(rep))
    assert main(["--resume", str(union), "--name", "again", "--out", str(out), "--",
                 "-m", "device"]) == 1  # the first run's failure still fails it
    again = json.loads((out / "again.json").read_text())
    assert again["note"] == NOTHING_LEFT and again["counts"] == rep["counts"]
    assert again["provenance"]["resumed_from"][0]["resumed_from"][0]["path"] == str(prev)
    prev.write_text(json.dumps(_run_report({t: "passed" for t in every},
                                           kernel=kernel_source_hash())))
    assert main(["--resume", str(prev), "--out", str(out), "--", "-m", "device"]) == 0
    rep = json.loads((out / "suite.json").read_text())
    assert rep["exit_status"] == 0 and rep["note"] == NOTHING_LEFT
    assert rep["counts"] == {"passed": 3}


def test_report_from_a_log_with_resume_is_the_union(tmp_path):
    """A resumed run its limit killed: the report rebuilt from its log holds the
    earlier report's tests and the log's, with the earlier failure. Control: without
    --resume the rebuilt report holds the log's tests alone."""
    from validation.provenance import kernel_source_hash

    prev = tmp_path / "sanitizer-memcheck.json"
    prev.write_text(json.dumps(_run_report(
        {"tests/test_c.py::t0": "failed"}, exit_status=2, interrupted=True,
        kernel=kernel_source_hash(), sanitizer=_san(0, 0, inline=1))))
    log = tmp_path / "memcheck.log"
    log.write_text(CONTROL.format(n=4) + "========= COMPUTE-SANITIZER\n" + XDIST_LOG)
    argv = ["--from-log", str(log), "--name", "sanitizer-memcheck", "--out", str(tmp_path / "o")]
    assert main([*argv, "--resume", str(prev)]) == 1
    rep = json.loads((tmp_path / "o" / "sanitizer-memcheck.json").read_text())
    assert rep["counts"] == {"passed": 1, "failed": 2, "skipped": 1}
    assert rep["tests"][0]["test"] == "tests/test_c.py::t0" and rep["interrupted"] is True
    assert rep["provenance"]["resumed_from"][0]["path"] == str(prev)
    assert rep["sanitizer"]["errors_reported_inline"] == 1
    assert rep["sanitizer"]["control"]["caught"] is True
    main(argv)  # control
    rep = json.loads((tmp_path / "o" / "sanitizer-memcheck.json").read_text())
    assert rep["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert "resumed_from" not in rep["provenance"]
    # and it refuses as the run does: another tool than its name's
    assert main([*argv[:3], "sanitizer-racecheck", *argv[4:], "--resume", str(prev)]) == 2


def test_gpu_all_resumes_a_stage_from_its_report_when_asked(tmp_path):
    """ATTN_RESUME=1 gives a test stage ``--resume`` of its report where there is one
    (a part's: the part's report), and none where there is none. Control: without
    ATTN_RESUME the report's presence changes nothing."""
    run = _args_copy(tmp_path)
    gpu = tmp_path / "reports" / "gpu"
    (gpu / "parts").mkdir(parents=True)
    (gpu / "suite.json").write_text("{}")
    (gpu / "sanitizer-racecheck.json").write_text("{}")
    (gpu / "parts" / "suite-part-0-of-2.json").write_text("{}")
    lines = run(["suite", "memcheck", "racecheck"], ATTN_RESUME="1")
    assert "--name suite --resume reports/gpu/suite.json -- " in lines["suite"], lines["suite"]
    assert ("--resume reports/gpu/sanitizer-racecheck.json --sanitizer racecheck -- "
            in lines["racecheck"]), lines["racecheck"]
    assert "--resume" not in lines["memcheck"]  # no report yet: the stage runs whole
    line = run(["suite"], ATTN_RESUME="1", ATTN_PART="0/2")["suite"]
    assert "--resume reports/gpu/parts/suite-part-0-of-2.json -- " in line, line
    assert "--resume" not in run(["suite"], ATTN_RESUME="1", ATTN_PART="1/2")["suite"]
    # control: the reports are there, ATTN_RESUME is not
    for stage, line in run(["suite", "racecheck"]).items():
        assert "--resume" not in line, (stage, line)
    assert "--resume" not in run(["suite"], ATTN_PART="0/2")["suite"]


@pytest.mark.parametrize("part", ["", "0/1"])
def test_gpu_all_rebuilds_a_killed_resumed_stage_as_the_union(tmp_path, part):
    """With ATTN_RESUME=1 the rebuild of a stage (or part) its limit killed continues
    the stage's report too: the rebuilt report holds that report's tests and the
    log's. Control: without ATTN_RESUME it holds the log's alone."""
    import subprocess

    from validation.provenance import kernel_source_hash

    env = dict(_gpu_all_copy(tmp_path), ATTN_PART=part)
    sfx = "-part-0-of-1" if part else ""
    report = tmp_path / "reports" / "gpu" / ("parts" if part else "") / (
        f"sanitizer-memcheck{sfx}.json")
    report.parent.mkdir(parents=True)
    prev = _run_report({"tests/test_z.py::t9": "failed"}, exit_status=2, interrupted=True,
                       kernel=kernel_source_hash(), sanitizer=_san(0, 0, inline=1),
                       part=(0, 1) if part else None)
    for resume, want in (("1", {"passed": 1, "failed": 1}), ("", {"passed": 1})):
        report.write_text(json.dumps(prev))
        done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_all"), "memcheck"],
                              env=dict(env, ATTN_RESUME=resume), capture_output=True,
                              text=True, timeout=60)
        log = (tmp_path / "reports" / "gpu" / "logs" / f"memcheck{sfx}.log").read_text()
        assert "report rebuilt from this log" in log, done.stdout + done.stderr + log
        rebuilt = json.loads(report.read_text())
        assert rebuilt["counts"] == want, (resume, log)
        assert ("resumed_from" in rebuilt["provenance"]) is bool(resume)


def test_a_plain_sigterm_interrupts_pytest_and_the_report_is_still_written(
        tmp_path, monkeypatch):
    """A plain ``timeout`` (SIGTERM, to the whole group) used to kill the writer with
    pytest, and no report was left. Now the SIGTERM is passed on as the limit's SIGINT
    and, where pytest died before writing its outcomes, the report is read from its
    -v lines and says it was interrupted. Control: the same run, not cut, reports
    pytest's own outcomes and no note."""
    import signal

    import validation.gpu_suite as gs

    _fake_gpu(monkeypatch, ["tests/test_a.py::t1"])
    handlers = {}
    monkeypatch.setattr(gs.signal, "signal", lambda sig, h: handlers.__setitem__(sig, h))

    class _CutPytest:
        """pytest -v that gets the SIGTERM after its first test and dies (-15) before
        writing its outcomes."""
        def __init__(self, cmd, env=None, **kw):
            self.returncode, self.sent = None, []
            _CutPytest.last = self
            self.stdout = self._lines()

        def _lines(self):
            yield "tests/test_a.py::t1 PASSED\n"
            yield "tests/test_a.py::t2 FAILED\n"
            handlers[signal.SIGTERM](signal.SIGTERM, None)
            self.returncode = -15

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            self.sent.append(sig)

        def wait(self):
            return self.returncode

    monkeypatch.setattr(gs.subprocess, "Popen", _CutPytest)
    out = tmp_path / "out"
    assert main(["--out", str(out), "--name", "cut", "--", "tests/test_a.py"]) != 0
    report = json.loads((out / "cut.json").read_text())
    assert _CutPytest.last.sent == [signal.SIGINT]
    assert report["interrupted"] is True and "SIGTERM" in report["note"]
    assert {t["test"]: t["outcome"] for t in report["tests"]} == {
        "tests/test_a.py::t1": "passed", "tests/test_a.py::t2": "failed"}
    # control: a run that finishes
    monkeypatch.setattr(gs.subprocess, "Popen", _FakePytest)
    assert main(["--out", str(out), "--name", "whole", "--", "tests/test_a.py"]) == 0
    whole = json.loads((out / "whole.json").read_text())
    assert whole["interrupted"] is False and "note" not in whole
    assert [t["test"] for t in whole["tests"]] == ["tests/test_a.py::t1"]
