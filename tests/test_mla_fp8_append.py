"""The quantizing append into MLA's fp8 latent cache (``mla.fp8_append``).

* bit for bit ``mla.fp8.quantize`` (the numpy reference), per-tensor and
  per-token scales, paged (a shuffled table, a shared prefix page that no row
  lands in, unused entries holding 2**31 - 1) and contiguous, float32 and
  float16 rows; a canary (every other byte of the cache and every other scale
  unchanged);
* hostile rows: values far past ``448 s`` (and inf) saturate to 0x7E / 0xFE,
  never a NaN code; zero rows give scale 0 and codes 0; NaN in c_kv counted as
  0 in the scale; per-token scales from 1e-6 to 1e4 and tensor scales from 1e-6
  to 100, still bit for bit;
* ``n_new``; the device-checked path (device lengths, table or n_new, or a
  flag given): a row that cannot be placed is not written and is counted;
* bad input named before any copy or launch, the cache untouched;
* the planted ``append_round_to_zero`` changes codes on a fixture built so it
  must (and is its own reference's rounding);
* the GPU kernels compile with a correctly rounded division (plain process).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla.fp8 import quantize

CANARY = 0xA5
SC_CANARY = np.float32(-3.5)
HUGE = 2 ** 31 - 1
RANK, D_ROPE = 64, 32
W, RB = RANK + D_ROPE, RANK + 2 * D_ROPE  # 96 values, 128 bytes
PAGE = 4
# float16 of values past 65504 (k_pe) and x / s past float32's range: inf, as meant
OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def paged_case(rng, dtype=np.float32, t_new=3):
    """Three sequences, pages of 4: lengths 5, 0, 4; sequence 2's first page is
    sequence 0's (full, read-only: nothing lands there); 9 pages shuffled;
    unused table entries 2**31 - 1."""
    lens = np.array([5, 0, 4], np.int64)
    order = rng.permutation(9)
    table = np.full((3, 3), HUGE, np.int32)
    table[0, :2] = order[:2]
    table[1, :1] = order[2:3]
    table[2, :2] = [order[0], order[3]]  # shared prefix page
    new = (rng.standard_normal((3, t_new, W)) * 20).astype(dtype)
    cache = np.full((9, PAGE, RB), CANARY, np.uint8)
    return new, cache, table, lens


def contiguous_case(rng, dtype=np.float32, t_new=3):
    lens = np.array([5, 0, 2], np.int64)
    new = (rng.standard_normal((3, t_new, W)) * 20).astype(dtype)
    cache = np.full((3, 8, RB), CANARY, np.uint8)
    return new, cache, None, lens


def expected(new, cache, scales, table, lens, n_new=None, scale=None, round_to_zero=False,
             skip=()):
    """The reference append on copies: ``(cache, scales)`` after it. ``skip``:
    (b, i) rows not written."""
    cache, scales = cache.copy(), None if scales is None else scales.copy()
    n_b, t_new = new.shape[:2]
    page = cache.shape[1]
    if table is None:
        table = np.arange(n_b, dtype=np.int32)[:, None]
    codes, s = quantize(new, RANK, scale=scale, round_to_zero=round_to_zero)
    for b in range(n_b):
        for i in range(t_new if n_new is None else int(n_new[b])):
            if (b, i) in skip:
                continue
            p = int(lens[b]) + i
            pg, off = int(table[b, p // page]), p % page
            cache[pg, off] = codes[b, i]
            if scales is not None:
                scales[pg, off] = s[b, i]
    return cache, scales


def run(new, cache, table, lens, mode, **kw):
    """Append (host arrays, in place) and return the reference's arrays."""
    from mla.fp8_append import fp8_append_latent

    scale = kw.pop("scale", np.float32([0.05]))
    if mode == "token":
        scales = np.full(cache.shape[:2], SC_CANARY, np.float32)
        want = expected(new, cache, scales, table, lens, n_new=kw.get("n_new"),
                        round_to_zero=kw.get("defect") is not None)
        out = fp8_append_latent(new, cache, table, lens, scales=scales, **kw)
        return out, scales, want
    want = expected(new, cache, None, table, lens, n_new=kw.get("n_new"), scale=scale,
                    round_to_zero=kw.get("defect") is not None)
    out = fp8_append_latent(new, cache, table, lens, scale=scale, **kw)
    return out, None, want


