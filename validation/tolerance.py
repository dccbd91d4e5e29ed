"""The criterion: a kernel is held to what float32 arithmetic in its own order achieves.

For a kernel result ``got``, the float64 oracle ``ref`` and the same-precision
baseline ``base`` (the oracle's arithmetic in float32, its q.k sums in the
order the kernel family documents: ``validation.baselines``; one order per
kernel, named in the registry), an output passes when

    NaN / inf sit where the oracle has them, and
    max|got - ref|  <= RATIO      * max|base - ref|  + floor          (max rule)
    mean|got - ref| <= MEAN_RATIO * mean|base - ref| + floor / n      (mean rule)

over the ``n`` entries finite in both.

``RATIO = 2``. The baseline already sums the scores in the kernel's order, so
the factor covers what the baseline does not model: the online softmax's
rescaling, ``ex2.approx`` (fast-math ``exp``), the kernel's position sums.
At a near tie of large scores (|score| ~ 1e4, one float32 ulp of a score
~ 1e-3) an output's error is one of a few discrete levels and a single
rounding that goes the other way can cost more than 2x: such a case fails and
is reported as a finding, not absorbed by a larger factor.

``MEAN_RATIO = 1.5`` (flash-attention's KV-cache tests use the same mean
rule). A near tie moves the largest error of a few entries; the mean over all
entries hardly moves. A systematic precision loss (P or q rounded to 16 bits,
a coarser ``exp``, a compensation dropped) raises every entry's error a
little, which the mean sees and the max rule, with its factor 2, may not.

``floor = FLOOR_ULPS * ulp32(max|ref|)`` with ``FLOOR_ULPS = 2``: two float32
units in the last place of the largest reference value (``np.spacing``), as
flash-attention 3's ``2 * |(ref + 0.3 - 0.3) - ref|``. It is float32's
because every kernel here computes in float32: 16-bit caches are upcast
exactly, so the oracle and the baseline see exactly the kernel's inputs, and
the storage dtype's roundoff has no place in the bound. The floor exists for
outputs the baseline gets exactly (one position: the output *is* the value
row; zero-length sequences) where a correct kernel may still round once or
twice more. The mean rule's floor is the same amount spread over the ``n``
entries (one entry off by the floor). Nothing scales it up for small outputs
(no ``max(1, .)``): an output of size 0.01 is held to ulps of 0.01.

A kernel whose arithmetic is not float32 (16-bit operands on tensor cores)
needs a baseline with the same roundings; none is registered yet.
"""

from __future__ import annotations

import numpy as np

RATIO = 2.0
MEAN_RATIO = 1.5
FLOOR_ULPS = 2


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def finite_max_abs(x):
    """max |x| over finite entries (0.0 when there are none)."""
    x = _f64(x)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def ulp32(x):
    """The float32 spacing at ``|x|`` (0.0 for 0)."""
    x = abs(float(x))
    if x == 0.0:
        return 0.0
    return float(np.spacing(np.float32(min(x, float(np.finfo(np.float32).max)))))


def floor(ref):
    """``FLOOR_ULPS * ulp32(max|ref|)`` over the finite entries of ``ref``."""
    return FLOOR_ULPS * ulp32(finite_max_abs(ref))


def _both_finite(got, ref):
    got, ref = _f64(got), _f64(ref)
    both = np.isfinite(got) & np.isfinite(ref)
    return got[both], ref[both]


def max_abs_error(got, ref):
    """max |got - ref| over entries finite in both (0.0 when there are none)."""
    g, r = _both_finite(got, ref)
    return float(np.abs(g - r).max()) if g.size else 0.0


def mean_abs_error(got, ref):
    """mean |got - ref| over entries finite in both (0.0 when there are none)."""
    g, r = _both_finite(got, ref)
    return float(np.abs(g - r).mean()) if g.size else 0.0


def finite_count(got, ref):
    g, _ = _both_finite(got, ref)
    return int(g.size)


def same_nonfinite(got, ref) -> bool:
    """NaN and +-inf sit in exactly the same places in ``got`` as in ``ref``."""
    got, ref = _f64(got), _f64(ref)
    return (np.array_equal(np.isnan(got), np.isnan(ref))
            and np.array_equal(np.isposinf(got), np.isposinf(ref))
            and np.array_equal(np.isneginf(got), np.isneginf(ref)))


def budget(ref, base):
    """The max rule's bound: ``RATIO * max|base - ref| + floor(ref)``."""
    return RATIO * max_abs_error(base, ref) + floor(ref)


def mean_budget(ref, base):
    """The mean rule's bound: ``MEAN_RATIO * mean|base - ref| + floor(ref) / n``."""
    n = finite_count(base, ref)
    return MEAN_RATIO * mean_abs_error(base, ref) + (floor(ref) / n if n else 0.0)


def verdict(got, ref, base):
    """(passed, detail) of one output under the rule (module docstring)."""
    got = np.asarray(got)
    if got.shape != np.shape(ref):
        return False, f"shape {got.shape} != oracle {np.shape(ref)}"
    if not same_nonfinite(got, ref):
        n_nan = int(np.isnan(_f64(got)).sum())
        return False, f"NaN/inf placement differs from the oracle (kernel has {n_nan} NaN)"
    err, bound = max_abs_error(got, ref), budget(ref, base)
    mean, mean_bound = mean_abs_error(got, ref), mean_budget(ref, base)
    text = (f"max err {err:.3e} (bound {bound:.3e} = {RATIO:g} x baseline "
            f"{max_abs_error(base, ref):.3e} + floor {floor(ref):.2e}); mean err {mean:.3e} "
            f"(bound {mean_bound:.3e} = {MEAN_RATIO:g} x baseline {mean_abs_error(base, ref):.3e}"
            f" + floor/n)")
    return bool(err <= bound and mean <= mean_bound), text


def assert_matches(got, ref, base, what="output"):
    """Assert ``got`` passes the rule against ``ref`` with baseline ``base``."""
    ok, text = verdict(got, ref, base)
    if not ok:
        diff = np.where(np.isfinite(_f64(ref)) & np.isfinite(_f64(got)),
                        np.abs(_f64(got) - _f64(ref)), 0) if np.shape(got) == np.shape(ref) \
            else np.zeros(1)
        where = np.unravel_index(int(np.argmax(diff)), diff.shape)
        raise AssertionError(f"{what}: {text}; worst at index {where}")
