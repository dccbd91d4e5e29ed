"""The validation runner: metrics, fixtures, the defect aggregator, reports, CLI.

Plain-process tests need no kernels (synthetic outputs and fake suites); the
``device`` tests run real kernels at tiny shapes (simulator process, or a
GPU). Each judgment is shown to fail on a known-bad input before it is trusted
to pass a good one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from validation import defects, fixtures, metrics, registry, report
from validation.tolerance import FLOOR_ULPS, MEAN_RATIO

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------


def _oracle_and_baseline(seed=0, n=64):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((4, n))
    base = (ref + rng.standard_normal(ref.shape) * 1e-6).astype(np.float64)
    return ref, base


def test_judge_passes_a_result_as_good_as_the_baseline():
    ref, base = _oracle_and_baseline()
    rec = metrics.judge(base, ref, base)
    assert rec["passed"] and rec["nonfinite_ok"]
    assert rec["ratio"] == pytest.approx(1.0)
    assert rec["margin"] < 1


def test_judge_fails_an_error_three_times_the_baseline():
    ref, base = _oracle_and_baseline()
    got = ref + 3.0 * (base - ref)  # three times the baseline's error everywhere
    rec = metrics.judge(got, ref, base)
    assert rec["ratio"] == pytest.approx(3.0)
    assert not rec["passed"]
    assert rec["worst_index"] is not None


def test_floor_admits_a_few_roundings_where_the_baseline_is_exact():
    """Baseline exact (ratio infinite): one float32 ulp at one entry passes by the
    floor, a hundred do not. Floor = FLOOR_ULPS * ulp32(max|ref|), no max(1, .)."""
    ref = np.linspace(-2.0, 2.0, 33)
    ulp = float(np.spacing(np.float32(2.0)))
    one_ulp = ref.copy()
    one_ulp[3] += ulp
    rec = metrics.judge(one_ulp, ref, ref)
    assert rec["ratio"] == math.inf and rec["passed"]
    assert rec["floor"] == pytest.approx(FLOOR_ULPS * ulp)
    bad = ref + 100 * ulp
    assert not metrics.judge(bad, ref, ref)["passed"]


def test_floor_follows_small_outputs_down():
    """An output of size 0.01 is held to ulps of 0.01, not of 1."""
    ref = np.full(8, 0.01)
    rec = metrics.judge(ref, ref, ref)
    assert rec["floor"] == pytest.approx(FLOOR_ULPS * float(np.spacing(np.float32(0.01))))
    assert not metrics.judge(ref + 1e-7, ref, ref)["passed"]  # ~100 ulps of 0.01


def test_mean_rule_catches_a_systematic_loss_the_max_rule_lets_through():
    """Every entry 1.8x the baseline's error: under the max rule's 2x, over the
    mean rule's 1.5x (positive control); 1.2x everywhere passes both."""
    ref, base = _oracle_and_baseline(n=4096)
    err = base - ref
    bad = metrics.judge(ref + 1.8 * err, ref, base)
    assert bad["margin"] < 1 and bad["mean_margin"] > 1
    assert not bad["passed"] and bad["failed_by"] == ["mean"]
    good = metrics.judge(ref + 1.2 * err, ref, base)
    assert good["passed"] and good["mean_ratio"] == pytest.approx(1.2)
    assert MEAN_RATIO == 1.5


def test_growth_pools_the_mean_rule_of_small_outputs():
    """A growth run's 24-entry LSE: one step's mean 2x the baseline's (sampling
    noise of a kernel 1.08x the baseline over the run) fails per step but not
    pooled over 96 entries; a systematic 1.8x loss fails every pooled window
    (positive control); outputs of 96 or more entries keep the per-step rule."""
    from validation import growth
    from validation.tolerance import MEAN_MIN_ENTRIES, pooled_mean_windows

    steps = 64
    rng = np.random.default_rng(3)
    base = list(1e-7 * (1 + 0.1 * rng.standard_normal(steps)))
    noisy = [1.08 * b for b in base]
    noisy[17] = 2.0 * base[17]
    floors, counts = [9.5e-7] * steps, [24] * steps
    assert noisy[17] > MEAN_RATIO * base[17] + floors[17] / 24  # fails alone
    windows = pooled_mean_windows(noisy, base, floors, counts)
    assert MEAN_MIN_ENTRIES == 96 and len(windows) == steps // 4
    assert all(w[4] for w in windows)
    systematic = [1.8 * b for b in base]
    assert not any(w[4] for w in pooled_mean_windows(systematic, base, floors, counts))
    # big outputs: each step its own window
    assert len(pooled_mean_windows(noisy, base, floors, [96] * steps)) == steps
    # the growth series: the step's own verdict drops the mean rule, the window keeps it
    series = growth._series()
    for i in range(steps):
        judged = {"lse": {"max_abs": 0.0, "baseline_abs": 0.0, "bound": 1.0,
                          "mean_abs": noisy[i], "baseline_mean": base[i], "floor": floors[i],
                          "n": 24, "failed_by": ["mean"] if i == 17 else [], "passed": i != 17}}
        growth._record_step(series, i + 1, 100 + i, judged)
    assert all(series["passed"]) and growth._pooled_means(series) == []
    series["lse_mean"] = systematic
    assert growth._pooled_means(series) and not any(series["passed"])


def test_a_near_tie_moves_the_max_not_the_mean():
    """One entry at 3x the baseline's largest error (a score rounding the other way)
    fails the max rule; the mean hardly moves."""
    ref, base = _oracle_and_baseline(n=4096)
    got = base.copy()
    got[1, 7] = ref[1, 7] + 3 * np.abs(base - ref).max()
    rec = metrics.judge(got, ref, base)
    assert rec["failed_by"] == ["max"] and rec["mean_margin"] < 1


def test_nan_where_the_oracle_is_finite_fails_even_with_tiny_error():
    ref, base = _oracle_and_baseline()
    got = ref.copy()
    got[2, 5] = np.nan  # a leaked NaN from a poisoned cache row
    rec = metrics.judge(got, ref, base)
    assert not rec["nonfinite_ok"] and not rec["passed"]
    assert "unexpected NaN" in rec["nonfinite_detail"] and "(2, 5)" in rec["nonfinite_detail"]


def test_missing_minus_inf_lse_fails():
    """An empty sequence's LSE is -inf in the oracle; a kernel giving 0 there fails."""
    ref = np.array([[1.0, -np.inf], [0.5, 2.0]])
    got = np.array([[1.0, 0.0], [0.5, 2.0]])
    rec = metrics.judge(got, ref, ref)
    assert not rec["passed"] and "-inf of the oracle missing" in rec["nonfinite_detail"]
    assert metrics.judge(ref.copy(), ref, ref)["passed"]


def test_cosine_difference_and_relative_error():
    x = np.array([1.0, 0.0])
    assert metrics.compare(x, x)["cos_diff"] == 0.0
    assert metrics.compare(np.array([0.0, 1.0]), x)["cos_diff"] == pytest.approx(1.0)
    rec = metrics.compare(np.array([1.1, 2.0]), np.array([1.0, 2.0]))
    assert rec["max_rel"] == pytest.approx(0.1)


def test_shape_mismatch_fails():
    ref, base = _oracle_and_baseline()
    assert not metrics.judge(ref[:, :-1], ref, base)["passed"]


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


def _decode_fixture(seed=0, scores="normal"):
    rng = fixtures.case_rng(seed, "decode", "t", scores)
    return fixtures.decode_inputs(rng, m=3, h=6, h_kv=2, d=40, lens=(5, 0, 3), max_seq=8,
                                  kv_slots=5, scores=scores)


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = _decode_fixture(0), _decode_fixture(0), _decode_fixture(1)
    for key in ("q", "k_cache", "v_cache", "slot_table"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["q"], c["q"])
    # derived from the case name, not from call order or Python's salted hash
    case = registry.find_shape("decode", "gqa9x3_d40", True)
    x1 = registry.make_inputs("decode", case, "normal", 7)
    x2 = registry.make_inputs("decode", case, "normal", 7)
    np.testing.assert_array_equal(x1["k_cache"], x2["k_cache"])


