"""Falsification suite of the 16-bit tensor-core kernels (family "mma"): the
decode (``attention.decode.mma.mma_decode``), the prefill
(``attention.prefill.mma.prefill_attention_mma``) and the MLA decode
(``mla.mma``, through ``mla.pipeline.mla_decode(method="mma")``).

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``. The two kernels carry
switches of the same names (their module's ``DEFECTS``), and so does the MLA
kernel, so the suite's names say which kernel a defect is planted in:

* ``decode_ldmatrix_no_trans``, ``prefill_ldmatrix_no_trans``: V's B fragments
  loaded by ``ldmatrix`` without ``.trans``;
* ``decode_swizzle_off_by_one``, ``prefill_swizzle_off_by_one``: K tiles stored
  with the swizzle of the next row;
* ``decode_causal_tile_edge``: a multi-token row whose causal limit falls on a
  16-position tile edge sees one position more (a NaN row past the length);
* ``prefill_causal_tile_edge``: a causal row whose diagonal is a K tile's first
  position does not see it;
* ``mla_ldmatrix_no_trans``, ``mla_swizzle_off_by_one``: the same in the MLA
  kernel (V = the latent tile's first r columns; latent tiles swizzled with the
  next row's key);
* ``mla_causal_tile_edge``: a query whose causal end is a multiple of 16 sees
  one position more;
* ``mla_v_block_stride``: V's fragments all read from the latent tile's first
  64-column block (only a rank past 64 shows it: case ``s2_kv49_r128``).

A defect of one kernel runs that kernel's checks; the clean run runs all three.

The rule is the sweep's (``validation.tolerance.verdict``: NaN / inf where the
oracle has them, max error <= 2x the baseline's + floor, mean error <= 1.5x +
floor / n), judged against the float64 oracle with the registry's rounded-P
baselines (``validation.baselines``: P rounded to the 16-bit type before P.V,
as the kernels do by design; S summed as the mma model sums it; the prefill's
weights in FlashAttention-2's form, ``exp="ex2fma"``). Checks (each named
``<output>[<case>]``):

* decode ``t4_g4_pooled``: 4 queries a sequence x GQA group 4 (the 16 rows of
  one tile), D 32, lengths 19 and 4 (query 0 of the first ends on the tile edge
  at 16), a pooled fp16 cache in a permuted slot order with NaN in every row
  past a length and in the spare slot; every query judged;
* decode ``t1_g4_hnd16_split2``: one query, GQA 4 over two kv heads, D 64,
  lengths 37, 0 and 16, HND pages of 16 laid out by ``fixtures.paged_from_pooled``
  (shuffled pages, NaN tails and spare pages), two splits (the combine);
* prefill ``t33_d16_causal``: T 33, one head, D 16, causal, K / V tiles of 16
  (rows 0, 16 and 32 have their diagonal on a tile's first position);
* prefill ``t20_gqa2_d32_full``: T 20, two query heads over one kv head, D 32,
  not causal (the last K / V tile part filled);
* MLA ``s2_kv49``: ``mla_decode(method="mma")`` of one sequence of 49 latent
  rows with s_q 2 new queries (query 0 ends at 48, a 16-position edge inside
  the sequence), 2 heads, d_nope 16, r 64, d_rope 64 (two 64-column blocks),
  an fp16 cache; out judged against
  ``mla.oracle.mla_decode_ref`` and ``baselines.mla_rounded_p`` (the registry's
  ``mla_mma`` baseline). The pipeline's own plan (it takes no plan keywords);
* MLA ``s2_kv49_r128``: the same at r 128, where a warp's r / 4 = 32 V columns
  span two 64-column blocks of the latent tile (at r 64 they lie in one).

On the simulator the kernels run with one warp a block (the tests' plans);
on a GPU each case also runs with the kernel's default plan.
"""

from __future__ import annotations

import numpy as np

from attention.core.device import SIMULATOR, can_execute
from attention.decode import mma as decode_mma
from attention.oracle import decode_attention_multi_ref, prefill_attention_ref
from attention.prefill import mma as prefill_mma
from mla import mma as mla_mma
from validation import fixtures, tolerance
from validation.baselines import decode_rounded_p, mla_rounded_p, prefill_rounded_p
from validation.suite import Check

