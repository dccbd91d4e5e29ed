"""Derived tolerances: a kernel is held to what plain arithmetic of its precision achieves.

For a result ``got`` (kernel), ``ref`` (float64 oracle) and ``base`` (the same
oracle code run in the kernel's precision, e.g. ``decode_attention_ref(...,
dtype=np.float32)``), the kernel passes when

    max|got - ref| <= RATIO * max|base - ref| + floor

``RATIO = 2``: a kernel may sum in another order (tree reductions, online
rescaling, ``ex2.approx``) and so lose up to twice what the plain order loses.
``floor = FLOOR_ULPS * u * max(1, max|ref|)``, with ``u`` the unit roundoff of
the storage dtype: where the baseline happens to be exact (one position: the
output *is* the value row) a legitimate kernel may still be a few roundings
away, and a defect is orders of magnitude above it (checked by the planted
defects).

``budget`` takes one baseline: the falsification suites and the error-growth
runs use the oracle code as written. The validation sweep judges with
``validation.metrics.judge`` against the largest error of several float32
baselines, one for each standard order of the score sums
(``validation.baselines``).
"""

from __future__ import annotations

import numpy as np

RATIO = 2.0
FLOOR_ULPS = 8
UNIT_ROUNDOFF = {
    "float64": 2.0 ** -53,
    "float32": 2.0 ** -24,
    "float16": 2.0 ** -11,
    "bfloat16": 2.0 ** -8,
}


def unit_roundoff(dtype) -> float:
    name = getattr(dtype, "__name__", None) or str(np.dtype(dtype))
    return UNIT_ROUNDOFF[str(np.dtype(dtype)) if name not in UNIT_ROUNDOFF else name]


def _finite_max_abs(x):
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def max_abs_error(got, ref):
    """max |got - ref| over finite reference entries (placement of inf/NaN is
    checked separately by ``same_nonfinite``)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    mask = np.isfinite(ref)
    if not mask.any():
        return 0.0
    return float(np.abs(got[mask] - ref[mask]).max())


def same_nonfinite(got, ref) -> bool:
    """NaN and +-inf sit in exactly the same places in ``got`` as in ``ref``."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return (np.array_equal(np.isnan(got), np.isnan(ref))
            and np.array_equal(np.isposinf(got), np.isposinf(ref))
            and np.array_equal(np.isneginf(got), np.isneginf(ref)))


def budget(ref, base, dtype=np.float32) -> float:
    """The error a kernel of precision ``dtype`` is allowed against ``ref``."""
    floor = FLOOR_ULPS * unit_roundoff(dtype) * max(1.0, _finite_max_abs(ref))
    return RATIO * max_abs_error(base, ref) + floor


def error_ratio(got, ref, base) -> float:
    """Kernel error over baseline error (inf when the baseline is exact and the kernel is not)."""
    e_k, e_b = max_abs_error(got, ref), max_abs_error(base, ref)
    if e_b == 0.0:
        return 0.0 if e_k == 0.0 else float("inf")
    return e_k / e_b


def assert_matches(got, ref, base, dtype=np.float32, what="output"):
    """Assert ``got`` is within the derived budget of ``ref``, non-finite placement equal."""
    got = np.asarray(got)
    assert got.shape == np.shape(ref), f"{what}: shape {got.shape} != oracle {np.shape(ref)}"
    assert same_nonfinite(got, ref), (
        f"{what}: NaN/inf placement differs from the oracle "
        f"(kernel has {int(np.isnan(np.asarray(got, float)).sum())} NaN)")
    err, allowed = max_abs_error(got, ref), budget(ref, base, dtype)
    if err > allowed:
        diff = np.where(np.isfinite(np.asarray(ref, float)),
                        np.abs(np.asarray(got, float) - np.asarray(ref, float)), 0)
        where = np.unravel_index(int(np.argmax(diff)), diff.shape)
        raise AssertionError(
            f"{what}: max abs error {err:.3e} exceeds the derived budget {allowed:.3e} "
            f"(= {RATIO:g} x float baseline error {max_abs_error(base, ref):.3e} + floor); "
            f"worst at index {where}: kernel {np.asarray(got)[where]!r}, oracle {np.asarray(ref)[where]!r}")
