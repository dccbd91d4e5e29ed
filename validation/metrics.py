"""Error metrics of one kernel output against the float64 oracle, and the verdict.

For a kernel result ``got``, the float64 oracle ``ref`` and the float32
baseline ``base`` (the oracle's arithmetic in float32, in the order of the
kernel's family: ``validation.baselines``) on the same inputs, ``judge``
records:

* ``max_abs``   max |got - ref| over the entries finite in both;
* ``max_rel``   max |got - ref| / max(|ref|, 1e-3 * max|ref|): relative error,
  with entries near zero measured against a thousandth of the largest
  reference value instead of themselves (else a 1e-12 reference entry makes the
  number meaningless);
* ``cos_diff``  1 - 2 sum(got*ref) / (sum(got^2) + sum(ref^2)), 0 for equal
  vectors, 1 for orthogonal ones (sensitive to a wrong direction even when
  magnitudes look fine);
* ``nonfinite_ok`` NaN, +inf and -inf sit exactly where the oracle has them
  (e.g. LSE -inf for an empty sequence and nowhere else; no NaN leaked from a
  poisoned cache row);
* ``baseline_abs`` / ``baseline_mean``: the baseline's max / mean |base - ref|
  (``base``: the oracle's float32 arithmetic in the kernel family's order,
  ``validation.baselines``; ``baseline`` names the order);
* ``mean_abs``  mean |got - ref| over the entries finite in both;
* ``ratio``     ``max_abs / baseline_abs`` and ``mean_ratio`` ``mean_abs /
  baseline_mean`` (inf when the baseline is exact and the kernel is not, 0
  when both are exact);
* ``floor``     ``validation.tolerance.floor``: two float32 ulps of max|ref|;
* ``bound = RATIO * baseline_abs + floor`` (``RATIO = 2``), ``margin =
  max_abs / bound``; ``mean_bound = MEAN_RATIO * baseline_mean + floor / n``
  (``MEAN_RATIO = 1.5``), ``mean_margin = mean_abs / mean_bound``;
* ``failed_by``: which rules an output breaks ("nonfinite", "max", "mean").

The output **passes when nonfinite_ok, margin <= 1 and mean_margin <= 1**
(``validation/tolerance.py`` derives the rule).
"""

from __future__ import annotations

import math

import numpy as np

from validation import tolerance

REL_FLOOR = 1e-3  # relative error denominators never below this fraction of max|ref|


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _finite_max_abs(x):
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def nonfinite_placement(got, ref):
    """(ok, detail): NaN/+inf/-inf of ``got`` in the same places as in ``ref``."""
    problems = []
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        g, r = test(got), test(ref)
        extra, missing = int((g & ~r).sum()), int((r & ~g).sum())
        if extra:
            where = tuple(int(i) for i in np.argwhere(g & ~r)[0])
            problems.append(f"{extra} unexpected {name} (first at {where})")
        if missing:
            where = tuple(int(i) for i in np.argwhere(r & ~g)[0])
            problems.append(f"{missing} {name} of the oracle missing (first at {where})")
    return not problems, "; ".join(problems)


def max_abs_error(got, ref):
    """max |got - ref| over entries finite in both (0.0 when there are none)."""
    got, ref = _f64(got), _f64(ref)
    both = np.isfinite(got) & np.isfinite(ref)
    if not both.any():
        return 0.0
    return float(np.abs(got[both] - ref[both]).max())


def compare(got, ref):
    """Error metrics of ``got`` against ``ref`` (same shape): a dict with
    max_abs, max_rel, cos_diff, nonfinite_ok, nonfinite_detail, worst_index."""
    with np.errstate(all="ignore"):  # inf - inf where both are -inf: masked out below
        return _compare(_f64(got), _f64(ref))


