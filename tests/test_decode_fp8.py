"""FP8 (e4m3) caches in the fast decode: ``DecodePlan(cache_dtype=np.uint8)``
with per-tensor scales (``k_scale`` / ``v_scale`` float32 [1] device arrays).

The kernel's inputs are the dequantized values ``decode(code) * scale``
(exact in float64), so the oracle is the float64 attention over them and the
kernel is judged by the fp16 path's rule: its baseline is the float32
attention over the dequantized values in the kernel's lane order (16 lanes a
row, as for 16-bit caches). Checked on the simulator and a GPU: pooled and
paged (HND pages of 4) caches, q in float32 and float16, one split and two,
a length of 0 and the capacity, NaN codes (0x7F) in every unused row (a read
past a length shows). The scales are required on an fp8 plan and refused on
another; compile-only: the fp8 kernel converts with ``cvt.rn.f16x2.e4m3x2``
and copies 8-byte pieces, nothing spilled.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.cache import fp8
from attention.core import checks


def _case(rng, lens, cap, n_kv, d, k_scale, v_scale):
    """Pooled fp8 caches [M, H_kv, cap, D] (NaN codes past each length) and
    their dequantized float64 values (0 past the lengths)."""
    m = len(lens)
    kc = np.full((m, n_kv, cap, d), fp8.E4M3_NAN, np.uint8)
    vc = kc.copy()
    for i, n in enumerate(lens):
        kc[i, :, :n] = fp8.encode_e4m3((rng.standard_normal((n_kv, n, d)) * 40).astype(np.float32))
        vc[i, :, :n] = fp8.encode_e4m3((rng.standard_normal((n_kv, n, d)) * 40).astype(np.float32))
    kd = np.nan_to_num(fp8.decode_e4m3(kc).astype(np.float64)) * np.float64(k_scale)
    vd = np.nan_to_num(fp8.decode_e4m3(vc).astype(np.float64)) * np.float64(v_scale)
    return kc, vc, kd, vd


def judge(q, kd, vd, lens, out, lse, what):
    from attention.oracle import decode_attention_ref
    from validation import baselines, growth
    from validation.tolerance import assert_matches

    ref_o, ref_l = decode_attention_ref(q, kd, vd, lens)
    label = growth.baseline_order("fast_decode", {"q": q}, np.float16)  # 16 lanes a row
    k32, v32 = kd.astype(np.float32), vd.astype(np.float32)
    base_o, base_l = baselines.decode_order(q, k32, v32, lens, np.arange(len(lens)), label)
    assert_matches(out, ref_o, base_o, what=f"out {what}")
    assert_matches(lse, ref_l, base_l, what=f"lse {what}")


def _scales(k_scale, v_scale):
    from attention.core.device import to_device

    return to_device(np.float32([k_scale])), to_device(np.float32([v_scale]))


@pytest.mark.device
@pytest.mark.parametrize("q_dtype,n_split", [("float32", 1), ("float16", 2)])
def test_pooled_fp8_decode_matches_the_oracle(q_dtype, n_split):
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    rng = np.random.default_rng(n_split)
    h, n_kv, d, cap = 4, 2, 64, 40
    lens = np.array([cap, 0, 17], np.int32)
    ks, vs = 0.02, 0.5
    kc, vc, kd, vd = _case(rng, lens, cap, n_kv, d, ks, vs)
    q = rng.standard_normal((3, h, d)).astype(q_dtype)
    pl = DecodePlan(3, h, n_kv, d, 3, cap, cache_dtype=np.uint8, q_dtype=q_dtype,
                    n_split=n_split)
    assert pl.fp8 and pl.kind == "f8"
    d_ks, d_vs = _scales(ks, vs)
    out = pl.run(to_device(q), to_device(kc), to_device(vc), to_device(lens), k_scale=d_ks,
                 v_scale=d_vs, sync=True)
    out, lse = np.asarray(to_host(out)), np.asarray(to_host(pl.lse))
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    judge(q.astype(np.float32), kd, vd, lens, out, lse, f"fp8 q {q_dtype} splits {n_split}")


@pytest.mark.device
def test_paged_fp8_decode_matches_the_oracle():
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan
    from validation import fixtures

    rng = np.random.default_rng(5)
    h, n_kv, d, cap, page = 4, 2, 64, 24, 4
    lens = np.array([cap, 9, 4], np.int32)
    ks, vs = 1e-3, 3.0
    kc, vc, kd, vd = _case(rng, lens, cap, n_kv, d, ks, vs)
    kp, vp, table = fixtures.paged_from_pooled(kc, vc, lens, np.arange(3), page, "HND", rng)
    assert (kp == fp8.E4M3_NAN).sum() > 0  # NaN codes where no row lives
    q = rng.standard_normal((3, h, d)).astype(np.float32)
    pl = DecodePlan(3, h, n_kv, d, kp.shape[0], cap, cache_dtype="float8_e4m3fn",
                    page_size=page)
    d_ks, d_vs = _scales(ks, vs)
    out = pl.run(to_device(q), to_device(kp), to_device(vp), to_device(lens),
                 page_table=to_device(table), k_scale=d_ks, v_scale=d_vs, sync=True)
    judge(q, kd, vd, lens, np.asarray(to_host(out)), np.asarray(to_host(pl.lse)), "fp8 paged")


@pytest.mark.device
def test_scales_are_required_on_fp8_plans_and_refused_elsewhere():
    from attention.core.device import to_device
    from attention.decode.plan import DecodePlan

    pl = DecodePlan(1, 2, 1, 64, 1, 8, cache_dtype=np.uint8)
    q = to_device(np.zeros((1, 2, 64), np.float32))
    cache = to_device(np.zeros((1, 1, 8, 64), np.uint8))
    lens = to_device(np.ones(1, np.int32))
    with pytest.raises(checks.AttentionInputError, match="fp8 plan needs both"):
        pl.run(q, cache, cache, lens)
    other = DecodePlan(1, 2, 1, 64, 1, 8, cache_dtype=np.float16)
    s = to_device(np.float32([1.0]))
    with pytest.raises(checks.AttentionInputError, match="only fp8 plans"):
        other.run(to_device(np.zeros((1, 2, 64), np.float16)),
                  to_device(np.zeros((1, 1, 8, 64), np.float16)),
                  to_device(np.zeros((1, 1, 8, 64), np.float16)), lens, k_scale=s, v_scale=s)


def test_fp8_q_dtype_is_checked():
    from attention.decode.plan import DecodePlan

    with pytest.raises(checks.DTypeError, match="q_dtype"):
        DecodePlan(1, 2, 1, 64, 1, 8, cache_dtype=np.uint8, q_dtype=np.float64)


@pytest.mark.compile
@pytest.mark.parametrize("paging,defect,cvt", [(None, None, "e4m3x2"), ("HND", None, "e4m3x2"),
                                               (None, "fp8_as_e5m2", "e5m2x2")])
def test_fp8_kernel_compiles_with_the_e4m3_conversion(paging, defect, cvt):
    from numba import cuda, types

    from attention.decode import fast as F

    pl = F.plan(32, 32, 8, 128, 4096, "f8", paging=paging, defect=defect)
    cache = types.Array(types.uint8, 4, "C")
    f32 = types.float32
    sig = (types.Array(types.float16, 3, "C"), cache, cache, types.int32[::1],
           types.Array(types.int32, 2 if paging else 1, "C"), f32, types.int32,
           types.Array(f32, 3, "C"), types.Array(f32, 2, "C"), types.Array(f32, 4, "C"),
           types.Array(f32, 4, "C"), types.int32[::1], types.Array(f32, 1, "C"),
           types.Array(f32, 1, "C"))
    ptx, _ = cuda.compile_ptx(pl["kernel"].py_func, sig, cc=(9, 0), fastmath=True)
    assert f"cvt.rn.f16x2.{cvt}" in ptx and "cp.async.ca.shared.global" in ptx
    assert "ld.local" not in ptx


@pytest.mark.device
@pytest.mark.parametrize("defect", ["fp8_scale_twice", "fp8_no_k_scale", "fp8_as_e5m2"])
def test_fp8_defects_are_caught(defect):
    """Positive controls: the V scale applied twice, the K scale not applied,
    the codes decoded as e5m2: each fails the oracle check above."""
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    rng = np.random.default_rng(8)
    h, n_kv, d, cap = 4, 2, 64, 24
    lens = np.array([cap, 11], np.int32)
    ks, vs = 0.02, 0.5
    kc, vc, kd, vd = _case(rng, lens, cap, n_kv, d, ks, vs)
    q = rng.standard_normal((2, h, d)).astype(np.float32)
    pl = DecodePlan(2, h, n_kv, d, 2, cap, cache_dtype=np.uint8, defect=defect)
    d_ks, d_vs = _scales(ks, vs)
    out = pl.run(to_device(q), to_device(kc), to_device(vc), to_device(lens), k_scale=d_ks,
                 v_scale=d_vs, sync=True)
    with pytest.raises(AssertionError):
        judge(q, kd, vd, lens, np.asarray(to_host(out)), np.asarray(to_host(pl.lse)), defect)
