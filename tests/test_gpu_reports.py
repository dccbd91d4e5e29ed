"""``validation.gpu_reports``: every GPU report's provenance is read, and a report of
other kernel sources, or of none, is never called fresh. Plain process: no kernels run."""

from __future__ import annotations

import json

from validation import gpu_reports
from validation.provenance import ROOT, log_header

CODE, CRIT = "c0de" * 4, "c417" * 4


def _prov(kernel=CODE, crit=CRIT, commit="a" * 40):
    return {"git_commit": commit, "kernel_source_hash": kernel, "criterion_hash": crit,
            "device": "NVIDIA H200", "timestamp": "2026-12-06T00:00:00Z"}


def _tree(tmp_path, *, bench=CODE, ncu=CODE, suite=CODE, crit=CRIT, log=CODE):
    r = tmp_path / "reports"
    (r / "gpu" / "logs").mkdir(parents=True)
    (r / "bench" / "ncu").mkdir(parents=True)
    (r / "validation.json").write_text(json.dumps({"provenance": _prov(crit=crit)}))
    (r / "gpu" / "suite.json").write_text(json.dumps({"provenance": _prov(suite)}))
    (r / "bench" / "summary.md").write_text(
        "# Benchmarks\n\nProduced by `scripts/bench`. Provenance:\n\n```\n"
        + json.dumps(_prov(bench), indent=1) + "\n```\n\n## Decode\n| a | {b} |\n")
    (r / "bench" / "ncu" / "x.txt").write_text(
        "# ncu --clock-control none: x\n# command: ncu -k regex:{x} ...\n"
        + "".join(f"# {line}\n" for line in json.dumps(_prov(ncu), indent=1).splitlines())
        + "==PROF== Connected {not json}\n")
    (r / "gpu" / "logs" / "suite.log").write_text(
        f"# gpu_all suite: {json.dumps(_prov(log))}\n{{'pytest': 'output'}}\n")
    (r / "gpu" / "logs" / "suite.rc").write_text("0\n")
    (r / "gpu" / "logs" / "old.log").write_text("==PROF== no header\n# gpu_all x: {}\n")
    return r


def _states(r):
    return {row["path"]: row["state"] for row in gpu_reports.inventory(r, CODE, CRIT)}


def test_every_format_is_read_and_fresh_when_it_measured_these_sources(tmp_path):
    r = _tree(tmp_path)
    assert _states(r) == {
        "validation.json": "fresh", "gpu/suite.json": "fresh", "bench/summary.md": "fresh",
        "bench/ncu/x.txt": "fresh", "gpu/logs/suite.log": "fresh",
        "gpu/logs/old.log": "unknown",  # a header anywhere but the first line does not count
    }
    row = next(x for x in gpu_reports.inventory(r, CODE, CRIT) if x["kind"] == "bench")
    assert (row["commit"], row["device"]) == ("aaaaaaa", "NVIDIA H200")


def test_other_kernel_sources_are_stale_in_every_format(tmp_path):
    # positive control for the fresh verdict above: each file alone measured other
    # sources, and only that file turns stale
    for field, path in [("bench", "bench/summary.md"), ("ncu", "bench/ncu/x.txt"),
                        ("suite", "gpu/suite.json"), ("log", "gpu/logs/suite.log")]:
        r = _tree(tmp_path / field, **{field: "0ld0" * 4})
        states = _states(r)
        assert states.pop(path) == "stale", path
        assert states.pop("gpu/logs/old.log") == "unknown"
        assert set(states.values()) == {"fresh"}, (field, states)


def test_a_cut_run_of_these_sources_is_partial(tmp_path):
    r = _tree(tmp_path)
    rep = json.loads((r / "gpu" / "suite.json").read_text())
    (r / "gpu" / "suite.json").write_text(json.dumps(dict(rep, interrupted=True)))
    assert _states(r)["gpu/suite.json"] == "partial"
    for rc in ("124\n", None):  # a stage cut by its time limit, or before it wrote a status
        (r / "gpu" / "logs" / "suite.rc").unlink(missing_ok=True)
        if rc:
            (r / "gpu" / "logs" / "suite.rc").write_text(rc)
        assert _states(r)["gpu/logs/suite.log"] == "partial", rc
    (r / "gpu" / "logs" / "suite.rc").write_text("1\n")  # it ran to the end and failed
    assert _states(r)["gpu/logs/suite.log"] == "fresh"


