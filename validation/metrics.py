"""Error metrics of one kernel output against the float64 oracle, and the verdict.

For a kernel result ``got``, the float64 oracle ``ref`` and the float32
baseline ``base`` (the same oracle code run in float32: ``dtype=np.float32``
of ``attention.oracle``, ``mla.oracle.mla_attend_float32``) on the same
inputs, ``judge`` records:

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
* ``baseline_abs`` the baseline's max |base - ref| (the largest over the
  sweep's baselines, ``validation.baselines``: the oracle's float32 arithmetic
  with the scores summed and scaled in each standard order);
* ``ratio``     ``max_abs / baseline_abs``: how much worse than plain float32
  arithmetic the kernel is (inf when the baseline is exact and the kernel is
  not, 0 when both are exact);
* ``floor``     ``validation.tolerance``'s rounding floor:
  ``FLOOR_ULPS (8) * u(dtype) * max(1, max|ref|)`` with ``u`` the unit
  roundoff of the storage dtype (2^-24 for float32, 2^-11 for float16, 2^-8
  for bfloat16). Why a floor at all: where the baseline happens to be exact
  (one position: the output *is* the value row; all-equal scores) a kernel that
  rounds a few more times (``ex2.approx`` in fast-math ``exp``, an approximate
  reciprocal, its own summation order) is a few units of rounding away and
  would otherwise fail ``ratio <= 2`` with an infinite ratio. Eight units cover
  those few extra roundings; every planted defect is orders of magnitude above it;
* ``bound = RATIO * baseline_abs + floor`` (``RATIO = 2``), ``margin =
  max_abs / bound``; the output **passes when nonfinite_ok and margin <= 1**,
  i.e. ``ratio <= 2`` up to the floor.
"""

from __future__ import annotations

import math

import numpy as np

from validation.tolerance import FLOOR_ULPS, RATIO, unit_roundoff

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


def rounding_floor(ref, dtype):
    """``FLOOR_ULPS * u(dtype) * max(1, max|ref|)`` (module docstring)."""
    return FLOOR_ULPS * unit_roundoff(dtype) * max(1.0, _finite_max_abs(_f64(ref)))


def error_ratio(kernel_err, baseline_err):
    if baseline_err == 0.0:
        return 0.0 if kernel_err == 0.0 else math.inf
    return kernel_err / baseline_err


def judge(got, ref, base, dtype=np.float32):
    """Metrics and verdict of one output (module docstring): a dict with the
    ``compare`` fields plus baseline_abs, ratio, floor, bound, margin, passed.

    ``base`` is one baseline array, or ``{label: array}`` of several
    (``validation.baselines``): then ``baseline_abs`` is the largest of their
    errors, ``baseline_variant`` names it and ``baseline_first_abs`` is the
    first one's (the oracle code as written)."""
    rec = compare(got, ref)
    if isinstance(base, dict):
        errs = {label: max_abs_error(b, ref) for label, b in base.items()}
        worst = max(errs, key=errs.get)
        rec.update(baseline_variant=worst, baseline_first_abs=next(iter(errs.values())))
        baseline_abs = errs[worst]
    else:
        baseline_abs = max_abs_error(base, ref)
    floor = rounding_floor(ref, dtype)
    bound = RATIO * baseline_abs + floor
    rec.update(
        baseline_abs=baseline_abs,
        ratio=error_ratio(rec["max_abs"], baseline_abs),
        floor=floor,
        bound=bound,
        margin=rec["max_abs"] / bound if bound > 0 else (0.0 if rec["max_abs"] == 0 else math.inf),
    )
    rec["passed"] = bool(rec["nonfinite_ok"] and rec["max_abs"] <= bound)
    return rec


def combine(per_output):
    """Verdict of a case from its outputs' ``judge`` records: passes when every
    output passes; ratio/margin/max_abs are the worst over outputs."""
    recs = list(per_output.values())
    return {
        "passed": all(r["passed"] for r in recs),
        "ratio": max((r["ratio"] for r in recs), default=0.0),
        "margin": max((r["margin"] for r in recs), default=0.0),
        "max_abs": max((r["max_abs"] for r in recs), default=0.0),
        "cos_diff": max((r["cos_diff"] for r in recs), default=0.0),
    }