def _compare(got, ref):
    if got.shape != ref.shape:
        return {"max_abs": math.inf, "max_rel": math.inf, "cos_diff": 1.0,
                "nonfinite_ok": False, "worst_index": None,
                "nonfinite_detail": f"shape {got.shape} != oracle {ref.shape}"}
    ok, detail = nonfinite_placement(got, ref)
    both = np.isfinite(got) & np.isfinite(ref)
    diff = np.where(both, np.abs(got - ref), 0.0)
    max_abs = float(diff.max()) if diff.size else 0.0
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape)) \
        if diff.size and max_abs > 0 else None
    peak = _finite_max_abs(ref)
    denom = np.maximum(np.abs(np.where(both, ref, 0.0)), max(REL_FLOOR * peak, 1e-300))
    max_rel = float((diff / denom).max()) if diff.size else 0.0
    g, r = np.where(both, got, 0.0), np.where(both, ref, 0.0)
    energy = float((g * g).sum() + (r * r).sum())
    cos_diff = 1.0 - 2.0 * float((g * r).sum()) / energy if energy > 0 else 0.0
    return {"max_abs": max_abs, "max_rel": max_rel, "cos_diff": cos_diff,
            "nonfinite_ok": ok, "nonfinite_detail": detail, "worst_index": worst}


def rounding_floor(ref):
    """``validation.tolerance.floor``: two float32 ulps of max|ref|."""
    return tolerance.floor(ref)


def error_ratio(kernel_err, baseline_err):
    if baseline_err == 0.0:
        return 0.0 if kernel_err == 0.0 else math.inf
    return kernel_err / baseline_err


def _margin(err, bound):
    return err / bound if bound > 0 else (0.0 if err == 0 else math.inf)


def judge(got, ref, base, baseline=None):
    """Metrics and verdict of one output (module docstring): a dict with the
    ``compare`` fields plus mean_abs, baseline_abs, baseline_mean, ratio,
    mean_ratio, floor, n (the mean rule's entries), bound, mean_bound, margin,
    mean_margin, failed_by and passed. ``base``: the baseline array (one
    order); ``baseline``: its label, recorded as given."""
    rec = compare(got, ref)
    with np.errstate(all="ignore"):
        mean_abs = tolerance.mean_abs_error(got, ref) if np.shape(got) == np.shape(ref) \
            else math.inf
    baseline_abs = tolerance.max_abs_error(base, ref)
    baseline_mean = tolerance.mean_abs_error(base, ref)
    floor = tolerance.floor(ref)
    bound = tolerance.budget(ref, base)
    mean_bound = tolerance.mean_budget(ref, base)
    rec.update(
        baseline=baseline,
        mean_abs=mean_abs,
        baseline_abs=baseline_abs,
        baseline_mean=baseline_mean,
        ratio=error_ratio(rec["max_abs"], baseline_abs),
        mean_ratio=error_ratio(mean_abs, baseline_mean),
        floor=floor,
        n=tolerance.finite_count(base, ref),
        bound=bound,
        mean_bound=mean_bound,
        margin=_margin(rec["max_abs"], bound),
        mean_margin=_margin(mean_abs, mean_bound),
    )
    failed = [name for name, bad in (("nonfinite", not rec["nonfinite_ok"]),
                                     ("max", rec["max_abs"] > bound),
                                     ("mean", mean_abs > mean_bound)) if bad]
    rec["failed_by"] = failed
    rec["passed"] = not failed
    return rec


def combine(per_output):
    """Verdict of a case from its outputs' ``judge`` records: passes when every
    output passes; ratio/margin/max_abs are the worst over outputs."""
    recs = list(per_output.values())
    return {
        "passed": all(r["passed"] for r in recs),
        "ratio": max((r["ratio"] for r in recs), default=0.0),
        "margin": max((r["margin"] for r in recs), default=0.0),
        "mean_margin": max((r.get("mean_margin", 0.0) for r in recs), default=0.0),
        "failed_by": sorted({f for r in recs for f in r.get("failed_by", ())}),
        "max_abs": max((r["max_abs"] for r in recs), default=0.0),
        "cos_diff": max((r["cos_diff"] for r in recs), default=0.0),
    }
