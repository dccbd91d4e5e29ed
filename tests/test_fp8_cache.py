"""FP8 (e4m3) KV caches: the format's reference and the quantizing append
(``attention.cache.fp8``).

* the numpy reference: every code decodes exactly and encodes back to itself;
  against ``ml_dtypes.float8_e4m3fn`` (round to nearest even) on random values
  inside the range; ties to even at subnormals and normals; saturation at and
  past 448 (never NaN); NaN;
* the device append, on the simulator and a GPU: bit for bit the numpy
  reference of the same rounding, per tensor and per (token, kv head), HND and
  NHD, several tokens a sequence, a shared prefix page, with a canary (every
  other byte of the cache and every other scale unchanged); hostile rows:
  values past 448 before quantization (saturate, no NaN), all-zero rows (scale
  0, codes 0, no NaN), per-tensor scales from 1e-6 to 1e4;
* the planted ``append_round_to_zero`` fails the bit comparison;
* bad input is named before anything is launched.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.cache import fp8
from attention.core import checks

CANARY = 0xA5


def test_every_code_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    vals = fp8.decode_e4m3(codes)
    finite = ~np.isnan(vals)
    assert finite.sum() == 254  # 0x7F and 0xFF are NaN
    back = fp8.encode_e4m3(vals[finite])
    want = codes[finite].copy()
    want[want == 0x80] = 0x00  # -0.0 encodes as +0
    assert np.array_equal(back, want)
    assert vals[0x7E] == 448 and vals[0x01] == 2.0 ** -9 and vals[0x08] == 2.0 ** -6


def test_encoding_matches_ml_dtypes_inside_the_range():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-448, 448, 20000),
                        rng.standard_normal(20000) * 2.0 ** rng.integers(-12, 8, 20000)])
    x = x.astype(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)  # no exact -0.0 among x
    assert np.array_equal(fp8.encode_e4m3(x), want)


def test_ties_saturation_and_nan():
    enc = fp8.encode_e4m3
    tiny = 2.0 ** -9
    assert list(enc(np.float32([0.5 * tiny, 1.5 * tiny, 2.5 * tiny]))) == [0, 2, 2]  # even
    assert enc(np.float32(1.0625))[()] == enc(np.float32(1.0))[()]  # 1 + 1/16: tie to even
    assert enc(np.float32(1.1875))[()] == enc(np.float32(1.25))[()]  # 1 + 3/16 -> 1.25
    assert list(enc(np.float32([448, 463.9, 464, 1e6, -1e30, np.inf]))) == [0x7E] * 4 + [0xFE, 0x7E]
    assert enc(np.float32(-500))[()] == 0xFE
    assert enc(np.float32(np.nan))[()] == 0x7F
    assert enc(np.float32(1.0), round_to_zero=True)[()] == enc(np.float32(1.0))[()]
    assert enc(np.float32(1.124), round_to_zero=True)[()] == enc(np.float32(1.0))[()]
    assert enc(np.float32(1.124))[()] == enc(np.float32(1.125))[()]


def _case(rng, layout, page, n_kv=2, d=40, t_new=3, dtype=np.float32):
    lens = np.array([5, 0, page], np.int32)  # sequence 2's first page: shared with 0's
    m = len(lens)
    width = 4
    table = np.full((m, width), 2 ** 30, np.int32)
    order = rng.permutation(m * width)
    for i in range(m):
        table[i] = order[i * width:(i + 1) * width]
    table[2, 0] = table[0, 0]  # a read-only shared prefix page (no token lands there)
    n_pages = m * width
    shape = (n_pages, n_kv, page, d) if layout == "HND" else (n_pages, page, n_kv, d)
    pages = np.full(shape, CANARY, np.uint8)
    sc_shape = shape[:3]
    k_new = (rng.standard_normal((m, t_new, n_kv, d)) * 50).astype(dtype)
    k_new[0, 0] = 0.0  # an all-zero row: scale 0
    k_new[1, t_new - 1, 0, :3] = [6e4, -3e4, np.float32(np.nan)]  # past 448 (per tensor); NaN
    return lens, table, pages, sc_shape, k_new


@pytest.mark.device
@pytest.mark.parametrize("layout,page", [("HND", 4), ("NHD", 3)])
@pytest.mark.parametrize("mode", ["token_head", "tensor"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_append_is_the_reference_bit_for_bit(layout, page, mode, dtype):
    rng = np.random.default_rng(page + len(mode))
    dt = np.dtype(dtype)
    lens, table, pages, sc_shape, k_new = _case(rng, layout, page, dtype=dt)
    v_new = (rng.standard_normal(k_new.shape) * 3).astype(dt)
    kp, vp = pages.copy(), pages.copy()
    ks, vs = (np.full(sc_shape, np.nan, np.float32) for _ in range(2))
    want_k, want_v, want_ks, want_vs = kp.copy(), vp.copy(), ks.copy(), vs.copy()
    if mode == "tensor":
        sk, sv = np.float32([0.05]), np.float32([1e-3])
        fp8.fp8_append(k_new, v_new, kp, vp, table, lens, k_scale=sk, v_scale=sv,
                       layout=layout)
        fp8.quantize_append_ref(k_new, want_k, None, table, lens, scale=sk[0], layout=layout)
        fp8.quantize_append_ref(v_new, want_v, None, table, lens, scale=sv[0], layout=layout)
    else:
        fp8.fp8_append(k_new, v_new, kp, vp, table, lens, k_scales=ks, v_scales=vs,
                       layout=layout)
        fp8.quantize_append_ref(k_new, want_k, want_ks, table, lens, layout=layout)
        fp8.quantize_append_ref(v_new, want_v, want_vs, table, lens, layout=layout)
        assert np.array_equal(ks, want_ks, equal_nan=True)
        assert np.array_equal(vs, want_vs, equal_nan=True)
        assert not np.isnan(ks[~np.isnan(want_ks)]).any()
    assert np.array_equal(kp, want_k) and np.array_equal(vp, want_v)
    assert (kp == CANARY).sum() == (want_k == CANARY).sum()  # the canary: nothing else written


@pytest.mark.device
def test_hostile_rows_saturate_and_zero_rows_stay_zero():
    rng = np.random.default_rng(1)
    lens, table, pages, sc_shape, k_new = _case(rng, "HND", 4)
    k_new[2, 0] = np.float32(1e4)  # every value past 448 at scale 1
    kp, vp = pages.copy(), pages.copy()
    fp8.fp8_append(k_new, k_new, kp, vp, table, lens, k_scale=np.float32([1.0]),
                   v_scale=np.float32([1.0]))
    page, off = table[2, lens[2] // 4], lens[2] % 4
    assert (kp[page, :, off] == 0x7E).all()  # saturated, not NaN
    ks, vs = (np.full(sc_shape, np.nan, np.float32) for _ in range(2))
    kp2 = pages.copy()
    fp8.fp8_append(k_new, k_new, kp2, pages.copy(), table, lens, k_scales=ks, v_scales=vs)
    page0, off0 = table[0, lens[0] // 4], lens[0] % 4
    assert (ks[page0, :, off0] == 0).all() and (kp2[page0, :, off0] == 0).all()


@pytest.mark.device
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1e4])
def test_per_tensor_scales_across_the_range(scale):
    rng = np.random.default_rng(2)
    lens, table, pages, sc_shape, k_new = _case(rng, "HND", 4, t_new=1)
    k_new = (k_new * np.float32(scale)).astype(np.float32)
    kp, vp = pages.copy(), pages.copy()
    s = np.float32([scale])
    fp8.fp8_append(k_new, k_new, kp, vp, table, lens, k_scale=s, v_scale=s)
    want = pages.copy()
    fp8.quantize_append_ref(k_new, want, None, table, lens, scale=s[0])
    assert np.array_equal(kp, want)


@pytest.mark.device
def test_round_to_zero_is_caught():
    rng = np.random.default_rng(3)
    lens, table, pages, sc_shape, k_new = _case(rng, "HND", 4)
    kp = pages.copy()
    ks, vs = (np.full(sc_shape, np.nan, np.float32) for _ in range(2))
    fp8.fp8_append(k_new, k_new, kp, pages.copy(), table, lens, k_scales=ks, v_scales=vs,
                   defect="append_round_to_zero")
    want = pages.copy()
    fp8.quantize_append_ref(k_new, want, ks.copy(), table, lens)
    assert not np.array_equal(kp, want)


def test_bad_input_is_named():
    rng = np.random.default_rng(4)
    lens, table, pages, sc_shape, k_new = _case(rng, "HND", 4)
    ks = np.zeros(sc_shape, np.float32)
    with pytest.raises(checks.AttentionInputError, match="exactly one"):
        fp8.fp8_append(k_new, k_new, pages, pages, table, lens)
    with pytest.raises(checks.AttentionInputError, match="exactly one"):
        fp8.fp8_append(k_new, k_new, pages, pages, table, lens, k_scale=np.float32([1]),
                       v_scale=np.float32([1]), k_scales=ks, v_scales=ks)
    with pytest.raises(checks.DTypeError, match="k_pages"):
        fp8.fp8_append(k_new, k_new, pages.astype(np.float16), pages, table, lens,
                       k_scales=ks, v_scales=ks)
    with pytest.raises(checks.ShapeError, match="k_scales"):
        fp8.fp8_append(k_new, k_new, pages, pages, table, lens, k_scales=ks[:, :, :2],
                       v_scales=ks)
    with pytest.raises(checks.RangeError, match="k_scale"):
        fp8.fp8_append(k_new, k_new, pages, pages, table, lens, k_scale=np.float32([0]),
                       v_scale=np.float32([1]))
    short = table[:, :1].copy()
    with pytest.raises(checks.RangeError, match="page_table: too short"):
        fp8.fp8_append(k_new, k_new, pages, pages, short, lens, k_scales=ks, v_scales=ks)


@pytest.mark.compile
@pytest.mark.parametrize("per_token", [True, False])
def test_append_kernel_divides_exactly(per_token):
    """The quantizing append compiles for sm_90 with a correctly rounded
    division (``div.rn.f32``, not fast-math's approximation): the reference's
    ``x / scale`` is one IEEE division."""
    from numba import cuda, types

    kern = fp8.fp8_append_kernel("HND", per_token)
    f32, u8 = types.float32, types.uint8
    sc = types.Array(f32, 3 if per_token else 1, "C")
    sig = (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.Array(u8, 4, "C"),
           types.Array(u8, 4, "C"), sc, sc, types.Array(types.int32, 2, "C"),
           types.Array(types.int32, 1, "C"))
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx
