"""The tensor-core decode over an fp8 e4m3 cache (``attention.decode.mma``, kind
``"f8"``): per-tensor scales, q float16. The codes are staged as they are and
converted to f16 in shared memory (exact: every e4m3 value is an f16 value), S
is multiplied by ``k_scale`` after ``scale``, the output by ``v_scale``.

Checked here:

* on the simulator (``device``) and on a GPU: **bit for bit** the 16-bit
  kernel's result over an f16 cache holding the codes' values, with both scales
  1 (the conversion, the staging of the codes, their addressing in pooled, HND
  and NHD paged caches, T_q 1 and 4, one split and two); the same cases judged
  against the float64 oracle over the dequantized cache (code x scale) with the
  16-bit kernels' baseline (``validation.baselines.decode_rounded_p``, the mma
  sums, P rounded to fp16) with real scales;
* ``DecodePlan(cache_dtype=uint8, q_dtype=float16, method="mma")`` runs the same
  kernel (its range check compiled in): the bits of ``mma_decode``, pooled and
  paged; ``method="auto"`` keeps the fast kernel for fp8
  (``tests/test_decode_plan_mma.py``);
* a planted defect acts through the conversion: ``swizzle_off_by_one`` (the
  converted K tile stored with the next row's swizzle) fails the rule;
* host checks: q must be float16, both scales are required with an fp8 cache
  and refused with a 16-bit one, a scale must be one positive finite value;
* compile-only: sm_90 PTX with ``cvt.rn.f16x2.e4m3x2``, the f16 mma,
  ``cp.async`` and no local memory.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.cache import fp8 as F
from attention.core import checks
from attention.decode import mma
from attention.oracle import decode_attention_multi_ref
from validation import fixtures, tolerance
from validation.baselines import decode_rounded_p

F16 = np.dtype(np.float16)


def fp8_case(seed, lens, n_kv, group, t_q, head_dim, cap=None):
    """Codes of a pooled cache [M + 1, H_kv, cap, D] (NaN codes in every row past
    a length and in the spare slot), their per-tensor scales, a permuted slot
    table and q [M, T, H, D] float16."""
    rng = np.random.default_rng(seed)
    m_count = len(lens)
    cap = max(lens) if cap is None else cap
    k = rng.standard_normal((m_count + 1, n_kv, cap, head_dim)).astype(np.float32)
    v = rng.standard_normal((m_count + 1, n_kv, cap, head_dim)).astype(np.float32)
    ks, vs = np.float32(np.abs(k).max() / 448), np.float32(np.abs(v).max() / 448)
    kc, vc = F.encode_e4m3(k / ks), F.encode_e4m3(v / vs)
    slots = rng.permutation(m_count + 1)[:m_count].astype(np.int32)
    nan = np.uint8(0x7F)  # e4m3's NaN
    for code in (kc, vc):
        code[[s for s in range(m_count + 1) if s not in slots]] = nan
        for m, n in enumerate(lens):
            code[slots[m], :, n:] = nan
    q = rng.standard_normal((m_count, t_q, group * n_kv, head_dim)).astype(F16)
    return q, kc, vc, ks, vs, slots


def run(q, kc, vc, lens, slots, ks, vs, page=None, layout="HND", **kw):
    """The fp8 kernel (pooled, or the rows laid out in pages of ``page``)."""
    lens = np.asarray(lens, np.int32)
    if page is None:
        return mma.mma_decode(q, kc, vc, lens, slot_table=slots, k_scale=ks, v_scale=vs, **kw)
    rng = np.random.default_rng(page)
    kp, vp, table = fixtures.paged_from_pooled(kc, vc, lens, slots, page, layout, rng)
    return mma.mma_decode(q, kp, vp, lens, page_table=table, layout=layout, k_scale=ks,
                          v_scale=vs, **kw)


CASES = [
    # (lens, n_kv, group, t_q, head_dim, page, layout, n_split)
    ([37, 0, 16], 2, 2, 1, 32, None, "HND", None),  # pooled; a tile edge; an empty row
    ([37, 20], 1, 4, 4, 32, 16, "HND", 2),  # T_q 4 x group 4: a whole tile; two splits
    ([21, 5], 2, 1, 2, 64, 1, "NHD", None),  # NHD pages of one row
]


@pytest.mark.device
@pytest.mark.parametrize("lens,n_kv,group,t_q,head_dim,page,layout,n_split", CASES,
                         ids=["pooled", "hnd16-t4-split2", "nhd1-t2-d64"])
def test_scale_one_gives_the_16_bit_kernels_bits(lens, n_kv, group, t_q, head_dim, page,
                                                  layout, n_split):
    q, kc, vc, _, _, slots = fp8_case(len(lens) + head_dim, lens, n_kv, group, t_q, head_dim)
    kw = {"warps": 1, "stages": 2, "n_split": n_split}
    got = run(q, kc, vc, lens, slots, 1.0, 1.0, page, layout, **kw)
    k16, v16 = (F.decode_e4m3(c).astype(F16) for c in (kc, vc))  # exact
    lens32 = np.asarray(lens, np.int32)
    if page is None:
        want = mma.mma_decode(q, k16, v16, lens32, slot_table=slots, **kw)
    else:
        rng = np.random.default_rng(page)
        kp, vp, table = fixtures.paged_from_pooled(k16, v16, lens32, slots, page, layout, rng)
        want = mma.mma_decode(q, kp, vp, lens32, page_table=table, layout=layout, **kw)
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


def judged(q, kc, vc, lens, slots, ks, vs, got):
    """[(name, passed, text)] of out and lse against the oracle over the
    dequantized cache, with the 16-bit kernels' baseline."""
    lens = np.asarray(lens, np.int32)
    k = (F.decode_e4m3(kc) * ks).astype(np.float32)[slots]
    v = (F.decode_e4m3(vc) * vs).astype(np.float32)[slots]
    scale = 1.0 / np.sqrt(q.shape[-1])
    ref = decode_attention_multi_ref(q, k, v, lens, scale=scale)
    base = decode_rounded_p(q, k, v, lens, scale, F16, sums="mma16")
    return [(name,) + tuple(tolerance.verdict(np.asarray(g), r, b))
            for name, g, r, b in zip(("out", "lse"), got, ref, base)]


