"""Falsification suite for multi-head prefill attention: the fused product kernel
(``attention.prefill.kernels.prefill_attention``) and the per-head and batched
reference paths (``attention.reference.prefill_paths.prefill_attention_reference``).

The contract is ``validation/suite.py``'s: ``run_suite(None)`` returns only
passing checks, ``run_suite(d)`` for each planted defect ``d`` in ``DEFECTS``
returns at least one failing check. Every method (``fused``, ``batched``,
``per_head``; ``METHODS``) is checked on every case, so a defect is caught per
method.

Tolerance (derived, not tuned; ``validation.tolerance.budget``): the
kernel's largest absolute error against the float64 oracle
(``attention.oracle.prefill_attention_ref``) may be at most twice the error of
the same-precision baseline, plus a floor of a few float32 ulps of the largest
reference value (a baseline that happens to be exact, as at T == 1 where the
output is a copy of a V row, does not demand bit-exactness). The baseline is
the one the validation registry holds each method to
(``validation.baselines.prefill_order`` with the method's label,
``baseline_label``): the oracle's arithmetic in float32 with the q.k sums in
the method's own order (one running FMA sum over the head dimension; the scale
on q before the sum for the fused kernel, on the score after it for the
reference paths). BLAS's blocked sums (the oracle run in float32 as written)
are more accurate than any kernel here: at T == 1, where the LSE is the one
score, the kernels' LSE errors were 3.6 and 8.1 times that baseline's (the H100
suite at 504265b: fused 2.78e-7, batched and per-head 8.71e-7 against 7.6e-8 /
1.08e-7), and each equal to the error of its own order's baseline.

Cases: a causal GQA case catches both defects (``causal_off_by_one`` only
shows under a causal mask; ``softmax_not_normalised`` anywhere); the full
(GPU) sweep adds non-causal, awkward lengths and the head sizes 64/80/128.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention.core.device import can_execute
from attention.oracle import prefill_attention_ref
from attention.prefill.kernels import PREFILL_DEFECTS, prefill_attention
from attention.reference.prefill_paths import METHODS as REFERENCE_METHODS
from attention.reference.prefill_paths import prefill_attention_reference

from . import tolerance
from .baselines import prefill_order
from .suite import Check

FAMILY = "prefill"
DEFECTS = PREFILL_DEFECTS  # ("softmax_not_normalised", "causal_off_by_one")
PRODUCT_METHODS = ("fused",)
METHODS = PRODUCT_METHODS + REFERENCE_METHODS  # ("fused", "batched", "per_head")


def attend(method, q, k, v, n_heads, **kw):
    """Prefill attention through ``method``: "fused" is the product entry point
    (``prefill_attention``), "batched" and "per_head" the reference one
    (``prefill_attention_reference``); keyword arguments as theirs."""
    if method in PRODUCT_METHODS:
        return prefill_attention(q, k, v, n_heads, method=method, **kw)
    if method in REFERENCE_METHODS:
        return prefill_attention_reference(q, k, v, n_heads, method=method, **kw)
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


@dataclass(frozen=True)
class Case:
    """One prefill problem; ``seed`` makes its data reproducible."""

    t_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    seed: int = 0

    @property
    def name(self):
        return (f"T{self.t_len}_H{self.n_heads}_Hkv{self.n_kv_heads}_D{self.head_dim}"
                f"_{'causal' if self.causal else 'full'}")

    def data(self):
        """Standard-normal q, k, v: scores of spread ~1, every key matters."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((self.t_len, self.n_heads * self.head_dim)).astype(np.float32)
        k = rng.standard_normal((self.t_len, self.n_kv_heads * self.head_dim)).astype(np.float32)
        v = rng.standard_normal((self.t_len, self.n_kv_heads * self.head_dim)).astype(np.float32)
        return q, k, v


# simulator: one tiny causal GQA case (9 rows, 2 query heads on 1 kv head, D 8)
SMALL_CASES = (Case(9, 2, 1, 8, True, seed=1),)
# GPU: awkward lengths, the production GQA shape, head sizes 64 / 80 / 128
FULL_CASES = (
    Case(97, 8, 2, 64, True, seed=1),
    Case(97, 4, 4, 80, False, seed=2),
    Case(1025, 32, 8, 128, True, seed=3),
    Case(1025, 8, 2, 128, False, seed=4),
)