FAMILY = "mma"
DECODE_DEFECTS = tuple(f"decode_{d}" for d in decode_mma.DEFECTS)
PREFILL_DEFECTS = tuple(f"prefill_{d}" for d in prefill_mma.DEFECTS)
MLA_DEFECTS = tuple(f"mla_{d}" for d in mla_mma.DEFECTS)
DEFECTS = DECODE_DEFECTS + PREFILL_DEFECTS + MLA_DEFECTS
F16 = np.dtype(np.float16)

# (name, kernel keywords): the small plans on the simulator; on a GPU the default too
SMALL_DECODE_PLAN = ("w1", {"warps": 1, "stages": 2})
SMALL_PREFILL_PLAN = ("w1", {"warps": 1, "block_n": 16})


def judge(name, got, ref, base):
    """A Check of one output under the sweep's rule (``tolerance.verdict``)."""
    ok, text = tolerance.verdict(np.asarray(got), ref, base)
    return Check(name, ok, text)


def _kernel_defect(defect, prefix):
    """The kernel's own switch name when ``defect`` is planted in that kernel."""
    if defect is not None and defect.startswith(prefix):
        return defect[len(prefix):]
    return None


def pooled_cache(rng, lens, n_kv, head_dim, dtype, spare=1, cap=None):
    """A pooled cache [M + spare, H_kv, cap, D] (cap: default the longest length)
    in ``dtype`` with NaN in every row past a length and in the spare slots, and
    a permuted slot table. Returns (k, v, slots [M] int32)."""
    m_count = len(lens)
    cap = max(list(lens) + [1]) if cap is None else cap
    k = np.full((m_count + spare, n_kv, cap, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    slots = rng.permutation(m_count + spare)[:m_count].astype(np.int32)
    for m, n in enumerate(lens):
        k[slots[m], :, :n] = rng.standard_normal((n_kv, n, head_dim))
        v[slots[m], :, :n] = rng.standard_normal((n_kv, n, head_dim))
    return k.astype(dtype), v.astype(dtype), slots


def check_decode(case, lens, t_q, group, n_kv, head_dim, page, n_split, plan, defect):
    """One decode case: q [M, T, H, D] fp16 against the oracle and
    ``decode_rounded_p`` (mma sums) over the rows in sequence order; pooled (``page``
    None) or HND pages of ``page``. Returns the out and lse Checks."""
    plan_name, plan_kw = plan
    tag = f"[{case}_{plan_name}]"
    rng = np.random.default_rng(sum(lens) + 10 * t_q + head_dim)
    lens = np.asarray(lens, np.int32)
    k, v, slots = pooled_cache(rng, lens, n_kv, head_dim, F16)
    q = rng.standard_normal((len(lens), t_q, group * n_kv, head_dim)).astype(F16)
    kw = dict(plan_kw, n_split=n_split, defect=_kernel_defect(defect, "decode_"))
    if page is None:
        out, lse = decode_mma.mma_decode(q, k, v, lens, slot_table=slots, **kw)
    else:
        kp, vp, table = fixtures.paged_from_pooled(k, v, lens, slots, page, "HND", rng)
        out, lse = decode_mma.mma_decode(q, kp, vp, lens, page_table=table, layout="HND",
                                         **kw)
    k_rows, v_rows = k[slots], v[slots]  # [M, H_kv, cap, D]: the rows in sequence order
    scale = 1.0 / np.sqrt(head_dim)
    ref_out, ref_lse = decode_attention_multi_ref(q, k_rows, v_rows, lens, scale=scale)
    base_out, base_lse = decode_rounded_p(q, k_rows, v_rows, lens, scale, F16, sums="mma16")
    return [judge("out" + tag, out, ref_out, base_out),
            judge("lse" + tag, lse, ref_lse, base_lse)]


def check_prefill(case, t_len, n_heads, n_kv, head_dim, causal, plan, defect):
    """One prefill case: q [T, H*D], k / v [T, H_kv*D] fp16 against the oracle and
    ``prefill_rounded_p`` (FlashAttention-2's weights). Returns the out and lse
    Checks."""
    plan_name, plan_kw = plan
    tag = f"[{case}_{plan_name}]"
    rng = np.random.default_rng(t_len + head_dim)
    q = rng.standard_normal((t_len, n_heads * head_dim)).astype(F16)
    k = rng.standard_normal((t_len, n_kv * head_dim)).astype(F16)
    v = rng.standard_normal((t_len, n_kv * head_dim)).astype(F16)
    out, lse = prefill_mma.prefill_attention_mma(q, k, v, n_heads, n_kv, causal=causal,
                                                 defect=_kernel_defect(defect, "prefill_"),
                                                 **plan_kw)
    scale = 1.0 / np.sqrt(head_dim)
    ref_out, ref_lse = prefill_attention_ref(q, k, v, n_heads, n_kv, causal=causal,
                                             scale=scale)
    base_out, base_lse = prefill_rounded_p(q, k, v, n_heads, n_kv, causal, scale, F16,
                                           exp="ex2fma")
    return [judge("out" + tag, out, ref_out, base_out),
            judge("lse" + tag, lse, ref_lse, base_lse)]


def check_mla(case, lens, s_q, n_heads, d_nope, rank, d_rope, d_v, defect):
    """One MLA case: ``mla_decode(method="mma")`` of q_nope [B, s_q, nh, d_nope],
    q_pe [B, s_q, nh, d_rope] (float32) over an fp16 cache [B, max(lens), r +
    d_rope] with NaN past each length, against the float64 oracle and
    ``mla_rounded_p`` of each sequence. Returns the out Check."""
    from mla.oracle import mla_decode_ref
    from mla.pipeline import mla_decode

    tag = f"[{case}]"
    rng = np.random.default_rng(sum(lens) + 10 * s_q + rank + d_rope)
    n_b, cap, width = len(lens), max(list(lens) + [1]), rank + d_rope
    q_nope = rng.standard_normal((n_b, s_q, n_heads, d_nope)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, s_q, n_heads, d_rope)).astype(np.float32)
    w_uk = (rng.standard_normal((n_heads, d_nope, rank)) / np.sqrt(rank)).astype(np.float32)
    w_uv = (rng.standard_normal((n_heads, d_v, rank)) / np.sqrt(rank)).astype(np.float32)
    cache = np.full((n_b, cap, width), np.nan, np.float32)
    for b, n in enumerate(lens):
        cache[b, :n] = rng.standard_normal((n, width))
    cache = cache.astype(F16)
    lens = np.asarray(lens, np.int32)
    out = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method="mma",
                     defect=_kernel_defect(defect, "mla_"))
    ref = mla_decode_ref(q_nope, q_pe, cache.astype(np.float64), lens, w_uk, w_uv)
    scale = 1.0 / np.sqrt(d_nope + d_rope)
    base = np.zeros(ref.shape, np.float32)
    for b, n in enumerate(lens):
        if n:
            base[b] = mla_rounded_p(q_nope[b], q_pe[b], cache[b, :n, :rank], cache[b, :n, rank:],
                                    w_uk, w_uv, scale, F16)
    return [judge("out" + tag, out, ref, base)]