@pytest.mark.device
@pytest.mark.parametrize("lens,n_kv,group,t_q,head_dim,page,layout,n_split", CASES,
                         ids=["pooled", "hnd16-t4-split2", "nhd1-t2-d64"])
def test_matches_the_oracle_over_the_dequantized_cache(lens, n_kv, group, t_q, head_dim, page,
                                                       layout, n_split):
    q, kc, vc, ks, vs, slots = fp8_case(len(lens) + head_dim, lens, n_kv, group, t_q,
                                        head_dim)
    got = run(q, kc, vc, lens, slots, ks, vs, page, layout, warps=1, stages=2,
              n_split=n_split)
    for name, ok, text in judged(q, kc, vc, lens, slots, ks, vs, got):
        assert ok, f"{name}: {text}"
    empty = np.asarray(lens) == 0
    assert np.all(np.asarray(got[1])[empty] == -np.inf) and not np.isnan(got[0]).any()


@pytest.mark.device
def test_swizzle_defect_acts_through_the_conversion():
    lens = [37, 16]
    q, kc, vc, ks, vs, slots = fp8_case(3, lens, 1, 4, 1, 32)
    clean = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2)
    assert all(ok for _, ok, _ in judged(q, kc, vc, lens, slots, ks, vs, clean))
    bad = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2, defect="swizzle_off_by_one")
    assert not all(ok for _, ok, _ in judged(q, kc, vc, lens, slots, ks, vs, bad))