def assert_same(cache, scales, want):
    np.testing.assert_array_equal(cache, want[0])
    if scales is not None:
        np.testing.assert_array_equal(scales.view(np.uint32), want[1].view(np.uint32))


# ---------------------------------------------------------------------------
# device (the simulator, or a GPU)
# ---------------------------------------------------------------------------


@pytest.mark.device
@OVERFLOW_OK
@pytest.mark.parametrize("mode", ["token", "tensor"])
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_append_is_the_reference_bit_for_bit(mode, layout, dtype):
    rng = np.random.default_rng(len(mode) + len(layout) + len(dtype))
    case = paged_case if layout == "paged" else contiguous_case
    new, cache, table, lens = case(rng, np.dtype(dtype))
    new[1, 0, :RANK] = 0.0  # a zero row (per token: scale 0, codes 0)
    new[0, 1, :3] = [np.nan, -0.0, 1e-30]  # NaN counted as 0 in the scale; underflow
    new[2, 2, RANK:RANK + 2] = [1e5, -6e-8]  # k_pe: float16 overflow (inf) and subnormal
    before = cache.copy()
    out, scales, want = run(new, cache, table, lens, mode)
    assert out is None
    assert_same(cache, scales, want)
    written = np.any(cache != before, axis=2)
    assert written.sum() == 9  # every new row changed its bytes; nothing else did
    if scales is not None:  # the canary of the scales: only the 9 new entries
        assert (scales != SC_CANARY).sum() == 9
        assert (scales == 0).sum() == 1  # the zero row's
        assert not np.isnan(scales).any()