def compare(label, got, ref, base):
    """A Check that ``got`` is within ``validation.tolerance``'s derived budget
    of ``ref`` (the float64 oracle), with NaN/inf in the same places."""
    got = np.asarray(got)
    if got.shape != np.shape(ref):
        return Check(label, False, f"shape {got.shape} != oracle {np.shape(ref)}")
    if not tolerance.same_nonfinite(got, ref):
        return Check(label, False, f"NaN/inf placement differs from the oracle "
                                   f"({int(np.isnan(got).sum())} NaN in the kernel's result)")
    err = tolerance.max_abs_error(got, ref)
    allowed = tolerance.budget(ref, base)
    detail = (f"max abs err {err:.3g}, budget {allowed:.3g} (float32 baseline err "
              f"{tolerance.max_abs_error(base, ref):.3g})")
    if err > allowed:
        diff = np.where(np.isfinite(ref), np.abs(got.astype(np.float64) - ref), 0.0)
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        detail += f", worst at {tuple(int(i) for i in worst)}"
    return Check(label, bool(err <= allowed), detail)


def check_case(case, method, defect=None, reference=None):
    """Checks of one method on one case: output and LSE against the oracle.
    ``reference``: ``reference_for(case, method)`` (computed when None)."""
    q, k, v = case.data()
    if reference is None:
        reference = reference_for(case, method)
    (ref_out, ref_lse), (base_out, base_lse) = reference
    out, lse = attend(method, q, k, v, case.n_heads, n_kv_heads=case.n_kv_heads,
                      causal=case.causal, return_lse=True, defect=defect)
    label = f"{FAMILY}/{method}/{case.name}"
    return [compare(f"{label}: out", out, ref_out, base_out),
            compare(f"{label}: lse", lse, ref_lse, base_lse)]


def baseline_label(method):
    """The same-precision baseline's order the validation registry names for
    ``method``'s kernel (``validation.registry``, spec ``prefill_<method>``),
    e.g. ``"fma/before/recip_after"`` for the fused kernel."""
    from .registry import KERNELS_BY_NAME

    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    return KERNELS_BY_NAME[f"prefill_{method}"].baseline


def oracle_for(case):
    """The case's float64 oracle (out, lse); the same for every method."""
    q, k, v = case.data()
    return prefill_attention_ref(q, k, v, case.n_heads, case.n_kv_heads, causal=case.causal,
                                 dtype=np.float64)


def reference_for(case, method, oracle=None):
    """(oracle (out, lse) in float64, baseline (out, lse): the oracle's arithmetic
    in float32 in ``method``'s order, ``baseline_label``). ``oracle``:
    ``oracle_for(case)`` when already computed."""
    q, k, v = case.data()
    base = prefill_order(q, k, v, case.n_heads, case.n_kv_heads, case.causal,
                         baseline_label(method))
    return (oracle_for(case) if oracle is None else oracle), base


def check_fixture(case, reference):
    """The case can show both defects: its causal mask changes the answer by
    far more than the budget (a mask one key off is visible), and its rows
    see more than one key (an unnormalised softmax is not accidentally 1)."""
    q, k, v = case.data()
    (ref_out, _), (base_out, _) = reference
    other, _ = prefill_attention_ref(q, k, v, case.n_heads, case.n_kv_heads,
                                     causal=not case.causal)
    allowed = tolerance.budget(ref_out, base_out)
    # rows 0 .. T-2 are the ones a causal mask changes
    change = float(np.abs(other[:-1] - ref_out[:-1]).max()) if case.t_len > 1 else 0.0
    ok = case.causal and case.t_len >= 3 and change > 100 * allowed
    return Check(f"{FAMILY}/fixture/{case.name}: defects visible", ok,
                 f"causal={case.causal}, T={case.t_len}, mask changes the output by "
                 f"{change:.3g} vs budget {allowed:.3g}")


def check_empty(method, defect=None):
    """T == 0 returns empty out [0, H*D] and lse [H, 0] without launching."""
    q = np.zeros((0, 2 * 8), np.float32)
    kv = np.zeros((0, 8), np.float32)
    out, lse = attend(method, q, kv, kv, 2, n_kv_heads=1, causal=True, return_lse=True,
                      defect=defect)
    ok = out.shape == (0, 16) and lse.shape == (2, 0)
    return Check(f"{FAMILY}/{method}/T0: empty result", ok,
                 f"out {out.shape}, lse {lse.shape}")


def run_suite(defect=None, *, small=True):
    """Every method on every case (``SMALL_CASES`` on the simulator)."""
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("prefill suite: no GPU and the CUDA simulator is not enabled")
    cases = SMALL_CASES if small else FULL_CASES
    results = []
    for case in cases:
        oracle = oracle_for(case)
        references = {m: reference_for(case, m, oracle) for m in METHODS}
        if case.causal:
            results.append(check_fixture(case, references[PRODUCT_METHODS[0]]))
        for method in METHODS:
            results.extend(check_case(case, method, defect, references[method]))
    for method in METHODS:
        results.append(check_empty(method, defect))
    return results