def test_validation_judged_under_another_criterion_is_stale(tmp_path):
    assert _states(_tree(tmp_path, crit="0ld0" * 4))["validation.json"] == "stale"


def test_a_sanitizer_report_whose_control_was_not_caught_says_so(tmp_path):
    """Its 0 errors say nothing, so the inventory notes it whatever its state;
    control: the same report with the control caught, and one with no control
    (a suite report), carry no note."""
    r = _tree(tmp_path)

    def sanitizer(name, caught):
        (r / "gpu" / f"{name}.json").write_text(json.dumps({
            "provenance": _prov(), "sanitizer": {"tool": "racecheck", "errors": 0,
                                                 "control": {"errors": 0, "caught": caught}}}))

    sanitizer("sanitizer-missed", False)
    sanitizer("sanitizer-caught", True)
    rows = {row["path"]: row for row in gpu_reports.inventory(r, CODE, CRIT)}
    assert rows["gpu/sanitizer-missed.json"]["note"] == "positive control not caught"
    assert rows["gpu/sanitizer-missed.json"]["state"] == "fresh"
    assert rows["gpu/sanitizer-caught.json"]["note"] == ""
    assert rows["gpu/suite.json"]["note"] == ""
    text = "\n".join(gpu_reports.table(list(rows.values())))
    assert text.count("(positive control not caught)") == 1


def test_log_header_round_trips(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text(log_header("suite") + "\n============ 3 passed ============\n")
    prov = gpu_reports.read_provenance(log)
    from validation.provenance import kernel_source_hash

    assert prov["kernel_source_hash"] == kernel_source_hash()


def test_the_committed_bench_and_gpu_reports_state_their_provenance():
    # a file under reports/ that states no provenance cannot be told fresh or stale;
    # logs are left out here (their header is written by scripts/gpu_all since f8ff167)
    rows = [x for x in gpu_reports.inventory(ROOT / "reports") if x["kind"] != "stage log"]
    assert rows, "no GPU reports found under reports/"
    assert [x["path"] for x in rows if x["state"] == "unknown"] == []


def test_the_validation_notes_defect_suites_other_than_the_trees(tmp_path):
    """A validation report names whether the defect suites it ran are the tree's
    (``suites_hash``): the same ones say nothing, others and none are noted, and the
    state stays fresh (the sweep and growth are still the tree's). Control: a
    suite report's note ignores the suites hash."""
    from validation.provenance import suites_hash

    r = _tree(tmp_path)

    def validation_row(**prov):
        (r / "validation.json").write_text(json.dumps({"provenance": dict(_prov(), **prov)}))
        return next(x for x in gpu_reports.inventory(r, CODE, CRIT, "5u17" * 4)
                    if x["kind"] == "validation")

    same = validation_row(suites_hash="5u17" * 4)
    assert (same["state"], same["note"]) == ("fresh", "")
    other = validation_row(suites_hash="0ld5" * 4)
    assert other["state"] == "fresh" and "defect suites have changed" in other["note"]
    assert "not recorded" in validation_row()["note"]
    suite = next(x for x in gpu_reports.inventory(r, CODE, CRIT, "5u17" * 4)
                 if x["path"] == "gpu/suite.json")
    assert suite["note"] == ""
    # the hash follows the suites' sources: one suite edited, the hash moves
    tree = tmp_path / "tree" / "validation"
    tree.mkdir(parents=True)
    for name in ("suite.py", "defects.py", "suite_a.py"):
        (tree / name).write_text(f"# {name}\n")
    before = suites_hash(tree.parent)
    (tree / "suite_a.py").write_text("# suite_a.py, a case more\n")
    assert suites_hash(tree.parent) != before and len(before) == 16