@pytest.mark.device
@OVERFLOW_OK
def test_hostile_rows_saturate_and_zero_rows_stay_zero():
    rng = np.random.default_rng(1)
    new, cache, table, lens = paged_case(rng, t_new=2)
    big = np.float32([1e4, -1e4, np.inf, -np.inf, 3.4e38, -3.4e38, 4.49, -4.49])
    new[0, 0, :RANK] = np.resize(big, RANK)  # far past 448 s at s = 0.01
    out, _, want = run(new, cache, table, lens, "tensor", scale=np.float32([0.01]))
    assert_same(cache, None, want)
    codes = cache[table[0, 1], 1, :RANK]  # position 5
    assert set(codes.tolist()) == {0x7E, 0xFE}  # saturated, never NaN (0x7F / 0xFF)
    assert not np.isin(cache[..., :RANK], [0x7F, 0xFF]).any()

    new2, cache2, table2, lens2 = paged_case(rng, t_new=2)
    new2[2, 1, :RANK] = 0.0
    new2[1, 0, :RANK] = -0.0
    _, scales, want2 = run(new2, cache2, table2, lens2, "token")
    assert_same(cache2, scales, want2)
    for b, i in ((2, 1), (1, 0)):
        p = int(lens2[b]) + i
        pg, off = table2[b, p // PAGE], p % PAGE
        assert scales[pg, off] == 0 and not cache2[pg, off, :RANK].any()


@pytest.mark.device
def test_per_token_scales_across_the_range():
    """Rows scaled so their scales run 1e-6 .. 1e4 (amax = 448 s)."""
    rng = np.random.default_rng(2)
    new, cache, table, lens = paged_case(rng, t_new=3)
    targets = np.logspace(-6, 4, 9).reshape(3, 3)
    c = new[..., :RANK]
    c *= (448 * targets / np.abs(c).max(axis=-1))[..., None].astype(np.float32)
    _, scales, want = run(new, cache, table, lens, "token")
    assert_same(cache, scales, want)
    got = want[1][want[1] != SC_CANARY]
    assert got.min() < 2e-6 and got.max() > 5e3


@pytest.mark.device
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 100.0])
def test_per_tensor_scales_across_the_range(scale):
    rng = np.random.default_rng(3)
    new, cache, table, lens = contiguous_case(rng, t_new=2)
    new[..., :RANK] *= np.float32(scale)
    _, _, want = run(new, cache, table, lens, "tensor", scale=np.float32([scale]))
    assert_same(cache, None, want)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_the_division_is_correctly_rounded(mode):
    """c_kv values ``t s`` (exact) for e4m3 ties t at s = 61/64 (per token:
    amax 427 gives s = 427 / 448 = 61/64 exactly): ``x / s`` is the tie, and
    rounds to even; ``x * (1 / s)`` misses the tie for about half of them,
    which changes the code (checked here on the fixture itself)."""
    from attention.cache.fp8 import E4M3_VALUES, encode_e4m3

    s = np.float32(61 / 64)
    vals = np.sort(E4M3_VALUES[(E4M3_VALUES > 0) & ~np.isnan(E4M3_VALUES)]).astype(np.float64)
    ties = (vals[:-1] + vals[1:]) / 2
    x = (ties[(ties > 0.5) & (ties < 400)] * s).astype(np.float32)
    assert np.array_equal(x / s, ties[(ties > 0.5) & (ties < 400)])  # exact ties
    miss = encode_e4m3(x * (np.float32(1) / s)) != encode_e4m3(x / s)
    assert miss.sum() >= 30
    row = np.resize(np.concatenate([x[miss], x[~miss]]), RANK)
    row[0] = np.float32(427.0)  # amax: the per-token scale is s too
    rng = np.random.default_rng(7)
    new, cache, table, lens = paged_case(rng, t_new=2)
    new[..., :RANK] = row * np.where(rng.random((3, 2, 1)) < 0.5, -1, 1).astype(np.float32)
    _, scales, want = run(new, cache, table, lens, mode, scale=np.float32([s]))
    assert_same(cache, scales, want)
    if scales is not None:
        assert (want[1][want[1] != SC_CANARY] == s).all()


@pytest.mark.device
def test_n_new_and_the_device_checked_path():
    from numba import cuda

    from mla.fp8_append import fp8_append_latent

    rng = np.random.default_rng(4)
    new, cache, table, lens = paged_case(rng, t_new=3)
    n_new = np.array([2, 0, 3])
    base = cache.copy()
    out, scales, want = run(new, cache, table, lens, "token", n_new=n_new)
    assert out is None
    assert_same(cache, scales, want)

    # device lengths, n_new, cache and scales: the checked kernel, its flag clear
    d_cache = cuda.to_device(base)
    d_scales = cuda.to_device(np.full(base.shape[:2], SC_CANARY, np.float32))
    flag = fp8_append_latent(new, d_cache, table, cuda.to_device(lens.astype(np.int32)),
                             scales=d_scales, n_new=cuda.to_device(n_new.astype(np.int32)))
    assert flag.copy_to_host().tolist() == [0, HUGE]
    assert_same(d_cache.copy_to_host(), d_scales.copy_to_host(), want)

    # a device table with a bad entry where sequence 2 writes positions 4, 5, 6
    bad = table.copy()
    bad[2, 1] = 9  # == num_pages
    cache2 = base.copy()
    sc2 = np.full(base.shape[:2], SC_CANARY, np.float32)
    want2 = expected(new, base, sc2, table, lens, skip={(2, 0), (2, 1), (2, 2)})
    flag = fp8_append_latent(new, cache2, cuda.to_device(bad), lens, scales=sc2)
    assert flag.copy_to_host().tolist() == [3, 2]
    assert_same(cache2, sc2, want2)

    # device lengths, one negative; a host flag given accumulates in place
    lens3 = lens.astype(np.int32)
    lens3[0] = -1
    host_flag = np.array([5, 7], np.int32)
    cache3 = base.copy()
    want3 = expected(new, base, None, table, lens, skip={(0, 0), (0, 1), (0, 2)},
                     scale=np.float32([0.5]))
    out = fp8_append_latent(new, cache3, table, cuda.to_device(lens3),
                            scale=np.float32([0.5]), flag=host_flag)
    assert out is host_flag and host_flag.tolist() == [8, 0]
    assert_same(cache3, None, want3)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_round_to_zero_is_caught(mode):
    """c_kv of 1.24 s (and 448 s, so a per-token scale is s = 1 exactly): to
    nearest 1.25, toward zero 1.125: every such code differs."""
    rng = np.random.default_rng(5)
    new, cache, table, lens = contiguous_case(rng, t_new=1)
    new[..., :RANK] = np.float32(1.24)
    new[..., 0] = np.float32(448.0)
    clean = cache.copy()
    _, _, want = run(new, clean, table, lens, mode, scale=np.float32([1.0]))
    planted = cache.copy()
    _, scales, want_rz = run(new, planted, table, lens, mode, scale=np.float32([1.0]),
                             defect="append_round_to_zero")
    assert_same(planted, scales, want_rz)  # the defect is the reference's round_to_zero
    assert not np.array_equal(planted, clean)
    rows = np.arange(3), lens
    assert (planted[rows][:, 1:RANK] != clean[rows][:, 1:RANK]).all()