def run_suite(defect=None, *, small=True):
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("mma suite: no GPU and the CUDA simulator is not enabled")
    decode_plans, prefill_plans = [SMALL_DECODE_PLAN], [SMALL_PREFILL_PLAN]
    if not (small and SIMULATOR):
        decode_plans.append(("default", {}))
        prefill_plans.append(("default", {}))
    results = []
    if defect is None or defect in DECODE_DEFECTS:
        for plan in decode_plans:
            results += check_decode("t4_g4_pooled", [19, 4], 4, 4, 1, 32, None, None, plan,
                                    defect)
            results += check_decode("t1_g4_hnd16_split2", [37, 0, 16], 1, 4, 2, 64, 16, 2,
                                    plan, defect)
    if defect is None or defect in PREFILL_DEFECTS:
        for plan in prefill_plans:
            results += check_prefill("t33_d16_causal", 33, 1, 1, 16, True, plan, defect)
            results += check_prefill("t20_gqa2_d32_full", 20, 2, 1, 32, False, plan, defect)
    if defect is None or defect in MLA_DEFECTS:
        results += check_mla("s2_kv49", [49], 2, 2, 16, 64, 64, 16, defect)
        results += check_mla("s2_kv49_r128", [49], 2, 2, 16, 128, 64, 16, defect)
    return results
