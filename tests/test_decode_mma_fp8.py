"""The tensor-core decode over an fp8 e4m3 cache (``attention.decode.mma``, kind
``"f8"``): per-tensor and per-(token, kv head) scales, q float16. The codes are
staged as they are and converted to f16 in registers (exact: every e4m3 value is
an f16 value), S is multiplied by ``k_scale`` after ``scale``, the output by
``v_scale`` (token_head: the V scales go into P under a row normaliser).

Checked here:

* on the simulator (``device``) and on a GPU: **bit for bit** the 16-bit
  kernel's result over an f16 cache holding the codes' values, with both scales
  1 (the conversion, the staging of the codes, their addressing in pooled, HND
  and NHD paged caches, T_q 1 and 4, one split and two); the same cases judged
  against the float64 oracle over the dequantized cache (code x scale) with the
  16-bit kernels' baseline in the kernel's order (``validation.baselines.
  decode_rounded_p`` over the codes' values, the mma sums, P rounded to fp16, the
  K scale on each score and the V scale on the output: ``mma16_pc16``) with real
  scales;
* ``DecodePlan(cache_dtype=uint8, q_dtype=float16, method="mma")`` runs the same
  kernel (its range check compiled in): the bits of ``mma_decode``, pooled and
  paged; ``method="auto"`` keeps the fast kernel for fp8
  (``tests/test_decode_plan_mma.py``);
* planted defects act through the code tiles: ``swizzle_off_by_one`` (the K
  code tile stored with the next row's swizzle) and ``ldmatrix_no_trans`` fail
  the rule;
* host checks: q must be float16, both scales are required with an fp8 cache
  and refused with a 16-bit one, a scale must be one positive finite value;
* compile-only: sm_90 PTX with ``cvt.rn.f16x2.e4m3x2``, the f16 mma,
  ``cp.async`` and no local memory.
"""

from __future__ import annotations