# ---------------------------------------------------------------------------
# bad input (no kernel runs)
# ---------------------------------------------------------------------------


def _args(contiguous=False):
    rng = np.random.default_rng(6)
    new, cache, table, lens = (contiguous_case if contiguous else paged_case)(rng, t_new=2)
    return dict(new_rows=new, cache=cache, page_table=table, lengths=lens,
                scales=np.full(cache.shape[:2], SC_CANARY, np.float32))


def _tensor(s):
    return lambda a: a.update(scales=None, scale=s)


BAD = [
    (lambda a: a.update(new_rows=a["new_rows"].astype(np.float64)), checks.DTypeError,
     "new_rows"),
    (lambda a: a.update(cache=a["cache"].view(np.int8)), checks.DTypeError, "cache"),
    (lambda a: a.update(cache=a["cache"][0]), checks.ShapeError, "cache"),
    (lambda a: a.update(new_rows=a["new_rows"][..., :40].copy()), checks.ShapeError, "new_rows"),
    (lambda a: a.update(new_rows=np.zeros((3, 2, RB + 1), np.float32)), checks.ShapeError,
     "new_rows"),
    (lambda a: a.update(new_rows=a["new_rows"][:, :0].copy()), checks.RangeError, "T >= 1"),
    (lambda a: a.update(cache=np.full((9, PAGE, 120), CANARY, np.uint8),
                        new_rows=np.zeros((3, 2, 92), np.float32),
                        scales=np.zeros((9, PAGE), np.float32)),
     checks.ShapeError, "multiple of 16"),
    (lambda a: a.update(new_rows=np.zeros((65536, 1, W), np.float16)), checks.RangeError,
     "B <= 65535"),
    (lambda a: a.update(scale=np.float32([1.0])), checks.AttentionInputError, "exactly one"),
    (lambda a: a.update(scales=None), checks.AttentionInputError, "exactly one"),
    (_tensor(np.float32([0.0])), checks.RangeError, "scale"),
    (_tensor(np.float32([-1.0])), checks.RangeError, "scale"),
    (_tensor(np.float32([np.nan])), checks.RangeError, "scale"),
    (_tensor(np.float32([1000.0])), checks.RangeError, "65504"),
    (_tensor(np.float64([1.0])), checks.DTypeError, "scale"),
    (_tensor(np.float32([1.0, 1.0])), checks.ShapeError, "scale"),
    (lambda a: a.update(scales=a["scales"][:, :2].copy()), checks.ShapeError, "scales"),
    (lambda a: a.update(scales=a["scales"].astype(np.float16)), checks.DTypeError, "scales"),
    (lambda a: a.update(page_table=a["page_table"][:, :1].copy()), checks.RangeError,
     "page_table: too short"),
    (lambda a: a.update(page_table=a["page_table"].astype(np.int64)), checks.DTypeError,
     "page_table"),
    (lambda a: a["page_table"].__setitem__((0, 1), -1), checks.RangeError, "page_table"),
    (lambda a: a["page_table"].__setitem__((1, 0), a["page_table"][0, 1]), checks.RangeError,
     "written twice"),
    (lambda a: a.update(lengths=np.array([5, -1, 4])), checks.RangeError, "lengths"),
    (lambda a: a.update(lengths=np.array([5, 0])), checks.ShapeError, "lengths"),
    (lambda a: a.update(n_new=[1, 3, 0]), checks.RangeError, "n_new"),
    (lambda a: a.update(flag=np.zeros(3, np.int32)), checks.ShapeError, "flag"),
]
BAD_CONTIGUOUS = [
    (lambda a: a.update(lengths=np.array([5, 0, 7])), checks.RangeError, "max_seq=8"),
    (lambda a: a.update(new_rows=a["new_rows"][:2].copy()), checks.ShapeError, "new_rows"),
    (lambda a: a.update(scales=np.zeros((9, PAGE), np.float32)), checks.ShapeError, "scales"),
]