def test_bad_inputs_are_named():
    q, kc, vc, ks, vs, slots = fp8_case(1, [5, 3], 1, 2, 1, 32)
    lens = np.array([5, 3], np.int32)
    call = mma.mma_decode
    with pytest.raises(checks.DTypeError, match="q: expected dtype float16"):
        call(q.astype(np.float32), kc, vc, lens, slot_table=slots, k_scale=ks, v_scale=vs)
    with pytest.raises(checks.AttentionInputError, match="k_scale: an fp8 cache"):
        call(q, kc, vc, lens, slot_table=slots, v_scale=vs)
    with pytest.raises(checks.RangeError, match="v_scale: expected one finite positive"):
        call(q, kc, vc, lens, slot_table=slots, k_scale=ks, v_scale=-1.0)
    with pytest.raises(checks.RangeError, match="k_scale: expected one finite positive"):
        call(q, kc, vc, lens, slot_table=slots, k_scale=np.ones(2, np.float32), v_scale=vs)
    with pytest.raises(checks.DTypeError, match="v_cache"):
        call(q, kc, vc.astype(F16), lens, slot_table=slots, k_scale=ks, v_scale=vs)
    k16 = F.decode_e4m3(kc).astype(F16)
    with pytest.raises(checks.AttentionInputError, match="only fp8 caches"):
        call(q, k16, k16, lens, slot_table=slots, k_scale=ks, v_scale=vs)


def test_fp8_rings_take_less_shared_memory():
    """A stage holds codes (a quarter word an element) and each warp one f16
    K / V pair besides: at D 128, 4 warps, 3 stages, 84 KB against 100 KB."""
    assert 4 * mma.smem_words(128, 4, 3, fp8=True) == 84 * 1024
    assert 4 * mma.smem_words(128, 4, 3) == 100 * 1024


@pytest.mark.compile
def test_compiles_to_the_e4m3_conversion_and_the_f16_mma():
    from numba import cuda, types

    u32, i32, f32 = types.uint32, types.int32, types.float32
    A = types.Array
    sig = (A(u32, 4, "C"), A(u32, 1, "C"), A(u32, 1, "C"), A(i32, 1, "C"), A(i32, 2, "C"),
           i32, i32, i32, i32, f32, i32, A(f32, 4, "C"), A(f32, 3, "C"), A(f32, 4, "C"),
           A(f32, 4, "C"), A(f32, 1, "C"), A(f32, 1, "C"))
    kern = mma.mma_decode_kernel("f8", 128, 4, 1, mma.WARPS, mma.STAGES, "HND")
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16") == 128 // 8 + 128 // 8


@pytest.mark.device
@pytest.mark.parametrize("page", [None, 16])
def test_decode_plan_mma_gives_mma_decode_bits(page):
    """``DecodePlan(cache_dtype=uint8, q_dtype=float16, method="mma")``: the same
    kernel behind the plan (its range check compiled in), pooled and HND pages
    of 16, T_q 2: the bits of ``mma_decode``."""
    from numba import cuda

    from attention.decode.plan import DecodePlan

    lens = [37, 9]
    q, kc, vc, ks, vs, slots = fp8_case(9, lens, 2, 2, 2, 32)
    lens32 = np.asarray(lens, np.int32)
    if page is None:
        kp, vp, table, extra = kc, vc, slots, {}
    else:
        kp, vp, table = fixtures.paged_from_pooled(kc, vc, lens32, slots, page, "HND",
                                                   np.random.default_rng(page))
        extra = {"page_size": page, "layout": "HND"}
    plan = DecodePlan(2, 4, 2, 32, kp.shape[0], kc.shape[2], cache_dtype=np.uint8,
                      q_dtype=np.float16, t_q=2, method="mma", **extra)
    assert plan.method == "mma"
    d = [cuda.to_device(np.ascontiguousarray(x)) for x in (q, kp, vp, lens32, table)]
    scales = [cuda.to_device(np.array([x], np.float32)) for x in (ks, vs)]
    kw = {"page_table": d[4]} if page else {"slot_table": d[4]}
    out = plan.run(d[0], d[1], d[2], d[3], k_scale=scales[0], v_scale=scales[1], sync=True,
                   **kw)
    want = run(q, kc, vc, lens, slots, ks, vs, page, "HND", n_split=plan.n_split)
    assert np.array_equal(np.asarray(out.copy_to_host()).view(np.uint32),
                          np.asarray(want[0]).view(np.uint32))
    assert np.array_equal(plan.lse.copy_to_host().view(np.uint32),
                          np.asarray(want[1]).view(np.uint32))