import functools

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
    dequantized cache, with the registry's baseline (``mma16_pc16``: the 16-bit
    kernels' order over the codes' values, the K scale on each score and the V
    scale on the output, as the kernel applies them)."""
    lens = np.asarray(lens, np.int32)
    with np.errstate(invalid="ignore"):
        kv_codes = [F.decode_e4m3(c).astype(np.float32)[slots] for c in (kc, vc)]
    k, v = ((c.astype(np.float64) * s).astype(np.float32) for c, s in zip(kv_codes, (ks, vs)))
    scale = 1.0 / np.sqrt(q.shape[-1])
    ref = decode_attention_multi_ref(q, k, v, lens, scale=scale)
    base = decode_rounded_p(q, kv_codes[0], kv_codes[1], lens, scale, F16, sums="mma16",
                            k_scales=np.full(kv_codes[0].shape[:3], ks, np.float32),
                            v_scale=vs, norm="recip_after")
    return [(name,) + tuple(tolerance.verdict(np.asarray(g), r, b))
            for name, g, r, b in zip(("out", "lse"), got, ref, base)]


@pytest.mark.parametrize("ks,vs,equal", [(2.0 ** -6, 2.0 ** -3, True),
                                         (0.037, 0.0051, False)])
def test_per_tensor_order_moves_only_the_scales(ks, vs, equal):
    """``decode_rounded_p(k_scales=, v_scale=)`` over the codes' values (the order
    ``mma16_pcT``, the per-tensor kernel's) against the plain rounded-P order
    over the dequantized rows: the same bits with power-of-two scales (they then
    commute with every rounding); with other scales apart (a positive control:
    the orders are told apart), by at most a rounding of a weight to fp16."""
    lens = [37, 16, 0]
    q, kc, vc, _, _, slots = fp8_case(5, lens, 2, 3, 2, 32)
    with np.errstate(invalid="ignore"):
        kq, vq = (F.decode_e4m3(c).astype(np.float32)[slots] for c in (kc, vc))
    kd, vd = (np.float32(x) * np.float32(s) for x, s in ((kq, ks), (vq, vs)))
    scale = 1.0 / np.sqrt(32)
    lens = np.asarray(lens, np.int32)
    got = decode_rounded_p(q, kq, vq, lens, scale, F16, sums="mma16",
                           k_scales=np.full(kq.shape[:3], ks, np.float32), v_scale=vs)
    want = decode_rounded_p(q, kd, vd, lens, scale, F16, sums="mma16")
    for g, w in zip(got, want):
        if equal:
            np.testing.assert_array_equal(g, w)
        else:
            live = np.isfinite(w)  # lse: -inf for the empty row, in both
            diff = np.abs(g[live] - w[live]).max()
            assert 0 < diff <= 2.0 ** -9 * np.abs(w[live]).max(), diff


def test_per_tensor_order_takes_per_tensor_cases_only():
    """The registry's label for ``decode_mma_fp8`` resolves and runs on a decode
    case quantized per tensor, and is refused for one quantized per (token, kv
    head), whose scales cannot leave the sums."""
    from validation import baselines, registry

    spec = registry.KERNELS_BY_NAME["decode_mma_fp8"]
    assert spec.baseline == "mma16_pc16/after/recip_after"
    x = registry.make_inputs("decode", registry.find_shape("decode", "mma_gqa4_d64", True),
                             "normal", 0)
    for mode in ("tensor", "token_head"):
        y = fixtures.fp8_quantize(x, mode)
        y = dict(y, q=y["q"].astype(F16))
        label = baselines.resolve(spec.baseline, y, F16)
        assert label == "mma16_pcf16/after/recip_after"
        if mode == "tensor":
            out = baselines.baseline("decode", y, label)
            assert np.isfinite(out["out"]).all()
        else:
            with pytest.raises(ValueError, match="quantized per tensor"):
                baselines.baseline("decode", y, label)


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
def test_p_bf16_mutant_fails_the_per_tensor_rule():
    """Positive control of the per-tensor order's resolving power: P rounded to
    bf16 (8 significant bits, ``mma.PRECISION_MUTANTS``) where the kernel and
    the ``mma16_pc16`` baseline round it to f16 fails the rule that passes the
    clean kernel on the same case."""
    lens = [45, 30]
    q, kc, vc, ks, vs, slots = fp8_case(7, lens, 1, 4, 1, 32)
    clean = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2)
    assert all(ok for _, ok, _ in judged(q, kc, vc, lens, slots, ks, vs, clean))
    bad = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2, defect="p_bf16")
    assert not all(ok for _, ok, _ in judged(q, kc, vc, lens, slots, ks, vs, bad))


@pytest.mark.device
@pytest.mark.parametrize("defect", ["swizzle_off_by_one", "ldmatrix_no_trans"])
def test_layout_defects_act_through_the_code_tiles(defect):
    """The code tiles are read by ldmatrix as they are: K's swizzle and V's
    transposed load are the 16-bit kernel's, and their planted switches fail."""
    lens = [37, 16]
    q, kc, vc, ks, vs, slots = fp8_case(3, lens, 1, 4, 1, 32)
    clean = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2)
    assert all(ok for _, ok, _ in judged(q, kc, vc, lens, slots, ks, vs, clean))
    bad = run(q, kc, vc, lens, slots, ks, vs, warps=1, stages=2, defect=defect)
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
    """A stage holds codes (a quarter word an element), converted in registers
    (no f16 tile besides): at D 128, 4 warps, 3 stages, 52 KB against 100 KB."""
    assert 4 * mma.smem_words(128, 4, 3, fp8=True) == 52 * 1024
    assert 4 * mma.smem_words(128, 4, 3) == 100 * 1024


def _fp8_signature():
    """The unchecked fp8 kernel's argument types (scales as flat float32 arrays)."""
    from numba import types

    u32, i32, f32 = types.uint32, types.int32, types.float32
    A = types.Array
    return (A(u32, 4, "C"), A(u32, 1, "C"), A(u32, 1, "C"), A(i32, 1, "C"), A(i32, 2, "C"),
            i32, i32, i32, i32, f32, i32, A(f32, 4, "C"), A(f32, 3, "C"), A(f32, 4, "C"),
            A(f32, 4, "C"), A(f32, 1, "C"), A(f32, 1, "C"))


