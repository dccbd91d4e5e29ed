"""The tensor-core GEMM (``attention.gemm.tgemm``): split-tf32 products, cp.async ring.

* plain process: PTX (three mmas a tile and k8 step with an fp32 ``b``, two
  with fp16; 16-byte ``cp.async`` copies; one barrier a slice; no local
  memory);
* simulator / GPU (``device``): ``usable`` and bad input raised before any
  launch; the GEMM against float64 for both ``b`` layouts and
  dtypes, with a batch table, per-batch extents, a partial last row tile,
  entries past ``n_ext`` left untouched, and K spanning two partials; the MLA
  weight GEMMs' layout (a [M, Z, K], c [M, Z, N]) at each weight plan. On the
  simulator ``mma`` is a warp collective of shuffles over the same fragment
  layouts as the hardware's.

The error bound is derived, not tuned: a product of split operands is off by
at most ~3 x 2^-22 of ``|a||b|`` (the halves' rounding and the dropped
``al bl``), and the two-level fp32 sum adds at most ``(PART_K + K / PART_K +
2)`` roundings of 2^-24 of ``sum |a||b|``. Wrong fragments or a lost slice
give errors of order one.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from attention.gemm import sgemm

from attention.gemm import tgemm
from tests.conftest import MODE

PART_K = 8 * tgemm.PART_STEPS


def _ptx(b_order, b_dtype):
    from numba import cuda, types

    from tests.test_mla_gemm import gemm_signature

    b16 = b_dtype == types.float16
    ptx, _ = cuda.compile_ptx(tgemm.tgemm_kernel(b_order, b16).py_func,
                              gemm_signature(b_dtype), cc=(9, 0))
    return ptx


@pytest.mark.compile
@pytest.mark.parametrize("b_order", sgemm.B_ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compile_tgemm(b_order, dtype):
    from numba import types

    ptx = _ptx(b_order, getattr(types, dtype))
    warps_m, warps_n, tiles_m, tiles_n, bk, stages = tgemm.PLAN
    terms = 3 if dtype == "float32" else 2
    assert ".local" not in ptx, "tiles or fragments spilled to local memory"
    # one k8 step written out (the slice's k8 steps are a loop): a tile's terms
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == \
        terms * tiles_m * tiles_n
    assert "cp.async.cg.shared.global" in ptx and "cp.async.commit_group" in ptx
    assert f"cp.async.wait_group {stages - 2}" in ptx
    assert ptx.count("bar.sync") == 1  # one barrier a slice
    assert len(re.findall(r"ld\.shared\.f32", ptx)) >= 4 * tiles_m  # a fragments


@pytest.mark.device
def test_usable_and_bad_input():
    from attention.core.device import device_empty

    bm = tgemm.tile_shape()[0]
    m = bm // 2 + 1
    a = device_empty((2, m, 64), np.float32)
    b = device_empty((2, 40, 64), np.float32)
    assert tgemm.usable(a, b, a_order="zmk", b_order="znk")
    assert not tgemm.usable(a, b, a_order="kmz", b_order="znk")  # a's order
    # "mzk": M is the first extent (2 rows here: less than half a tile)
    assert not tgemm.usable(a, b, a_order="mzk", b_order="znk")
    rows = device_empty((m, 2, 64), np.float32)
    assert tgemm.usable(rows, b, a_order="mzk", b_order="znk")
    small = device_empty((2, bm // 2, 64), np.float32)
    assert not tgemm.usable(small, b, a_order="zmk", b_order="znk")  # M: half a tile
    odd = device_empty((2, 40, 66), np.float32)  # rows of 66 words: not 16-byte aligned
    assert not tgemm.usable(a, odd, a_order="zmk", b_order="znk")
    odd16 = device_empty((2, 40, 68), np.float16)  # 136-byte rows
    assert not tgemm.usable(a, odd16, a_order="zmk", b_order="znk")
    with pytest.raises(ValueError, match="tgemm"):
        tgemm.launch(a, odd, device_empty((2, m, 40), np.float32), None, None, None, 1.0,
                     a_order="zmk", b_order="znk", c_order="zmn", max_n=40, n_batch=2,
                     stream=0)
    with pytest.raises(ValueError, match="b_order"):
        tgemm.tgemm_kernel("nkz", False)


def _bound(a, b, k):
    """Worst-case error of a split-tf32, two-level sum (module docstring)."""
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    roundings = PART_K + -(-k // PART_K) + 2
    return (3 * 2.0 ** -22 + roundings * 2.0 ** -24) * mag


@pytest.mark.device
@pytest.mark.parametrize("b_order", sgemm.B_ORDERS)
@pytest.mark.parametrize("b_dtype", ["float32", "float16"])
def test_tgemm_matches_float64(b_order, b_dtype):
    """Batch 0: full extents, its last row tile partial, K over two partials
    (the second short; the whole-slice copies, then the bounded last slice);
    batches 1, 2: ragged N and K (bounded copies, partial 16-byte chunks)."""
    from attention.core.device import to_device, to_host

    rng = np.random.default_rng(7)
    bm, bn = tgemm.tile_shape()
    z_n, m, n = 3, bm + bm // 4, 2 * bn + 8  # rows of b (zkn) 16-byte aligned
    k = PART_K + 24 if MODE != "gpu" else 2 * PART_K + 24
    n_ext = np.array([n, 5, bn + 3], np.int32)
    k_ext = np.array([k, 9, 1], np.int32)
    zb = np.array([1, 0, 1], np.int32)
    a = rng.standard_normal((z_n, m, k)).astype(np.float32)
    b_nk = rng.standard_normal((2, n, k)).astype(b_dtype)
    b = b_nk if b_order == "znk" else np.ascontiguousarray(b_nk.transpose(0, 2, 1))
    d_a, d_b = to_device(a), to_device(b)
    assert tgemm.usable(d_a, d_b, a_order="zmk", b_order=b_order)
    d_c = to_device(np.full((z_n, m, n), np.nan, np.float32))
    tgemm.launch(d_a, d_b, d_c, to_device(zb), to_device(n_ext), to_device(k_ext), 0.5,
                 a_order="zmk", b_order=b_order, c_order="zmn", max_n=n, n_batch=z_n,
                 stream=0)
    c = to_host(d_c)
    for z in range(z_n):
        nn, kk = n_ext[z], k_ext[z]
        bz = b_nk[zb[z], :nn, :kk]
        want = 0.5 * (a[z, :, :kk].astype(np.float64) @ bz.astype(np.float64).T)
        err = np.abs(c[z, :, :nn] - want)
        bound = 0.5 * _bound(a[z, :, :kk], bz, kk)
        assert (err <= bound).all(), (f"batch {z}: max err {err.max():.3e}, worst err/bound "
                                      f"{(err / bound).max():.3f}")
        assert np.isnan(c[z, :, nn:]).all(), f"batch {z}: wrote past n_ext"


@pytest.mark.compile
@pytest.mark.parametrize("part_steps", [1, 2])
def test_compile_tgemm_partials_inside_a_slice(part_steps, monkeypatch):
    """Partials shorter than a slice (added inside the k8 loop) compile without
    spills and keep one barrier a slice."""
    from numba import types

    monkeypatch.setattr(tgemm, "PART_STEPS", part_steps)
    tgemm.tgemm_kernel.cache_clear()
    try:
        ptx = _ptx("znk", types.float32)
    finally:
        tgemm.tgemm_kernel.cache_clear()
    assert ".local" not in ptx, "tiles or fragments spilled to local memory"
    assert ptx.count("bar.sync") == 1


@pytest.mark.device
@pytest.mark.parametrize("plan", tgemm.WEIGHT_PLANS, ids=str)
@pytest.mark.parametrize("b_order", sgemm.B_ORDERS)
def test_weight_layout_mzk_matches_float64(b_order, plan):
    """The MLA weight GEMMs' layout: a [M, Z, K] (a query's heads side by side),
    c [M, Z, N] with columns past ``n_ext`` untouched, each weight plan; K not a
    multiple of the slice, N ending inside a tile. Positive control: the same
    call with the planted ``tf32_single`` (one tf32 product) breaks the bound."""
    from attention.core.device import to_device, to_host

    rng = np.random.default_rng(11)
    bm, bn = tgemm.tile_shape(plan)
    z_n, m, k, n = 2, bm, PART_K + 24, bn + 4  # b's zkn rows of n: 16-byte aligned
    a = rng.standard_normal((m, z_n, k)).astype(np.float32)
    b_nk = rng.standard_normal((z_n, n, k)).astype(np.float32)
    b = b_nk if b_order == "znk" else np.ascontiguousarray(b_nk.transpose(0, 2, 1))
    d_a, d_b = to_device(a), to_device(b)
    assert tgemm.usable(d_a, d_b, a_order="mzk", b_order=b_order, plan=plan)
    zb = to_device(np.arange(z_n, dtype=np.int32))
    n_ext, k_ext = (to_device(np.full(z_n, x, np.int32)) for x in (n - 3, k))
    worst = {}
    for defect in (None, "tf32_single"):
        d_c = to_device(np.full((m, z_n, n), np.nan, np.float32))
        tgemm.launch(d_a, d_b, d_c, zb, n_ext, k_ext, 1.0, a_order="mzk", b_order=b_order,
                     c_order="mzn", max_n=n - 3, n_batch=z_n, stream=0, plan=plan,
                     defect=defect)
        c = to_host(d_c)
        assert np.isnan(c[:, :, n - 3:]).all(), "wrote past n_ext"
        worst[defect] = max(
            (np.abs(c[:, z, :n - 3] - a[:, z].astype(np.float64) @ b_nk[z, :n - 3].T)
             / _bound(a[:, z], b_nk[z, :n - 3], k)).max() for z in range(z_n))
    assert worst[None] <= 1.0, f"worst err/bound {worst[None]:.3f}"
    assert worst["tf32_single"] > 1.0, "the control did not break the bound"