@pytest.mark.parametrize("change,error,match", BAD + [(c, e, m) for c, e, m in BAD_CONTIGUOUS],
                         ids=[f"paged{i}" for i in range(len(BAD))]
                         + [f"contiguous{i}" for i in range(len(BAD_CONTIGUOUS))])
def test_bad_input_is_named_before_anything_runs(change, error, match, monkeypatch):
    from mla import fp8_append as F

    def forbidden(*args, **kwargs):
        raise AssertionError("copied or launched before the checks")

    monkeypatch.setattr(F, "to_device", forbidden)
    monkeypatch.setattr(F, "launch_stream", forbidden)
    contiguous = any(change is c for c, _, _ in BAD_CONTIGUOUS)
    args = _args(contiguous)
    change(args)
    cache, scales = args["cache"], args["scales"]
    before = (cache.copy(), None if scales is None else scales.copy())
    with pytest.raises(error, match=match):
        F.fp8_append_latent(**args)
    np.testing.assert_array_equal(cache, before[0])
    if scales is not None:
        np.testing.assert_array_equal(scales, before[1])


def test_unknown_defect_and_exports():
    from mla import fp8_append as F

    with pytest.raises(ValueError, match="defect"):
        F.fp8_append_kernel(True, "nope")
    with pytest.raises(ValueError, match="defect"):
        F.fp8_append_latent(**_args(), defect="nope")
    assert F.FP8_APPEND_DEFECTS == ("append_round_to_zero",)


@pytest.mark.compile
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("checked", [False, True])
def test_kernel_divides_exactly_and_packs_float16(per_token, checked):
    """sm_90 PTX: ``div.rn.f32`` (no fast-math approximation), k_pe through
    ``cvt.rn.f16x2.f32``, nothing spilled to local memory."""
    from numba import cuda, types

    from mla.fp8_append import fp8_append_kernel

    def arr(t, n):
        return types.Array(t, n, "C")

    i32 = types.int32
    sig = [arr(types.float16, 3), arr(types.uint8, 3), arr(types.float32, 2 if per_token else 1),
           arr(i32, 2), arr(i32, 1), arr(i32, 1)] + ([arr(i32, 1)] if checked else [])
    ptx, _ = cuda.compile_ptx(fp8_append_kernel(per_token, None, checked).py_func, tuple(sig),
                              cc=(9, 0))
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx
    assert "cvt.rn.f16x2.f32" in ptx and ".local" not in ptx