@pytest.mark.compile
def test_compiles_to_the_e4m3_conversion_and_the_f16_mma():
    from numba import cuda

    sig = _fp8_signature()
    kern = mma.mma_decode_kernel("f8", 128, 4, 1, mma.WARPS, mma.STAGES, "HND")
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16") == 128 // 8 + 128 // 8
    # the codes go from ldmatrix to the mma in registers: K two k steps an x4
    # load (Q's fragments are read as words), V 32 columns an x4.trans load
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 128 // 32
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 128 // 32
    assert ptx.count("prmt.b32") == 2 * (128 // 32) * 2  # V's words: one byte permute each


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


# ---------------------------------------------------------------------------
# per-(token, kv head) scales
# ---------------------------------------------------------------------------

def tok_case(seed, lens, n_kv, group, t_q, head_dim, v_scale):
    """``tests.test_decode_fp8._tok_case``'s hostile cache (K scales 1e-6..1e4 a
    (sequence, kv head), V scales ``v_scale`` x [0.1, 1] a row, an all-zero row,
    rows past 448, NaN codes and scales in every unused row and the spare slot),
    pooled [M + 1, H_kv, cap, D]; q [M, T, H, D] float16 (each query of a
    sequence its own draw, scaled as the case scales q)."""
    from tests.test_decode_fp8 import _tok_case

    rng = np.random.default_rng(seed)
    cap = max(lens)
    lens = np.asarray(lens, np.int32)
    q, arrays = _tok_case(rng, lens, cap, n_kv, head_dim, group * n_kv, v_scale)
    spread = rng.uniform(0.5, 1.5, (len(lens), t_q, 1, 1))
    q = (q[:, None] * spread).astype(F16)
    return q, arrays


def tok_run(q, arrays, lens, page=None, layout="HND", **kw):
    kc, vc, ksc, vsc = arrays[:4]
    lens = np.asarray(lens, np.int32)
    slots = np.arange(len(lens), dtype=np.int32)
    if page is None:
        return mma.mma_decode(q, kc, vc, lens, slot_table=slots, k_scale=ksc, v_scale=vsc, **kw)
    from tests.test_decode_fp8 import _paged

    kp, vp, ksp, vsp, table = _paged(kc, vc, ksc, vsc, lens, page, layout, page)
    return mma.mma_decode(q, kp, vp, lens, page_table=table, layout=layout, k_scale=ksp,
                          v_scale=vsp, **kw)


def tok_judged(q, arrays, lens, got, baseline="pv"):
    """[(name, passed, text)]: out and lse against the float64 oracle over the
    dequantized cache (code x its row's scale), with the registry's baseline
    for it: ``mma16_pvf16`` (V scales into P, normalised a row, rounded to f16;
    ``baseline="pv"``) or the 16-bit kernels' ``mma16_pf16`` ("p")."""
    kc, vc, ksc, vsc, kd, vd = arrays
    m = len(lens)
    k, v = kd[:m].astype(np.float32), vd[:m].astype(np.float32)
    lens = np.asarray(lens, np.int32)
    scale = 1.0 / np.sqrt(q.shape[-1])
    ref = decode_attention_multi_ref(q, k, v, lens, scale=scale)
    if baseline == "pv":  # the registry's: scores over the K codes, then the scales
        with np.errstate(invalid="ignore"):
            codes = F.decode_e4m3(vc[:m]).astype(np.float32)
            k_codes = F.decode_e4m3(kc[:m]).astype(np.float32)
        base = decode_rounded_p(q, k_codes, codes, lens, scale, F16, sums="mma16",
                                v_scales=vsc[:m], k_scales=ksc[:m], norm="recip_after")
    else:
        base = decode_rounded_p(q, k, v, lens, scale, F16, sums="mma16", norm="recip_after")
    return [(name,) + tuple(tolerance.verdict(np.asarray(g), r, b))
            for name, g, r, b in zip(("out", "lse"), got, ref, base)]


TOK_CASES = {
    # name: (lens, n_kv, group, t_q, D, page, layout, n_split, V scale)
    "pooled_v1e-6": ([40, 0, 23], 2, 4, 1, 64, None, "HND", None, 1e-6),
    "hnd16_t4_split2_v1e4": ([40, 17], 2, 2, 4, 32, 16, "HND", 2, 1e4),
    "nhd3_t2_v1": ([29, 0, 6], 2, 1, 2, 64, 3, "NHD", None, 1.0),
}


@pytest.mark.device
@pytest.mark.parametrize("name", list(TOK_CASES))
def test_token_head_scales_match_the_oracle(name):
    """Hostile per-row scales (V scales near 1e-6, 1 and 1e4: a case each),
    pooled, HND pages of 16 (a page a tile) with T 4 and two splits, NHD pages
    of 3 (page lookups row by row) with T 2 and empty sequences."""
    lens, n_kv, group, t_q, d, page, layout, n_split, v_scale = TOK_CASES[name]
    q, arrays = tok_case(5, lens, n_kv, group, t_q, d, v_scale)
    got = tok_run(q, arrays, lens, page, layout, warps=2, stages=2, n_split=n_split)
    for what, ok, text in tok_judged(q, arrays, lens, got):
        assert ok, f"{name} {what}: {text}"
    empty = np.asarray(lens) == 0
    assert np.all(got[1][empty] == -np.inf) and np.all(got[0][empty] == 0)
    assert not np.isnan(got[0]).any()


@functools.lru_cache(maxsize=None)
def _clean_passes(v_scale):
    """The clean kernel passes the judge on the defect tests' case (run once a V
    scale)."""
    lens = [40, 0, 23]
    q, arrays = tok_case(5, lens, 2, 4, 1, 64, v_scale)
    clean = tok_run(q, arrays, lens, warps=2, stages=2)
    return all(ok for _, ok, _ in tok_judged(q, arrays, lens, clean))


@pytest.mark.device
@pytest.mark.parametrize("defect,v_scale", [("fp8_scale_wrong_head", 1.0),
                                            ("fp8_scale_wrong_token", 1.0),
                                            ("fp8_p_unnormalized", 1e-6)])
def test_token_head_defects_are_caught(defect, v_scale):
    """Positive controls: another kv head's scales, the next position's, and P vs
    rounded to f16 without the row normaliser (V scales near 1e-6: subnormal)
    each fail the judge that passes the clean kernel on the same case."""
    lens = [40, 0, 23]
    q, arrays = tok_case(5, lens, 2, 4, 1, 64, v_scale)
    assert _clean_passes(v_scale)
    bad = tok_run(q, arrays, lens, warps=2, stages=2, defect=defect)
    assert not all(ok for _, ok, _ in tok_judged(q, arrays, lens, bad))


@pytest.mark.device
def test_token_head_normaliser_keeps_a_dominated_row_exact():
    """One position outweighs the rest by 500 nats (their weights are 0 in
    float32), in the first of 12 tiles of one warp, every V scale ``c``: the
    kernel's row is ``float32(V_0 c)`` to the bit. The normaliser settles at
    ``c`` on tile 0 and o's rescale on the 11 later tiles must be exactly 1.
    ``c`` is picked so that ``c (1 / c)`` is not 1 in float32: a rescale formed
    that way drifts o by 2^-24 a tile (the mean-rule failure of
    decode_mma_fp8_tok/long_d128/large on the H200, validation.findings)."""
    L, D = 12 * mma.KT, 32
    c = np.float32(0.049)
    assert c * (np.float32(1.0) / c) != np.float32(1.0)
    rng = np.random.default_rng(11)
    kc = np.zeros((1, 1, L, D), np.uint8)
    kc[0, 0, 0] = 0x38  # e4m3 1.0
    vc = rng.integers(0, 0x78, (1, 1, L, D)).astype(np.uint8)  # finite codes
    vc |= rng.integers(0, 2, vc.shape).astype(np.uint8) << 7
    ksc = np.ones((1, 1, L), np.float32)
    ksc[0, 0, 0] = 100.0  # score 100 sqrt(32) at position 0, 0 elsewhere
    vsc = np.full((1, 1, L), c, np.float32)
    q = np.ones((1, 1, 1, D), F16)
    out, lse = mma.mma_decode(q, kc, vc, np.int32([L]), slot_table=np.int32([0]),
                              k_scale=ksc, v_scale=vsc, warps=1, stages=2, n_split=1)
    want = F.decode_e4m3(vc[0, 0, 0]) * c
    assert np.array_equal(np.asarray(out)[0, 0, 0], want), \
        np.abs(np.asarray(out)[0, 0, 0] / want - 1).max()
    assert np.asarray(lse)[0, 0, 0] == np.float32(100.0 * np.sqrt(np.float32(D)))


@pytest.mark.device
def test_decode_plan_mma_takes_token_head_scales():
    """``DecodePlan(fp8_scales="token_head", method="mma")`` (range check
    compiled in), NHD pages of 3, T 2: the bits of ``mma_decode``."""
    from numba import cuda

    from attention.decode.plan import DecodePlan
    from tests.test_decode_fp8 import _paged

    lens = [29, 0, 6]
    q, arrays = tok_case(7, lens, 2, 2, 2, 32, 1.0)
    lens32 = np.asarray(lens, np.int32)
    kp, vp, ksp, vsp, table = _paged(*arrays[:4], lens32, 3, "NHD", 3)
    plan = DecodePlan(3, 4, 2, 32, kp.shape[0], max(lens), cache_dtype=np.uint8,
                      q_dtype=np.float16, t_q=2, method="mma", page_size=3, layout="NHD",
                      fp8_scales="token_head")
    assert plan.method == "mma" and plan.scale_shape == ksp.shape
    d = [cuda.to_device(np.ascontiguousarray(x)) for x in (q, kp, vp, lens32, table, ksp, vsp)]
    out = plan.run(d[0], d[1], d[2], d[3], page_table=d[4], k_scale=d[5], v_scale=d[6],
                   sync=True)
    want = tok_run(q, arrays, lens, 3, "NHD", n_split=plan.n_split)
    assert np.array_equal(np.asarray(out.copy_to_host()).view(np.uint32),
                          np.asarray(want[0]).view(np.uint32))
    assert np.array_equal(plan.lse.copy_to_host().view(np.uint32),
                          np.asarray(want[1]).view(np.uint32))


def test_token_head_scales_are_checked():
    """Scale arrays of the wrong shape or dtype, a NaN or negative scale on an
    attended row, and a mix of the two modes are named before any launch; a
    NaN scale on a row nobody attends is accepted (it is never read)."""
    lens = [9, 0, 4]
    q, arrays = tok_case(3, lens, 2, 2, 1, 32, 1.0)
    kc, vc, ksc, vsc = arrays[:4]
    lens32 = np.asarray(lens, np.int32)
    slots = np.arange(3, dtype=np.int32)
    call = mma.mma_decode

    def run_with(ks, vs):
        return call(q, kc, vc, lens32, slot_table=slots, k_scale=ks, v_scale=vs)

    with pytest.raises(checks.ShapeError, match="k_scale"):
        run_with(ksc[:, :, :-1], vsc)
    with pytest.raises(checks.DTypeError, match="v_scale"):
        run_with(ksc, vsc.astype(np.float64))
    with pytest.raises(checks.ShapeError, match="v_scale"):
        run_with(ksc, np.float32([0.5]))
    bad = ksc.copy()
    bad[2, 1, 3] = np.nan  # sequence 2 attends positions 0..3
    with pytest.raises(checks.RangeError, match="k_scale: expected finite scales >= 0"):
        run_with(bad, vsc)
    bad = vsc.copy()
    bad[0, 0, 5] = -1.0
    with pytest.raises(checks.RangeError, match="v_scale"):
        run_with(ksc, bad)
    assert np.isnan(ksc[2, :, 4:]).all() and np.isnan(ksc[3]).all()  # never attended
    with pytest.raises(ValueError, match="needs an fp8 kernel with token_head"):
        call(q, kc, vc, lens32, slot_table=slots, k_scale=1.0, v_scale=1.0,
             defect="fp8_scale_wrong_head")


def test_token_head_stages_hold_the_scales():
    """A stage also holds its tile's 16 K and 16 V scales (128 bytes)."""
    extra = 4 * (mma.smem_words(128, 4, 3, fp8=True, token_head=True)
                 - mma.smem_words(128, 4, 3, fp8=True))
    assert extra == 4 * 3 * 128


@pytest.mark.compile
def test_token_head_kernel_compiles_to_4_byte_async_copies():
    from numba import cuda

    sig = _fp8_signature()
    kern = mma.mma_decode_kernel("f8", 128, 4, 1, mma.WARPS, mma.STAGES, "NHD",
                                 scales="token_head")
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    assert "cp.async.ca.shared.global" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    assert ".local" not in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16") == 128 // 8 + 128 // 8


def test_decode_plan_routes_the_token_head_switches():
    """The tensor-core switches need ``method="mma"`` and token_head scales;
    the switches both kernels have go to the one the plan chose."""
    from attention.decode.plan import DecodePlan

    base = dict(m=2, n_heads=4, n_kv_heads=2, head_dim=32, kv_slots=3, max_seq=32,
                cache_dtype=np.uint8, q_dtype=np.float16)
    with pytest.raises(checks.AttentionInputError, match="give method='mma'"):
        DecodePlan(**base, fp8_scales="token_head", method="fast",
                   defect="fp8_p_unnormalized")
    with pytest.raises(checks.AttentionInputError, match="needs fp8_scales='token_head'"):
        DecodePlan(**base, method="mma", defect="fp8_p_unnormalized")
    for method in ("fast", "mma"):
        plan = DecodePlan(**base, fp8_scales="token_head", method=method,
                          defect="fp8_scale_wrong_head")
        assert plan.method == method and plan.kernel_plan["defect"] == "fp8_scale_wrong_head"


def test_plan_counts_blocks_an_sm_by_registers(monkeypatch):
    """At D 128 the fp8 kernel's 52 KB would let 4 blocks share an SM, its
    200-210 registers a thread let 2: B 32 x H_kv 8 = 256 blocks are one wave,
    so one split (the H200 took 90.5 us with the two splits the shared-memory
    count gave, 78-86 us with one: notes/bench.md). Positive control: with a
    register bound that allows 4 blocks the plan goes back to two splits."""
    assert mma.plan(32, 32, 8, 128, 4096, mma.FP8_KIND)["n_split"] == 1
    monkeypatch.setitem(mma.REGISTERS, 128, 128)
    assert mma.plan(32, 32, 8, 128, 4096, mma.FP8_KIND)["n_split"] == 2


def test_fp8_rings_are_as_deep_as_the_residency_allows(monkeypatch):
    """The fp8 plans take the deepest ring (up to ``FP8_STAGES``) that the blocks
    an SM holds by registers still fit in shared memory: 6 stages at D 128 (2
    blocks of about 100 KB), token_head too; 16-bit plans keep ``STAGES``.
    Positive control: a register bound that allows 4 blocks brings the fp8 ring
    back to 3 stages (4 x 100 KB would not fit)."""
    assert mma.default_stages(mma.FP8_KIND, 128) == mma.FP8_STAGES == 6
    assert mma.default_stages(mma.FP8_KIND, 128, scales="token_head") == 6
    assert mma.plan(32, 32, 8, 128, 4096, mma.FP8_KIND)["stages"] == 6
    assert mma.plan(32, 32, 8, 128, 4096, "f16")["stages"] == mma.STAGES
    for d in (32, 64, 128):
        s = mma.default_stages(mma.FP8_KIND, d)
        dyn = 4 * mma.smem_words(d, mma.WARPS, s, fp8=True)
        assert mma.blocks_by_registers(d) * (dyn + 1024) <= mma.SMEM_PER_SM
    monkeypatch.setitem(mma.REGISTERS, 128, 128)
    assert mma.blocks_by_registers(128) == 4
    assert mma.default_stages(mma.FP8_KIND, 128) == mma.STAGES
