"""The committed GPU report must describe the kernels in the tree, or say it does not.

``reports/validation.json`` (written by ``scripts/validate`` on a GPU) records
``kernel_source_hash`` (``validation.provenance``: a hash of the ``attention/``
and ``mla/`` sources); ``reports/summary.md`` repeats it on its
``kernel_source_hash:`` line, and ``criterion_hash`` (the code that judges:
``validation.provenance.CRITERION_FILES``). When either has changed since, the summary
must carry the STALE banner (``scripts/validate --mark-stale`` writes it;
a fresh GPU run removes it). Plain process: no kernels run.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import MODE
from validation import report
from validation.provenance import ROOT, criterion_hash, kernel_source_hash

REPORTS = ROOT / "reports"


def test_committed_gpu_report_is_fresh_or_says_it_is_stale():
    if MODE.startswith("gpu"):
        pytest.skip("on a GPU machine the report is being rewritten (scripts/gpu_all runs the "
                    "validation beside the suite); the check belongs to the checkout that "
                    "commits it (CI)")
    if report.report_file(REPORTS) is None:
        pytest.skip("no GPU report committed yet (reports/validation.json or .json.gz): run "
                    "scripts/validate on a GPU and commit reports/")
    f = report.freshness(REPORTS)
    assert f["device"] not in ("simulator", "none"), (
        f"reports/{report.JSON_NAME} comes from a {f['device']} run; the committed report "
        f"must be a GPU run (simulator runs go to reports/sim/)")
    summary = (REPORTS / report.SUMMARY_NAME).read_text()
    assert report.summary_hash(summary) == f["report_hash"], (
        "reports/summary.md and reports/validation.json come from different runs")
    if f["state"] == "stale":
        assert f["marked"], (
            f"the committed report measured kernel sources {f['report_hash']} under criterion "
            f"{f['report_criterion']}; the code hashes to {f['code_hash']} / "
            f"{f['code_criterion']}: re-run scripts/validate on a GPU, or run "
            f"scripts/validate --mark-stale so reports/summary.md says it is stale")
    else:
        assert not f["marked"], "reports/summary.md says STALE but its hash matches the code"


def _fake_report(folder, kernel_hash, criterion=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / report.JSON_NAME).write_text(json.dumps(
        {"provenance": {"kernel_source_hash": kernel_hash, "device": "NVIDIA H200",
                        "criterion_hash": criterion or criterion_hash()}}))
    (folder / report.SUMMARY_NAME).write_text(
        f"# Validation report\n\nkernel_source_hash: `{kernel_hash}`\n")


def test_stale_report_is_detected_and_marked_once(tmp_path):
    _fake_report(tmp_path, "0123456789abcdef")
    f = report.freshness(tmp_path)
    assert f["state"] == "stale" and not f["marked"]
    report.mark_stale(tmp_path)
    report.mark_stale(tmp_path)  # idempotent: one banner, refreshed
    text = (tmp_path / report.SUMMARY_NAME).read_text()
    assert text.startswith(report.STALE_START) and text.count(report.STALE_MARK) == 1
    assert kernel_source_hash() in text and "0123456789abcdef" in text
    assert report.freshness(tmp_path)["marked"]
    assert report.summary_hash(text) == "0123456789abcdef"


def test_fresh_report_loses_a_stale_banner(tmp_path):
    _fake_report(tmp_path, kernel_source_hash())
    path = tmp_path / report.SUMMARY_NAME
    path.write_text(report.stale_banner("old", "new") + path.read_text())
    assert report.freshness(tmp_path) == {**report.freshness(tmp_path), "state": "fresh",
                                          "marked": True}
    after = report.mark_stale(tmp_path)
    assert after["state"] == "fresh" and not after["marked"]
    assert report.STALE_MARK not in path.read_text()


def test_missing_report_is_reported_missing(tmp_path):
    assert report.freshness(tmp_path)["state"] == "missing"


def test_a_report_judged_under_another_criterion_is_stale(tmp_path):
    _fake_report(tmp_path, kernel_source_hash(), criterion="fedcba9876543210")
    f = report.freshness(tmp_path)
    assert f["state"] == "stale" and f["report_criterion"] == "fedcba9876543210"
    report.mark_stale(tmp_path)
    text = (tmp_path / report.SUMMARY_NAME).read_text()
    assert "criterion" in text and criterion_hash() in text


def test_the_criterion_hash_covers_the_rule_and_the_baselines(tmp_path):
    from validation import provenance

    for name in ("tolerance", "baselines", "metrics", "fixtures", "registry"):
        assert f"validation/{name}.py" in provenance.CRITERION_FILES
    # a changed byte in a criterion file changes the hash (positive control)
    for rel in provenance.CRITERION_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    before = provenance.criterion_hash(tmp_path)
    assert before == criterion_hash()
    path = tmp_path / "validation/tolerance.py"
    path.write_text(path.read_text().replace("MEAN_RATIO = 1.5", "MEAN_RATIO = 1.6"))
    assert provenance.criterion_hash(tmp_path) != before
