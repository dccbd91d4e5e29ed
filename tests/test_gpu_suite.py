"""The GPU suite report: parsing a streamed pytest log and compute-sanitizer's verdicts.

A GPU run cut short leaves only its log; these tests make sure that log is read
faithfully (a failure is never lost, test ids with spaces stay whole) and that a
sanitizer's summary line is recognised for both tools, hazards included.
"""

import json

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
    assert got == {"tests/test_a.py::test_one": "passed", "tests/test_a.py::test_two[x y]": "passed"}


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
    assert main(["--from-log", str(log), "--name", "sanitizer-racecheck", "--out", str(tmp_path)]) == 1
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