def test_cache_is_poisoned_outside_the_live_rows():
    x = _decode_fixture()
    slots, lens = x["slot_table"], x["seq_lens"]
    assert len(set(slots.tolist())) == 3
    for m in range(3):
        live = x["k_cache"][slots[m], :, :lens[m]]
        assert np.isfinite(live).all()
        assert np.isnan(x["k_cache"][slots[m], :, lens[m]:]).all()
        assert np.isnan(x["v_cache"][slots[m], :, lens[m]:]).all()
    unused = sorted(set(range(5)) - set(slots.tolist()))
    assert unused and np.isnan(x["k_cache"][unused]).all()


def test_large_and_equal_score_fixtures_are_what_they_claim():
    x = _decode_fixture(scores="large")
    peaks = []
    for m in range(3):
        s, n = int(x["slot_table"][m]), int(x["seq_lens"][m])
        for h in range(6):
            if n:
                scores = x["k_cache"][s, h * 2 // 6, :n].astype(np.float64) @ x["q"][m, h] \
                    * x["scale"]
                peaks.append(np.abs(scores).max())
    assert np.allclose(peaks, fixtures.LARGE_SCORE, rtol=1e-5)
    x = _decode_fixture(scores="equal")
    s, n = int(x["slot_table"][0]), int(x["seq_lens"][0])
    keys = x["k_cache"][s, :, :n]  # [H_kv, n, D]: one key repeated, so every score is equal
    assert n > 1 and np.all(keys == keys[:, :1]) and not np.all(keys == 0)


def test_shape_cases_include_the_awkward_sizes():
    full = registry.DECODE_FULL + registry.PREFILL_FULL
    small = registry.DECODE_SMALL + registry.PREFILL_SMALL
    for table in (full, small):
        dims = [s.dims for s in table]
        assert {40, 80, 96, 111} <= {d["d"] for d in dims}
        assert any(d["h"] == 9 and d["h_kv"] == 3 for d in dims)
        assert any(0 in d.get("lens", ()) or d.get("t") == 0 for d in dims)
    lengths = {d["t"] for d in (s.dims for s in registry.PREFILL_FULL)}
    lengths |= {n for s in registry.DECODE_FULL for n in s.dims["lens"]}
    assert {97, 1025} <= lengths


def test_registry_reports_missing_and_broken_modules(tmp_path, monkeypatch):
    spec = replace(registry.KERNELS_BY_NAME["batched_decode"], module="attention.no_such_mod")
    status, why = registry.resolve(spec)
    assert status == "not available" and "does not exist" in why
    (tmp_path / "broken_kernel_mod.py").write_text("raise RuntimeError('half written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = replace(spec, module="broken_kernel_mod")
    status, why = registry.resolve(spec)
    assert status == "broken" and "half written" in why


# ---------------------------------------------------------------------------
# planted-defect aggregation
# ---------------------------------------------------------------------------

FAKE_SUITE = """
from validation.suite import Check
FAMILY = "fake_{name}"
DEFECTS = ("loud", "quiet")
def run_suite(defect=None, *, small=True):
    checks = [Check("values", True)]
    if defect == "loud":
        checks.append(Check("values", False, "off by 3"))
    if defect == "quiet" and {quiet_caught}:
        checks.append(Check("values", False, "off by 1e-3"))
    return checks
"""


def _fake_suite(tmp_path, name, quiet_caught):
    (tmp_path / f"fake_suite_{name}.py").write_text(
        FAKE_SUITE.format(name=name, quiet_caught=quiet_caught))
    return f"fake_suite_{name}"


def test_aggregator_fails_a_family_with_an_escaped_defect(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    escape = _fake_suite(tmp_path, "escape", False)
    full = _fake_suite(tmp_path, "full", True)
    units, broken = defects.units([escape, full, "no_such_suite_module"], small=True)
    assert len(units) == 6 and len(broken) == 1
    fams = {f["family"]: f for f in defects.aggregate([defects.run_unit(u) for u in units],
                                                       broken)}
    assert fams["fake_escape"]["escaped"] == ["quiet"] and not fams["fake_escape"]["passed"]
    assert fams["fake_escape"]["caught"] == 1 and fams["fake_escape"]["planted"] == 2
    assert fams["fake_full"]["passed"] and fams["fake_full"]["caught"] == 2
    assert not fams["no_such_suite_module"]["passed"]


def test_a_suite_that_raises_is_an_error_not_a_catch(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fake_suite_raises.py").write_text(textwrap.dedent("""
        from validation.suite import Check
        FAMILY = "raises"
        DEFECTS = ("boom",)
        def run_suite(defect=None, *, small=True):
            if defect:
                raise IndexError("harness bug")
            return [Check("ok", True)]
    """))
    units, _ = defects.units(["fake_suite_raises"], small=True)
    fam = defects.aggregate([defects.run_unit(u) for u in units])[0]
    assert fam["caught"] == 0 and fam["errors"] and not fam["passed"]


def _run_cli(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    return subprocess.run([sys.executable, "-m", "validation", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_exit_status_follows_the_defect_score(tmp_path):
    """End to end: an escaped defect makes the run exit non-zero; the same run with a
    suite catching everything exits 0 and writes the report."""
    escape = _fake_suite(tmp_path, "escape", False)
    full = _fake_suite(tmp_path, "full", True)
    common = ["--device", "sim", "--kernels", "none", "--growth", "none", "--defects", "none",
              "--jobs", "1", "--no-progress"]
    bad = _run_cli(common + ["--suite-module", escape, "--out", str(tmp_path / "bad")], tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "escaped: quiet" in bad.stdout
    good = _run_cli(common + ["--suite-module", full, "--out", str(tmp_path / "good")], tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    rep = json.loads((tmp_path / "good" / "validation.json").read_text())
    assert rep["defects"][0]["caught"] == 2 and rep["verdict"]["passed"]
    assert rep["provenance"]["device"] == "simulator" and rep["config"]["seeds"] == [0]
    assert "kernel_source_hash:" in (tmp_path / "good" / "summary.md").read_text()


def test_deadline_reports_units_not_run_and_still_writes_the_report(tmp_path):
    """A run cut by --deadline is a failing run with a report that names what did not
    run; --rebuild rewrites its summary from the JSON alone."""
    full = _fake_suite(tmp_path, "full", True)
    out = tmp_path / "cut"
    common = ["--device", "sim", "--kernels", "none", "--growth", "none", "--defects", "none",
              "--no-progress", "--suite-module", full, "--out", str(out)]
    cut = _run_cli(common + ["--jobs", "1", "--deadline", "0"], tmp_path)
    assert cut.returncode == 1, cut.stdout + cut.stderr
    rep = json.loads((out / "validation.json").read_text())
    assert not rep["verdict"]["passed"]
    assert any("deadline" in f for f in rep["verdict"]["failures"])
    (out / "summary.md").unlink()
    rebuilt = _run_cli(["--rebuild", "--out", str(out)], tmp_path)
    assert rebuilt.returncode == 1 and "deadline" in (out / "summary.md").read_text()


def test_resume_runs_what_the_deadline_cut_and_merges(tmp_path, monkeypatch):
    """End to end: a shard cut by --deadline 0 fails; --resume runs exactly the
    units no part finished (here the shard's record of one unit is replaced by a
    finished one) into resume-1.json, and --merge then passes; a second --resume
    finds nothing left and writes nothing. Refused with exit 2 and nothing
    written: --resume with other --seeds (naming 'seeds'), on a folder with no
    parts, and with --shard."""
    monkeypatch.syspath_prepend(str(tmp_path))
    full = _fake_suite(tmp_path, "full", True)
    out = tmp_path / "run"
    common = ["--device", "sim", "--kernels", "none", "--growth", "none", "--defects", "none",
              "--suite-module", full, "--jobs", "1", "--no-progress", "--out", str(out)]
    cut = _run_cli(common + ["--shard", "0/1", "--deadline", "0"], tmp_path)
    assert cut.returncode == 1, cut.stdout + cut.stderr
    shard_file = out / "shards" / "shard-0-of-1.json"
    shard = json.loads(shard_file.read_text())
    assert [u["detail"] for u in shard["defect_units"]] == [NOT_RUN] * 3
    units, _ = defects.units([full], small=True)
    assert shard["config"]["plan"] == report.plan_of(u.id for u in units)
    first = defects.run_unit(units[0])  # this unit finished in the shard
    shard["defect_units"][0] = first
    shard_file.write_text(json.dumps(shard))

    refused = _run_cli(common + ["--resume", "--seeds", "1"], tmp_path)
    assert refused.returncode == 2 and "'seeds' differs" in refused.stderr, refused.stderr
    empty = _run_cli(common[:-1] + [str(tmp_path / "none"), "--resume"], tmp_path)
    assert empty.returncode == 2 and "no parts in" in empty.stderr, empty.stderr
    assert not (tmp_path / "none").exists()
    both = _run_cli(common + ["--resume", "--shard", "0/1"], tmp_path)
    assert both.returncode == 2 and "--shard" in both.stderr
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard-0-of-1.json"]

    resumed = _run_cli(common + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resume part 1 written" in resumed.stdout and "(2 of 3 units run, 0 failing)" \
        in resumed.stdout
    part = json.loads((out / "shards" / "resume-1.json").read_text())
    assert [u["id"] for u in part["defect_units"]] == [u.id for u in units[1:]]
    assert all(u["detail"] != NOT_RUN for u in part["defect_units"])
    assert part["config"]["resumed_from"] == ["shard-0-of-1.json"]
    assert part["config"]["shard"] is None and part["config"]["plan"] == shard["config"]["plan"]
    merged = _run_cli(["--merge", "--out", str(out)], tmp_path)
    assert merged.returncode == 0 and "PASS" in merged.stdout, merged.stdout + merged.stderr
    rep = json.loads((out / "validation.json").read_text())
    assert [u["id"] for u in rep["defect_units"]] == [u.id for u in units]
    again = _run_cli(common + ["--resume"], tmp_path)
    assert again.returncode == 0 and "nothing remains" in again.stdout, again.stdout
    assert not (out / "shards" / "resume-2.json").exists()


def test_cli_help_and_bad_arguments():
    from validation import cli

    with pytest.raises(SystemExit) as ok:
        cli.parser().parse_args(["--help"])
    assert ok.value.code == 0
    with pytest.raises(SystemExit) as bad:
        cli.parser().parse_args(["--shard", "3/2"])
    assert bad.value.code == 2
    assert cli._seeds("0-2,5") == [0, 1, 2, 5]


# ---------------------------------------------------------------------------
# reports (synthetic records: no kernels)
# ---------------------------------------------------------------------------


def _case(kernel, status, ratio, margin, family="batched_decode", shape="s"):
    return {"id": f"{kernel}/{shape}/normal/s0/float32/{status}{ratio}", "kernel": kernel,
            "family": family, "kind": "decode", "shape": shape, "fixture": "normal",
            "seed": 0, "dtype": "float32", "status": status, "passed": status == "pass",
            "ratio": ratio, "margin": margin, "max_abs": margin * 1e-7, "cos_diff": 1e-14,
            "detail": "out: max abs err over bound" if status == "fail" else "",
            "dims": {"d": 40}}


def _growth(status="pass"):
    steps = list(range(1, 9))
    return {"id": "growth/batched_decode/float32/s0/8", "kernel": "batched_decode",
            "dtype": "float32", "seed": 0, "steps": 8, "status": status,
            "passed": status == "pass", "cache_ok": True, "worst_ratio": 1.2,
            "worst_margin": 0.3, "final_err": 1e-7, "final_base": 9e-8, "seconds": 1.0,
            "detail": "", "series": {"step": steps, "out_err": [1e-7 * s for s in steps],
                                     "out_base": [9e-8 * s for s in steps],
                                     "out_bound": [3e-7 * s for s in steps]}}


def _report(cases, growth=None, units=()):
    return report.build(cases=cases, growth=growth or [_growth()], defect_units=list(units),
                        broken_suites=[], config={"seeds": [0], "dtypes": ["float32"],
                                                  "steps": 8, "small": True, "quick": True,
                                                  "command": "scripts/validate", "shard": None},
                        provenance={"kernel_source_hash": "abc123", "device": "simulator",
                                    "git_commit": "x", "versions": {}},
                        wall_seconds=1.0)


def test_report_verdict_summary_and_plots(tmp_path):
    good = _report([_case("batched_decode", "pass", 1.1, 0.2),
                    _case("flash_decode", "pass", math.inf, 0.1)])
    assert good["verdict"]["passed"]
    bad = _report([_case("batched_decode", "pass", 1.1, 0.2),
                   _case("flash_decode", "fail", 5.0, 2.5)])
    assert not bad["verdict"]["passed"] and "flash_decode" in bad["verdict"]["failures"][0]
    report.write(bad, tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "**Verdict: FAIL**" in text and "kernel_source_hash: `abc123`" in text
    assert "| batched_decode | batched_decode, flash_decode | 2 | 1 | 1 |" in text
    assert "![error growth](growth.png)" in text and (tmp_path / "growth.png").stat().st_size
    assert (tmp_path / "ratios.png").exists()
    assert json.loads((tmp_path / "validation.json").read_text())["verdict"]["failures"]
    # failing growth run fails the verdict too
    assert not _report([_case("batched_decode", "pass", 1, 0.2)], [_growth("fail")])[
        "verdict"]["passed"]


def test_report_tables_the_baseline_orders_and_the_resolving_power(tmp_path):
    """The summary names each kernel's baseline order, counts the outputs over each
    rule, and tables the precision mutants: caught / detectable, the misses named;
    a resolving power under 90 % fails the verdict, and so does a mutant that raised."""
    def out(err, base, failed=()):
        return {"max_abs": err, "baseline_abs": base, "mean_abs": err / 3,
                "baseline_mean": base / 3, "failed_by": list(failed), "plain_abs": base,
                "floor": 1e-9, "bound": 2 * base + 1e-9, "passed": not failed}

    def mut(detectable, caught, inert=False):
        return {"inert": inert, "exceeds": detectable, "detectable": detectable,
                "caught": caught, "failed_by": ["mean"] if caught else []}

    good = _case("decode_fast", "pass", 1.0, 0.3)
    good.update(baseline="lanes16x8/before/recip_after", outputs={"out": out(1e-6, 1e-6)},
                mutants={"p_fp16": mut(True, True), "max_fp16": mut(False, False),
                         "ring_stale": mut(False, False, inert=True)})
    other = _case("decode_fast", "pass", 1.0, 0.3)
    other["id"] = "decode_fast/other"
    other.update(baseline="lanes16x8/before/recip_after", outputs={"out": out(1e-6, 1e-6)},
                 mutants={"p_fp16": mut(True, False), "max_fp16": mut(False, False)})
    rep = _report([good, other])
    rows = {r["mutant"]: r for r in report.resolving_rows(rep)}
    assert rows["p_fp16"]["detectable"] == 2 and rows["p_fp16"]["caught_detectable"] == 1
    assert rows["p_fp16"]["missed"] == ["decode_fast/other"]
    assert rows["ring_stale"]["inert"] == 1 and rows["ring_stale"]["cases"] == 0
    assert report.resolving_power(rep) == (1, 2)
    assert not rep["verdict"]["passed"]  # 50 % < 90 %
    assert any("resolving power" in f for f in rep["verdict"]["failures"])
    report.write(rep, tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "| decode_fast | lanes16x8/before/recip_after | 2 | 0 | 0 | 0 |" in text
    assert "Caught 1 of 2 detectable cases (50.0 %)" in text
    assert "`p_fp16` on `decode_fast/other`" in text
    other["mutants"]["p_fp16"] = {"error": "Traceback ...", "caught": False, "inert": False,
                                  "exceeds": False, "detectable": False}
    rep = _report([good, other])
    assert report.resolving_power(rep) == (1, 1)
    assert any("a crash is not a catch" in f for f in rep["verdict"]["failures"])


def test_findings_explain_rule_failures_and_not_cases_that_were_not_judged():
    """A finding explains a rule's failure; a case that was not judged (a crash, or
    not run before a --deadline) is listed apart with its reason even when its id
    matches a finding's glob: in the 08a964d run, 69 fast-decode cases cut by the
    deadline were shown under two closed findings whose globs named them."""
    from validation import findings

    ids = [p for f in findings.FINDINGS for p in f.patterns if "*" not in p]
    assert ids  # a finding that names one case id exactly
    cid = ids[0]
    failed = dict(_case("decode_fp8", "fail", 2.4, 1.2), id=cid)
    cut = dict(_case("decode_fp8", "error", 0.0, 0.0), id=cid,
               detail="not run: the --deadline was reached first")
    text = "\n".join(report.findings_section(_report([failed])))
    assert findings.explain(cid).name in text and "Not judged" not in text
    text = "\n".join(report.findings_section(_report([cut])))
    assert findings.explain(cid).name not in text
    assert f"**Not judged** (1: not run: the --deadline was reached first): `{cid}`." in text


def test_plot_entry_point_rebuilds_from_json(tmp_path):
    from validation import plot

    report.write(_report([_case("batched_decode", "pass", 1.1, 0.2)]), tmp_path)
    (tmp_path / "growth.png").unlink()
    assert plot.main(["--json", str(tmp_path / "validation.json")]) == 0
    assert (tmp_path / "growth.png").exists()


def test_shards_partition_the_work_and_merge(tmp_path):
    units = list(range(23))
    parts = [units[i::4] for i in range(4)]
    assert sorted(sum(parts, [])) == units
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    for i in range(2):
        rep = _report([_case("batched_decode", "pass", 1.0 + i, 0.2, shape=f"s{i}")])
        part = {k: rep[k] for k in ("provenance", "cases", "growth", "defect_units")}
        part.update(config=dict(rep["config"], shard=[i, 2]), wall_seconds=1.0 + 2 * i,
                    broken_suites=[],
                    work_groups=[{"group": f"g{i}", "units": 1, "seconds": 5.0 + i,
                                  "state": "done"}],
                    quantization=[{"kind": "decode", "shape": f"s{i}", "fixture": "normal",
                                   "max_out": 1.0}])
        (shard_dir / f"shard-{i}-of-2.json").write_text(json.dumps(part))
    merged = report.merge(tmp_path)
    assert len(merged["cases"]) == 2 and merged["verdict"]["passed"]
    # the fp8 quantization rows are work units too: every shard's rows are kept
    assert [r["shape"] for r in merged["quantization"]] == ["s0", "s1"]
    # the run's wall time is its longest shard's; the summary also gives the sum
    assert merged["wall_seconds"] == 3.0 and merged["config"]["shard_wall_seconds"] == [1.0, 3.0]
    text = report.summary_markdown(merged, [])
    assert "| wall time | 3.0 s, the longest of 2 shards (4.0 s in all) |" in text
    # every shard's work-group timings, the longest first
    assert [g["group"] for g in merged["work_groups"]] == ["g1", "g0"]
    assert "| work groups | 11 worker-s in 2 finished groups; longest: g1 6 s, g0 5 s |" in text
    # parts of different runs or rules are refused, naming what differs
    one = json.loads((shard_dir / "shard-1-of-2.json").read_text())
    for edit, match in ((lambda p: p["config"].update(seeds=[0, 1]), "'seeds' differs"),
                        (lambda p: p["config"].update(costs="f" * 16), "'costs' differs"),
                        (lambda p: p["provenance"].update(criterion_hash="0" * 16),
                         "different criteria")):
        bad = json.loads(json.dumps(one))
        edit(bad)
        (shard_dir / "shard-1-of-2.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            report.merge(tmp_path)
    (shard_dir / "shard-1-of-2.json").unlink()
    with pytest.raises(ValueError, match="expected 0..1"):
        report.merge(tmp_path)


NOT_RUN = "not run: the --deadline was reached first"


def _part(shard_dir, name, cases, quant=(), groups=(), plan_ids=None, **prov):
    """Write a shard or resume part of synthetic records; its plan covers
    ``plan_ids`` (default: its own unit records)."""
    rep = _report(list(cases))
    ids = plan_ids if plan_ids is not None else [c["id"] for c in cases] + [
        "growth/batched_decode/float32/s0/8"]
    shard = [int(x) for x in name[len("shard-"):-len(".json")].split("-of-")] \
        if name.startswith("shard-") else None
    part = {k: rep[k] for k in ("cases", "growth", "defect_units")}
    part.update(provenance=dict(rep["provenance"], criterion_hash="c0", **prov),
                config=dict(rep["config"], shard=shard, plan=report.plan_of(ids)),
                wall_seconds=2.0 if shard else 1.0, broken_suites=[], quantization=list(quant),
                work_groups=list(groups))
    shard_dir.mkdir(exist_ok=True)
    (shard_dir / name).write_text(json.dumps(part))
    return part


def test_resume_parts_merge_keeping_each_units_finished_record(tmp_path):
    """A shard cut by its deadline and the resume part that ran what it cut merge
    into one report: a unit's finished record is kept over its cut one, in
    either file order (cases and quantization rows alike; a kernel's
    not-available record is no unit), and the cut groups of the shard's timings
    are dropped. Controls: without the resume part the merge fails naming the
    cut case; a resume part that leaves a unit of the plan unrecorded, one of
    other kernel sources and one of another plan are refused."""
    shards = tmp_path / "shards"
    done_a = _case("batched_decode", "pass", 1.0, 0.2, shape="a")
    done_b = _case("batched_decode", "pass", 1.1, 0.2, shape="b")
    cut_b = dict(done_b, status="error", passed=False, ratio=None, detail=NOT_RUN)
    early = dict(_case("decode_fp8", "pass", 1.0, 0.1), id="decode_fp8/*", shape="*",
                 seed=None, status="not available", passed=False, detail="no module")
    q_id = dict(kind="decode", shape="s0", fixture="normal")
    q_cut, q_done = dict(q_id, detail=NOT_RUN), dict(q_id, max_out=1.0)
    plan = [done_a["id"], done_b["id"], "growth/batched_decode/float32/s0/8",
            "fp8_quant/decode/s0/normal"]
    cut_group = {"group": "b (1 case)", "units": 1, "seconds": None, "state": "not started"}
    _part(shards, "shard-0-of-1.json", [early, done_a, cut_b], [q_cut], [cut_group], plan)
    alone = report.merge(tmp_path)  # control: the cut case fails the report
    assert not alone["verdict"]["passed"]
    assert any(done_b["id"] in f and "deadline" in f for f in alone["verdict"]["failures"])
    assert report.work_group_line(alone).endswith("1 not started")
    _part(shards, "resume-1.json", [early, done_b], [q_done], plan_ids=plan,
          groups=[{"group": "b (1 case)", "units": 1, "seconds": 3.0, "state": "done"}])
    merged = report.merge(tmp_path)
    assert merged["verdict"]["passed"], merged["verdict"]["failures"]
    assert [c["id"] for c in merged["cases"]] == ["decode_fp8/*", done_a["id"], done_b["id"]]
    assert merged["cases"][2]["status"] == "pass" and merged["quantization"] == [q_done]
    assert len(merged["growth"]) == 1  # one growth run, recorded in both parts
    assert [Path(f).name for f in merged["config"]["merged_from"]] == [
        "shard-0-of-1.json", "resume-1.json"]
    assert merged["wall_seconds"] == 2.0 and merged["config"]["shard_wall_seconds"] == [2.0, 1.0]
    assert "resumed_from" not in merged["config"]
    assert [g["state"] for g in merged["work_groups"]] == ["done"]
    assert "the longest of 2 parts (3.0 s in all)" in report.summary_markdown(merged, [])
    # the other order: the finished record first, a cut one after it
    _part(shards, "shard-0-of-1.json", [early, done_a, done_b], [q_done], plan_ids=plan)
    _part(shards, "resume-1.json", [cut_b], [q_cut], plan_ids=plan)
    merged = report.merge(tmp_path)
    assert merged["verdict"]["passed"] and merged["quantization"] == [q_done]
    assert [c["status"] for c in merged["cases"]] == ["not available", "pass", "pass"]
    # a plan one unit larger than the parts recorded
    more = plan[:3] + ["defects/suite/clean"]
    _part(shards, "shard-0-of-1.json", [done_a, cut_b], plan_ids=more)
    _part(shards, "resume-1.json", [done_b], plan_ids=more)
    with pytest.raises(ValueError, match="cover 3 of the plan's 4 units; run --resume again"):
        report.merge(tmp_path)
    _part(shards, "shard-0-of-1.json", [done_a, cut_b], plan_ids=plan[:3])
    _part(shards, "resume-1.json", [done_b], plan_ids=plan[:3])
    assert report.merge(tmp_path)["verdict"]["passed"]  # control: the same, covered
    _part(shards, "resume-1.json", [done_b], plan_ids=plan[:3], kernel_source_hash="other")
    with pytest.raises(ValueError, match="different kernel sources: abc123 in shard-0-of-1"
                                         ".json; other in resume-1.json"):
        report.merge(tmp_path)
    _part(shards, "resume-1.json", [done_b], plan_ids=plan[:2])
    with pytest.raises(ValueError, match="different plans"):
        report.merge(tmp_path)


def test_parts_kept_compressed_merge_as_plain_ones(tmp_path):
    """Parts kept gzip-compressed between runs (``.json.gz``) are read as the plain
    ones: the same merged report. Controls: a part both plain and compressed is
    refused (it would count twice); a truncated ``.gz`` is refused naming it."""
    import gzip

    shards = tmp_path / "shards"
    done_a = _case("batched_decode", "pass", 1.0, 0.2, shape="a")
    done_b = _case("batched_decode", "pass", 1.1, 0.2, shape="b")
    cut_b = dict(done_b, status="error", passed=False, ratio=None, detail=NOT_RUN)
    plan = [done_a["id"], done_b["id"], "growth/batched_decode/float32/s0/8"]
    _part(shards, "shard-0-of-1.json", [done_a, cut_b], plan_ids=plan)
    _part(shards, "resume-1.json", [done_b], plan_ids=plan)
    plain = report.merge(tmp_path)
    assert plain["verdict"]["passed"]
    for name in ("shard-0-of-1.json", "resume-1.json"):
        f = shards / name
        f.with_name(name + ".gz").write_bytes(gzip.compress(f.read_bytes()))
    with pytest.raises(ValueError, match="both plain and compressed"):
        report.merge(tmp_path)
    for name in ("shard-0-of-1.json", "resume-1.json"):
        (shards / name).unlink()
    packed = report.merge(tmp_path)
    assert packed["verdict"]["passed"] and packed["cases"] == plain["cases"]
    assert [Path(f).name for f in packed["config"]["merged_from"]] == [
        "shard-0-of-1.json.gz", "resume-1.json.gz"]
    assert report.next_resume(tmp_path)[0] == 2  # the next part follows a compressed one
    gz = shards / "resume-1.json.gz"
    gz.write_bytes(gz.read_bytes()[:20])
    with pytest.raises(ValueError, match="resume-1.json.gz is not a part"):
        report.merge(tmp_path)


def test_shards_and_workers_take_whole_compile_bundles():
    """A kind's sweep cases of one shape and dtype (every fixture and seed) compile
    the same kernels: they form one bundle, run in one worker process and put in
    one shard, so those kernels are compiled once. The bundles and the shards still
    partition the run's units, and a share group (one oracle) stays contiguous."""
    from validation import cli, registry

    def build(*extra):
        args = cli.parser().parse_args(["--full", "--seeds", "0,1", "--growth", "none",
                                        "--defects", "none", "--mutants", "none", *extra])
        return cli.build_units(args, "sim")[0]

    def compile_key(u):
        if isinstance(u, registry.Case) and not u.mutants:
            return registry.KERNELS_BY_NAME[u.kernel].kind, u.shape, u.dtype
        return None

    units = build()
    bs = cli.bundles(units)
    assert sorted(i for b in bs for i in b) == list(range(len(units)))
    home = {}
    for n, b in enumerate(bs):
        shares = [cli._share_key(units[i], i) for i in b]
        assert all(shares.index(k) == j or shares[j - 1] == k for j, k in enumerate(shares))
        for i in b:
            if compile_key(units[i]) is not None:
                assert home.setdefault(compile_key(units[i]), n) == n
    # a bundle holds the fixtures x seeds of its key (several share groups)
    assert max(len({cli._share_key(units[i], i) for i in b}) for b in bs) >= 6

    def spread(parts):  # compile keys that more than one part holds
        seen = {}
        for n, part in enumerate(parts):
            for u in part:
                if compile_key(u) is not None:
                    seen.setdefault(compile_key(u), set()).add(n)
        return [k for k, v in seen.items() if len(v) > 1]

    shards = [build("--shard", f"{i}/3") for i in range(3)]
    assert sorted(u.id for s in shards for u in s) == sorted(u.id for u in units)
    assert all(shards) and spread(shards) == []
    # control: the old split, unit by unit, put one kernel's cases in several shards
    assert spread([units[i::3] for i in range(3)])


def test_work_groups_are_timed_and_a_deadline_names_the_unfinished(monkeypatch):
    """``execute`` times each work group in its worker and, when a --deadline
    strikes, lists the groups still running or never started, so a report says
    where the run's time went (the long pole of the 08a964d run was invisible:
    69 cases "not run" and no word of which group held the worker). In-process
    path (jobs 1), units stubbed: the first group runs past the deadline, the
    others are not started."""
    import time

    from validation import cli
    from validation.defects import DefectUnit

    def slow(unit):
        time.sleep(0.2)
        return "defect", {"id": unit.id, "status": "caught"}

    monkeypatch.setattr(cli, "run_unit", slow)
    timings = []
    units = [DefectUnit("suite", f"u{i}", True) for i in range(3)]
    res = cli.execute(units, 1, cli.Progress(3, enabled=False), time.monotonic() + 0.1,
                      timings)
    assert [r[1]["status"] for r in res] == ["caught", "error", "error"]
    assert [t["state"] for t in timings] == ["done", "not started", "not started"]
    assert timings[0]["group"] == "defects/suite/u0" and timings[0]["seconds"] >= 0.2
    rep = report.build(cases=[], growth=[], defect_units=[], broken_suites=[], config={},
                       provenance={}, wall_seconds=1.0, work_groups=timings)
    line = report.work_group_line(rep)
    assert line.startswith("0 worker-s in 1 finished groups; longest: defects/suite/u0 0 s")
    assert line.endswith("at the deadline 0 running or queued to a worker, 2 not started")
    assert report.work_group_line({"work_groups": []}) is None  # older reports: no line
    rep["work_groups"].append({"group": "g", "units": 1, "seconds": None, "state": "crashed"})
    assert report.work_group_line(rep).endswith("; worker crashed in 1 (g)")


def test_mutant_cases_group_by_dtype_and_head_geometry():
    """A product kernel's precision-mutant cases share a worker by kernel, dtype and
    what its kernels specialise on (the head dim; MLA's dimensions), so no one
    worker compiles every geometry's mutants alone: one group a dtype held the
    fast decode's 23 cases over 7 head dims and ran past a 530 s deadline on the
    H100 while the other workers idled. Control: keyed by dtype alone, the
    largest group is that long pole again."""
    from validation import cli, registry

    args = cli.parser().parse_args(["--full", "--seeds", "0", "--growth", "none",
                                    "--defects", "none"])
    units = cli.build_units(args, "gpu")[0]
    groups, by_dtype = {}, {}
    for i, u in enumerate(units):
        key = cli._share_key(u, i)
        if key[0] != "mutants":
            continue
        groups.setdefault(key, []).append(u)
        by_dtype.setdefault(key[:4], []).append(u)
    fast = [g for k, g in groups.items() if k[1] == "decode_fast"]
    assert len(fast) >= 3 * 7
    for g in fast:  # one head dim a group
        dims = {registry.find_shape("decode", u.shape, False).dims["d"] for u in g}
        assert len(dims) == 1, dims
    assert max(len(g) for g in groups.values()) <= 9
    assert max(len(g) for g in by_dtype.values()) >= 23  # control: the old key


COSTS_RUN = Path(__file__).resolve().parent.parent / "reports/gpu/runs/00e7132-h100-val"


def test_measured_costs_shorten_the_replayed_shards():
    """--costs orders the bundles longest first and balances the shards on a
    previous run's work-group seconds. Replayed on the seconds the H100 run of
    00e7132 recorded (16 workers a shard, the pool's first-in first-out queue):
    both shards together hold every unit once, their expected sums come out
    within one bundle of each other, and each finishes sooner than the build
    order's shards (which both ran past their 540 s deadline there). The
    kernels are that run's (entries added since change its bundles' names).
    Control: with no costs the shards are the every-other-bundle split, as
    before."""
    from validation import cli, schedule

    table, digest = schedule.load_costs(COSTS_RUN)
    assert len(digest) == 16 and len(table.seconds) > 300
    kernels = ",".join(sorted({key[0] for key in table.case_costs}))

    def shards(extra):
        out = []
        for i in (0, 1):
            args = cli.parser().parse_args(["--seeds", "0", "--shard", f"{i}/2",
                                            "--kernels", kernels] + extra)
            units, _, _, config = cli.build_units(args, "gpu")
            groups = cli.bundles(units)
            est = [table.estimate(cli.group_label([units[j] for j in b]), len(b))
                   for b in groups]
            out.append((units, est, config))
        return out

    before, after = shards([]), shards(["--costs", str(COSTS_RUN)])
    ids = [u.id for units, _, _ in after for u in units]
    assert len(ids) == len(set(ids)) == sum(len(units) for units, _, _ in before)
    assert set(ids) == {u.id for units, _, _ in before for u in units}
    sums = [sum(est) for _, est, _ in after]
    assert abs(sums[0] - sums[1]) <= max(max(est) for _, est, _ in after)
    for (_, old, _), (_, new, config) in zip(before, after):
        assert new == sorted(new, reverse=True)  # longest first
        assert schedule.makespan(new, 16) < schedule.makespan(old, 16) - 30
        assert config["costs"] == digest and config["costs_from"] == str(COSTS_RUN)
    # control: without costs, shard i holds bundles i, i + 2, ... of the build order
    args = cli.parser().parse_args(["--seeds", "0", "--kernels", kernels])
    units = cli.build_units(args, "gpu")[0]
    whole = cli.bundles(units)
    assert [u.id for u in before[1][0]] == [units[j].id for b in whole[1::2] for j in b]


def test_a_sweep_bundle_longer_than_a_fair_share_runs_a_seed_a_bundle(tmp_path):
    """With --costs, a sweep bundle of several seeds expected to take longer than
    the longest group that cannot be split and than an even share of the work
    (shards x workers) runs as one bundle a seed; the config names it, every
    shard's runner groups its cases by seed, and the shards together still hold
    every unit once. Costs here are synthetic: the ``long_d128`` float16 bundle
    400 s, the growth runs 100 s, every other group 20 s. Control: the bundle
    is one three-seed bundle without the split, and nothing is split without
    costs."""
    from validation import cli

    def build(extra):
        args = cli.parser().parse_args(["--seeds", "0,1,2", "--jobs", "16"] + extra)
        return cli.build_units(args, "gpu")

    units, _, _, config = build([])
    assert "split_by_seed" not in config
    long_key = ("bundle", "decode", "long_d128", "float16", False)
    groups = [[units[j] for j in b] for b in cli.bundles(units)]
    whole = [g for g in groups if cli._bundle_key(g[0], 0) == long_key]
    assert len(whole) == 1 and {u.seed for u in whole[0]} == {0, 1, 2}  # control
    work = [{"group": cli.group_label(g), "units": len(g), "state": "done",
             "seconds": 400.0 if g is whole[0] else
             100.0 if cli.group_label(g).startswith("growth/") else 20.0} for g in groups]
    (tmp_path / "validation.json").write_text(json.dumps({"work_groups": work, "cases": []}))
    parts = [build(["--costs", str(tmp_path), "--shard", f"{i}/3"]) for i in range(3)]
    for _, _, _, cfg in parts:
        assert cfg["split_by_seed"] == [["decode", "long_d128", "float16", False]]
    ids = [u.id for p in parts for u in p[0]]
    assert len(ids) == len(set(ids)) and set(ids) == {u.id for u in units}
    seeds_seen, held = [], 0
    for shard_units, _, _, cfg in parts:
        for b in cli.bundles(shard_units, cfg["split_by_seed"]):
            g = [shard_units[j] for j in b]
            if cli._bundle_key(g[0], 0) == long_key:
                assert len({u.seed for u in g}) == 1
                seeds_seen.append(g[0].seed)
                held += len(g)
    assert sorted(seeds_seen) == [0, 1, 2] and held == len(whole[0])


def test_a_bundle_cut_while_running_resumes_a_seed_a_bundle():
    """--resume runs a sweep bundle that a part reports as running at its deadline
    (its work-group label, state "running") one bundle a seed, as it does
    those the parts' runs split: it did not fit once. Controls: the same bundle
    not started, or finished, stays whole. A shard's config records the whole
    run's plan, the same in every shard."""
    from validation import cli

    def build(*extra):
        args = cli.parser().parse_args(["--seeds", "0,1", "--growth", "none", "--defects",
                                        "none", "--mutants", "none", "--kernels",
                                        "batched_decode", *extra])
        return cli.build_units(args, "sim")

    units, _, _, config = build()
    groups = [[units[j] for j in b] for b in cli.bundles(units)]
    target = groups[1]
    key = list(cli._bundle_key(target[0], 0)[1:])
    assert {u.seed for u in target} == {0, 1}

    def parts(state, split=()):
        return [{"config": {"split_by_seed": list(split)},
                 "work_groups": [{"group": cli.group_label(target), "units": len(target),
                                  "seconds": None, "state": state}]}]

    by_seed = cli.resume_by_seed(units, [], parts("running"))
    assert by_seed == [key]
    split = [[units[j] for j in b] for b in cli.bundles(units, by_seed)]
    assert len(split) == len(groups) + 1
    assert sorted(len({u.seed for u in g}) for g in split if g[0].shape == target[0].shape
                  and g[0].dtype == target[0].dtype) == [1, 1]
    assert cli.resume_by_seed(units, [], parts("not started")) == []  # control
    assert cli.resume_by_seed(units, [], parts("done")) == []
    assert cli.resume_by_seed(units, [], parts("done", [key])) == [key]
    assert cli.resume_by_seed(units, [["x"]], parts("running")) == [key, ["x"]]
    for i in (0, 1):
        shard_units, _, _, shard_config = build("--shard", f"{i}/2")
        assert len(shard_units) < len(units) and shard_config["plan"] == config["plan"]
    assert config["plan"] == report.plan_of(u.id for u in units)


def test_cost_estimates_fall_back_per_unit_and_shard_greedily():
    """An unmeasured label costs its class's median seconds a unit times its
    units; the greedy split puts each bundle, longest first, in the lighter shard."""
    from validation import schedule

    t = schedule.Table({"growth/a": 300.0, "growth/b": 10.0, "k1,k2/s/float16 (4 cases)": 40.0},
                       {"growth/a": 1, "growth/b": 1, "k1,k2/s/float16 (4 cases)": 4})
    assert t.estimate("growth/a", 1) == 300.0
    assert t.estimate("growth/c", 2) == 2 * 155.0  # median of 300 and 10 a unit
    assert t.estimate("k1,k2/t/float32 (8 cases)", 8) == 80.0
    assert t.estimate("defects/x", 3) == 3 * 10.0  # overall median a unit: 300, 10, 10
    assert schedule.shard([5, 9, 1, 7, 3], 2) == [[1, 4, 2], [3, 0]]
    assert schedule.order([5, 9, 1, 7, 3]) == [1, 3, 0, 4, 2]
    assert schedule.makespan([9, 7, 5, 3, 1], 2) == 13


def test_cost_estimates_for_other_seeds_count_each_compile_once():
    """A label measured at another seed costs that label's seconds (growth); a
    sweep bundle of measured (kernel, shape, dtype)s costs each one's dearest
    case once (its compile), the median of its other cases after that (a
    rejected dtype nothing), and each (fixture, seed) the shape and dtype's
    seconds outside the cases. Control: without the cases the unit-median
    fallback prices the same bundle at 3x. A case the report ran costs its own
    seconds (a compile it took included), and a bundle without the
    compiling case still pays one compile. On the committed report (any seeds)
    the case rule prices each measured sweep bundle (30 s or more) within 5 %
    of its seconds (a check of the bookkeeping: labels, case keys, the cases
    run with precision mutants kept out, the shared part), and the same
    bundle with one more seed (its kernels) at 0.95 of its seconds or more
    (the 5 % above) and under (n + 1) / n of them for n seeds: the new seed's
    cases without a compile."""
    from validation import cli, schedule

    cases = {("k1", "s", "float16"): [10.0, 0.2, 0.4], ("k2", "s", "float16"): [],
             ("k1", "s", "float32"): [6.0]}
    t = schedule.Table({"growth/g/float16/s0/1024": 300.0, "k1,k2/s/float16 (6 cases)": 11.0},
                       {"growth/g/float16/s0/1024": 1, "k1,k2/s/float16 (6 cases)": 6}, cases,
                       {("s", "float16"): 0.5})
    assert t.estimate("growth/g/float16/s2/1024", 1) == 300.0

    def keys(kernels, dtype, fixtures, seeds):
        return [(k, "s", dtype, f, sd) for sd in seeds for f in fixtures for k in kernels]

    three = keys(["k1", "k2"], "float16", ["a", "b", "c"], [0])
    assert t.estimate("k1,k2/s/float16 (6 cases)", 6, three) == 11.0  # measured: as measured
    nine = keys(["k1", "k2"], "float16", ["a", "b", "c"], [0, 1, 2])
    assert t.estimate("k1,k2/s/float16 (18 cases)", 18, nine) == \
        pytest.approx(10.0 + 8 * 0.3 + 9 * 0.5)  # one compile, 9 (fixture, seed) pairs
    one = keys(["k1"], "float32", ["a", "b"], [0])  # one recorded case: the others' median
    assert t.estimate("k1/s/float32 (2 cases)", 2, one) == pytest.approx(6.0 + 0.3)
    assert t.estimate("k1,k2/s/float16 (18 cases)", 18) == pytest.approx(3 * 11.0)  # control
    # a kernel the report never ran: the fallback, all groups' median seconds a unit
    assert t.estimate("k9/s/float16 (3 cases)", 3, keys(["k9"], "float16", "abc", [0])) == \
        pytest.approx(3 * (300.0 + 11.0 / 6) / 2)

    # recorded cases: k1 compiled at seed 0 and again at seed 1 (another plan)
    rec = {("k1", "s", "float16", "a", 0): 10.0, ("k1", "s", "float16", "a", 1): 9.0,
           ("k1", "s", "float16", "b", 1): 0.2}
    recorded = [10.0, 9.0, 0.2, 0.3, 0.4]  # two more cases at other seeds: further 0.35
    t2 = schedule.Table({"growth/g": 1.0}, {}, {("k1", "s", "float16"): recorded}, {}, rec)
    ran = [("k1", "s", "float16", f, sd) for f, sd in (("a", 0), ("a", 1), ("b", 1))]
    assert t2.estimate("x", 3, ran) == pytest.approx(19.2)  # as recorded, both compiles
    # seed 1 alone: its cases, the compile at the dearest one recorded (10, not 9)
    assert t2.estimate("x", 2, ran[1:]) == pytest.approx(10.2)
    assert t2.estimate("x", 1, ran[2:]) == pytest.approx(10.0)  # no compile ran: one added

    root = Path(__file__).resolve().parent.parent / "reports"
    table, _ = schedule.load_costs(root)
    seeds = [int(x) for x in report.read(root)["config"]["seeds"]]
    more = ",".join(str(x) for x in seeds + [max(seeds) + 1])
    units = cli.build_units(cli.parser().parse_args(["--seeds", more]), "gpu")[0]
    checked = 0
    for b in cli.bundles(units):
        group = [units[j] for j in b]
        if not cli._case_keys(group):  # not a sweep bundle
            continue
        own = [u for u in group if u.seed in seeds]
        if not own:
            continue
        label, kernels = cli.group_label(own), {u.kernel for u in own}
        if table.seconds.get(label, 0) < 30:
            continue
        measured = table.seconds[label]
        # as measured: within 5 % (a label no report measured: the case rule alone)
        priced = table.estimate("unmeasured/x", len(own), cli._case_keys(own))
        assert 0.95 <= priced / measured <= 1.05, label
        grown = [u for u in group if u.kernel in kernels]
        est = table.estimate("unmeasured/x", len(grown), cli._case_keys(grown))
        scaled = measured * (len(seeds) + 1) / len(seeds)  # every second times 4 / 3
        if any(table.case_costs[c[:3]][0] > 0 for c in cli._case_keys(own)):
            # a kernel compiled: paid once, so the further seed costs less than a third
            assert measured * 0.95 <= est < scaled, label
            checked += 1
        else:
            # no kernel ran (every case a dtype the kernels reject): the inputs and
            # oracles of each (fixture, seed), a third more
            assert est == pytest.approx(scaled), label
    assert checked >= 10, checked


def test_costs_from_a_report_without_timings_is_a_usage_error(tmp_path):
    """--costs naming a report that has no work-group seconds stops the run with
    exit 2 and a message naming the file."""
    from validation import cli

    (tmp_path / "validation.json").write_text(json.dumps({"work_groups": []}))
    args = cli.parser().parse_args(["--seeds", "0", "--costs", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        cli.build_units(args, "gpu")
    assert exc.value.code == 2


def test_an_archived_report_reads_as_the_plain_one(tmp_path, monkeypatch):
    """``scripts/validate --archive``: validation.json becomes validation.json.gz
    (the same bytes from the same report), and --costs (same digest), the runs
    index, freshness and ``validation.plot``'s reader take it as the plain file;
    --rebuild of it leaves it archived.
    Control: a folder with neither file is 'missing' and --archive of it exits 2."""
    from validation import cli, report, runs_index, schedule

    rep = {"provenance": {"git_commit": "c" * 40, "device": "GPU X", "timestamp": "t",
                          "kernel_source_hash": "k1", "criterion_hash": "c1"},
           "verdict": {"passed": True}, "cases": [{"status": "pass"}], "growth": [],
           "defects": [], "work_groups": [{"group": "growth/a", "seconds": 12.0, "units": 1}]}
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "validation.json").write_text(json.dumps(rep, indent=1))
    plain_costs = schedule.load_costs(run)
    plain_row = runs_index.run_row(run / "validation.json", "k1", "c1")
    assert cli.main(["--archive", "--out", str(run)]) == 0
    assert not (run / "validation.json").exists()
    gz = (run / "validation.json.gz").read_bytes()
    assert report.read(run) == report.read(run / "validation.json.gz") == rep
    assert schedule.load_costs(run)[1] == plain_costs[1]
    assert schedule.load_costs(run)[0].seconds == plain_costs[0].seconds
    row = runs_index.run_row(run / "validation.json.gz", "k1", "c1")
    assert {k: v for k, v in row.items() if k != "path"} == \
        {k: v for k, v in plain_row.items() if k != "path"}
    assert "| [r1](r1/) |" in runs_index.index_markdown(tmp_path / "runs", "k1", "c1")
    (run / "validation.json").write_text(json.dumps(rep, indent=1))  # both forms there
    assert runs_index.index_markdown(tmp_path / "runs", "k1", "c1").count("| [r1](r1/) |") == 1
    (run / "validation.json").unlink()
    (run / "validation.json").write_text(json.dumps(rep, indent=1))
    assert report.archive(run).read_bytes() == gz  # deterministic
    # an archived run stays archived through --rebuild (report.write keeps a
    # compressed folder compressed; its summary and plots stubbed: this report is
    # too small to draw)
    monkeypatch.setattr(report.plot, "plot_all", lambda r, out: [])
    monkeypatch.setattr(report, "summary_markdown", lambda r, images: "stub")
    monkeypatch.setattr(cli, "_print_verdict", lambda r, out: None)
    assert cli.main(["--rebuild", "--out", str(run)]) == 0
    assert not (run / "validation.json").exists() and report.read(run) == rep
    assert (run / "validation.json.gz").read_bytes() == gz
    # the control: a folder holding only the plain file keeps it plain
    plain = tmp_path / "plain"
    report.write(rep, plain)
    assert (plain / "validation.json").exists() and not (plain / "validation.json.gz").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.freshness(empty)["state"] == "missing"
    assert cli.main(["--archive", "--out", str(empty)]) == 2


def test_quantization_rows_are_units_and_a_missed_one_says_why():
    """The fp8 table's rows run as work units of the validation run (sharded, under
    its deadline); a row whose unit did not run is shown with the reason, not
    dropped."""
    from validation import cli, fp8_quant

    us = fp8_quant.units(decode=True, mla=True, small=True, quick=True)
    assert {u.kind for u in us} == {"decode", "mla"} and len({u.id for u in us}) == len(us)
    kind, rec = cli._crashed(us[0], cli.DeadlineReached("not run: the --deadline was reached"))
    assert kind == "quant" and cli._unit_status(kind, rec) == "not computed"
    text = "\n".join(report.quantization_section({"quantization": [rec]}))
    assert f"| {us[0].shape} | {us[0].fixture} (not computed: not run: the --deadline" in text
    # an MLA row: both scale modes' errors, finite and not zero (e4m3 rounds the rows)
    row = next(u for u in us if u.kind == "mla" and u.fixture == "normal").run()
    for mode in ("tensor", "token"):
        assert 0 < row[f"{mode}_mean"] <= row[f"{mode}_max"] < row["max_out"]
    assert "### MLA: the fp8 latent cache" in "\n".join(
        report.quantization_section({"quantization": [row]}))


# ---------------------------------------------------------------------------
# real kernels at tiny shapes (simulator process, or a GPU)
# ---------------------------------------------------------------------------


def _with_defect(name, defect):
    base = registry.KERNELS_BY_NAME[name]

    def run(fn, x):
        return base.run(lambda *a, **k: fn(*a, defect=defect, **k), x)

    return replace(base, name=f"{name}+{defect}", run=run)


@pytest.mark.device
def test_sweep_case_passes_and_a_planted_defect_fails(monkeypatch):
    from validation import sweep

    case = registry.Case("batched_decode", "gqa9x3_d40", "normal", 0, "float32", True)
    rec = sweep.run_case(case)
    assert rec["status"] == "pass", rec["detail"]
    assert set(rec["outputs"]) == {"out", "lse"} and rec["ratio"] < 2.5
    for defect, why in (("stuck_rescale", "max abs err"), ("batch_max_len", "unexpected NaN")):
        spec = _with_defect("batched_decode", defect)
        monkeypatch.setitem(registry.KERNELS_BY_NAME, spec.name, spec)
        bad = sweep.run_case(replace(case, kernel=spec.name))
        assert bad["status"] == "fail" and why in bad["detail"], (defect, bad["detail"])
    again = sweep.run_case(case)  # same seed, same data, same numbers
    assert again["max_abs"] == rec["max_abs"]


@pytest.mark.device
def test_unsupported_dtype_is_reported_not_failed():
    from validation import sweep

    rec = sweep.run_case(registry.Case("batched_decode", "zero_len", "normal", 0, "float16",
                                       True))
    assert rec["status"] in ("unsupported", "pass"), rec["detail"]


@pytest.mark.device
def test_growth_run_records_a_series_and_checks_the_cache():
    from validation import growth

    rec = growth.run_growth(growth.GrowthJob("batched_decode", "float32", 0, 3, True))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["series"]["step"] == [1, 2, 3] and rec["cache_ok"]
    assert all(e is not None and b is not None for e, b in
               zip(rec["series"]["out_err"], rec["series"]["out_base"]))


@pytest.mark.device
@pytest.mark.parametrize("kernel,dtype", [("mma_paged_decode_t4", "float16"),
                                          ("mma_fp8_decode", "float32")])
def test_tensor_core_growth_runs(kernel, dtype):
    """The tensor-core decode's growth runs (two calls of T 4 through the paged
    append; four fp8 steps through the quantizing append) pass with the
    registry entry's baseline, and a float32 cache is unsupported (named)."""
    from validation import growth

    rec = growth.run_growth(growth.GrowthJob(kernel, dtype, 0, 8 if "t4" in kernel else 4,
                                             True))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["cache_ok"] and "mma kernel" in rec["geometry"]["path"]
    assert rec["series"]["out_err"][-1] > 0
    if kernel == "mma_paged_decode_t4":
        rec = growth.run_growth(growth.GrowthJob(kernel, "float32", 0, 4, True))
        assert rec["status"] == "unsupported" and "float16" in rec["detail"]


def test_default_jobs(monkeypatch):
    """Without --jobs: one worker a CPU core on a GPU (at most 8), up to 2 on the simulator."""
    from validation import cli

    for cores, gpu, sim in ((1, 1, 1), (2, 2, 2), (16, 8, 2), (None, 1, 1)):
        monkeypatch.setattr(cli.os, "cpu_count", lambda c=cores: c)
        assert (cli.default_jobs("gpu"), cli.default_jobs("sim")) == (gpu, sim), cores


def test_runs_index_lists_each_run_fresh_or_stale(tmp_path):
    """``scripts/validate --index``: a row a validation report (in a run folder or
    a subfolder), newest first, with its counts (cases cut by a --deadline in
    parentheses) and whether it measured the current kernel sources and
    criterion; a folder without a report is listed with its files."""
    from validation import runs_index

    def rep(commit, when, kh, ch, cases):
        return {"provenance": {"git_commit": commit, "device": "GPU X", "timestamp": when,
                               "seeds": [0], "kernel_source_hash": kh, "criterion_hash": ch},
                "verdict": {"passed": all(c["status"] == "pass" for c in cases)},
                "cases": cases, "growth": [{"status": "pass"}],
                "defects": [{"caught": 2, "planted": 3}]}

    ok = {"status": "pass"}
    from validation.cli import NOT_RUN_DETAIL

    cut = {"status": "error", "detail": NOT_RUN_DETAIL}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "validation.json").write_text(
        json.dumps(rep("aaaaaaa1", "2026-01-01T00:00:00Z", "k0", "c1", [ok, cut])))
    (tmp_path / "new" / "val").mkdir(parents=True)
    (tmp_path / "new" / "val" / "validation.json").write_text(
        json.dumps(rep("bbbbbbb2", "2026-02-01T00:00:00Z", "k1", "c1", [ok, ok])))
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.log").write_text("x")
    text = runs_index.index_markdown(tmp_path, "k1", "c1")
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert rows[0].startswith("| [new/val](new/val/) | `bbbbbbb` |")
    assert rows[0].endswith("| PASS | 2: 2 / 0 | 1/1 | 2/3 | fresh |")
    assert rows[1].endswith("| FAIL | 2: 1 / 1 (1) | 1/1 | 2/3 | stale |")
    assert "- [bench](bench/): `b.log`" in text
    assert "stale (criterion)" in runs_index.index_markdown(tmp_path, "k1", "c0")
