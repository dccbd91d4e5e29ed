"""Falsification suite of the float32 tensor-core prefill
(``attention.prefill.tf32.prefill_attention_tf32``, family "prefill_tf32").

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``:

* ``pv_rows_unpermuted``: V's B fragments read rows ``t`` and ``t + 4`` of a k
  step while P's registers are taken as positions ``2 t`` and ``2 t + 1`` (the
  layout trick that spares the shuffle, done on one side only);
* ``causal_tile_edge``: a causal row whose diagonal is a K tile's first
  position does not see it (row 0 then sees nothing: zeros and LSE -inf);
* ``tf32_single``: one mma a product (plain tf32, about 2^-11 relative error a
  product): a precision defect, caught by the float32 rule;
* ``no_low_b``: the ``hi_a lo_b`` term dropped (K's and V's low halves): the
  same, one term short.

The kernel's third precision mutant, ``long_partials`` (every mma adds into the
running sum), is not planted here: whether the judge sees it is its resolving
power, reported by the sweep (``validation.registry.MUTANT_SOURCES``), not a
defect it must catch.

The rule is the sweep's (``validation.tolerance.verdict``: NaN / inf where the
oracle has them, max error <= 2x the baseline's + floor, mean error <= 1.5x +
floor / n) against the float64 oracle (``attention.oracle.prefill_attention_ref``)
with the fused prefill's baseline (``validation.baselines.prefill_order``,
``fma/before/recip_after``: the registry's for both kernels). Cases:

* ``t33_gqa2_d16_causal``: T 33, two query heads on one kv head, D 16, causal,
  K / V tiles of 16 (rows 0, 16 and 32 have their diagonal on a tile's first
  position), one warp a block;
* ``t20_d8_full``: T 20, one head, D 8, not causal (the second K / V tile part
  filled).

On the simulator the kernel runs with one warp a block and tiles of 16; on a
GPU each case also runs with the default plan.
"""

from __future__ import annotations

import numpy as np

from attention.core.device import SIMULATOR, can_execute
from attention.oracle import prefill_attention_ref
from attention.prefill import tf32
from validation import tolerance
from validation.baselines import prefill_order
from validation.suite import Check

FAMILY = "prefill_tf32"
DEFECTS = tf32.DEFECTS + ("tf32_single", "no_low_b")
BASELINE = "fma/before/recip_after"
SMALL_PLAN = ("w1_n16", {"warps": 1, "block_n": 16})
# (name, T, H, H_kv, D, causal)
CASES = (("t33_gqa2_d16_causal", 33, 2, 1, 16, True),
         ("t20_d8_full", 20, 1, 1, 8, False))


def check_case(name, t_len, n_heads, n_kv, head_dim, causal, plan, defect):
    """out and lse Checks of one case under one plan."""
    plan_name, plan_kw = plan
    rng = np.random.default_rng([t_len, n_heads, head_dim])
    q = rng.standard_normal((t_len, n_heads * head_dim)).astype(np.float32)
    k = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    v = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    out, lse = tf32.prefill_attention_tf32(q, k, v, n_heads, n_kv, causal=causal, defect=defect,
                                           **plan_kw)
    ref = prefill_attention_ref(q, k, v, n_heads, n_kv, causal=causal, dtype=np.float64)
    base = prefill_order(q, k, v, n_heads, n_kv, causal, BASELINE)
    checks = []
    for what, got, r, b in zip(("out", "lse"), (out, lse), ref, base):
        ok, text = tolerance.verdict(np.asarray(got), r, b)
        checks.append(Check(f"{FAMILY}/{what}[{name}_{plan_name}]", ok, text))
    return checks


def run_suite(defect=None, *, small=True):
    """Every case with the small plan (and, on a GPU, the default one too)."""
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("prefill_tf32 suite: no GPU and the CUDA simulator is not enabled")
    plans = [SMALL_PLAN] if SIMULATOR else [SMALL_PLAN, ("default", {})]
    results = []
    for case in CASES:
        for plan in plans:
            results.extend(check_case(*case, plan, defect))
    return results
