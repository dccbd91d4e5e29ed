"""The MLA tensor-core kernel with S = Q K^T on wgmma (``mla.mma`` ``wgmma=True``,
``attention.gemm.wgmma``): the building block's PTX text, the kernel's PTX and
ptxas on ``sm_90a``, bad arguments, and on a GPU the mma.sync kernel's result.

On the simulator ``attention.gemm.wgmma`` emulates the instruction from its
descriptors (the swizzled addresses, the k steps' offsets, the accumulator
layout) with mma.sync's k-step rule, so the two forms of the kernel must give the
same bits there: that checks the data movement in CI. On a GPU: the same bits if
the warp-group instruction rounds a k step as mma.sync does, else a difference
of the order of a k step's rounding, and the float64 oracle's rule either way.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import GPU


def test_tile_text_issues_every_k_step_at_its_offsets():
    from attention.gemm import wgmma as WG

    text = WG.tile_text("bf16", 16, 9, 8192, 8192)
    assert text.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == 36
    assert text.count("p0, 1, 1, 0, 0;") == 1  # the first ignores the accumulators
    # block 8, k step 3: 8 * 8192 + 96 bytes on, in 16-byte units
    assert f"add.s64 wa, $8, {(8 * 8192 + 96) >> 4};" in text
    assert text.index("wgmma.fence") < text.index("wgmma.mma_async")
    assert text.rstrip().endswith("wgmma.wait_group.sync.aligned 0;\n}")
    with pytest.raises(ValueError, match="kind"):
        WG.tile_text("f32", 16, 1, 0, 0)
    with pytest.raises(ValueError, match="n: expected"):
        WG.tile_text("f16", 12, 1, 0, 0)


def test_descriptor_fields():
    from attention.gemm import wgmma as WG

    d = WG.descriptor_host(0x12340)
    assert d & 0x3FFF == 0x1234 and (d >> 16) & 0x3FFF == 1 and (d >> 32) & 0x3FFF == 64
    assert d >> 62 == WG.SWIZZLE_128B


def test_bad_arguments_are_refused():
    from mla import mma as MM

    with pytest.raises(ValueError, match="wgmma: a 16-bit cache at row_groups 4"):
        MM.mla_mma_kernel("f16", 512, 64, 2, 64, False, None, None, None, True)
    with pytest.raises(ValueError, match="wgmma: a 16-bit cache at row_groups 4"):
        MM.mla_mma_kernel("f16", 512, 64, 4, 64, False, None, "tensor", None, True)


def _both(kind, rank, heads, lens, cap, n_split, seed=3, defect=None):
    """o_lat and lse of the mma.sync and the wgmma kernels (RG 4) over one random
    contiguous 16-bit cache, and the inputs; ``defect`` planted in the wgmma one."""
    from attention.core.device import BFLOAT16, device_empty, to_device
    from mla import mma as MM

    rng = np.random.default_rng(seed)
    d_rope, n_b = 64, len(lens)
    dt = np.float16 if kind == "f16" else BFLOAT16
    qc = rng.standard_normal((n_b, heads, rank + d_rope)).astype(np.float32)
    lat = rng.standard_normal((n_b, cap, rank + d_rope)).astype(np.float32).astype(dt)
    lens = np.asarray(lens, np.int32)
    table = np.arange(n_b, dtype=np.int32)[:, None]
    outs = []
    for wg in (False, True):
        pl = MM.plan(n_b, heads, rank, d_rope, cap, kind, n_split=n_split, row_groups=4,
                     wgmma=wg, defect=defect if wg else None)
        o = device_empty((n_b, heads, rank), np.float32)
        lse = device_empty((n_b, heads), np.float32)
        pa, pm = MM.scratch(pl, n_b, heads)
        MM.launch(pl, to_device(qc), to_device(lat), to_device(lens), to_device(table), heads,
                  0.07, o, lse, pa, pm, 0)
        outs.append((o.copy_to_host(), lse.copy_to_host()))
    return outs, qc, lat, lens, dt


@pytest.mark.device
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_wgmma_kernel_gives_the_mma_sync_bits_on_the_simulator(kind):
    """Rank 64 (W 128: two column blocks, so the block offsets count), 2 heads
    (rows 2 .. 63 of the row block padded), lengths 70 and 5 (two tiles, a
    partial one), one split. Only on the simulator: there both forms sum a k
    step by the same rule."""
    from attention.core.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the bits are compared on the simulator (its wgmma is mma.sync's rule); "
                    "the GPU test below compares with the oracle")
    (o0, l0), (o1, l1) = _both(kind, 64, 2, [70, 5], 72, 1)[0]
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(l1, l0)
    assert np.isfinite(o1).all() and np.abs(o1).max() > 0


@pytest.mark.device
def test_planted_swizzle_changes_the_wgmma_kernel_bits():
    """Positive control of the test above: the latent tiles stored with the next
    row's swizzle (``swizzle_off_by_one``), which the wgmma, reading through the
    128-byte swizzle of its descriptors, must see."""
    from attention.core.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the bits are compared on the simulator")
    (o0, l0), (o1, l1) = _both("f16", 64, 2, [70, 5], 72, 1, defect="swizzle_off_by_one")[0]
    assert not (np.array_equal(o1, o0) and np.array_equal(l1, l0))


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_kernel_compiles_to_wgmma_for_sm_90a(kind):
    """36 wgmma m64n16k16 a tile (9 column blocks of 4 k steps) in place of S's
    mma.sync and ldmatrix; P.V keeps its 64 mma.sync; the async-proxy fence;
    no local memory; ptxas for sm_90a spills nothing at 128 registers (RG 4)."""
    from numba import cuda

    from mla import mma as MM
    from tests.test_mla_mma import _signature
    from tests.test_prefill_mma import _ptxas_report, spill_bytes

    kern = MM.mla_mma_kernel(kind, 512, 64, 4, 64, False, None, None, None, True)
    ptx, _ = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0, "a"), fastmath=True,
                              launch_bounds=(512,))
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16") == 36
    assert ptx.count("mma.sync.aligned.m16n8k16") == 64  # P.V
    assert "fence.proxy.async.shared::cta" in ptx
    assert ".local" not in ptx and "ld.local" not in ptx
    report = _ptxas_report(ptx, "sm_90a")
    if report is None:
        pytest.skip("no ptxas report: cuda.core (nvJitLink) is not installed")
    assert spill_bytes(report) == 0, report


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the full shape on a GPU (wgmma needs sm_90a)")
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_wgmma_kernel_matches_the_mma_sync_kernel(kind):
    """B 3 / 64 heads (one RG 4 row block) / lengths 300, 64 and 1, two splits,
    rank 512: the wgmma kernel against the mma.sync one, and both against the
    float64 oracle (q rounded to the cache type as the kernels round it)."""
    ((o0, l0), (o1, l1)), qc, lat, lens, dt = _both(kind, 512, 64, [300, 64, 1], 320, 2)
    rank = 512
    q = qc.astype(dt).astype(np.float64)
    want = np.zeros(o0.shape, np.float64)
    for b, n in enumerate(lens):
        kv = lat[b, :n].astype(np.float64)
        s = 0.07 * q[b] @ kv.T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        want[b] = (p / p.sum(axis=1, keepdims=True)) @ kv[:, :rank]
    err0, err1 = np.abs(o0 - want).max(), np.abs(o1 - want).max()
    assert np.isfinite(o1).all() and np.isfinite(l1).all()
    assert err1 <= 2 * err0 + 1e-6, (err0, err1)
    assert np.abs(o0 - o1).max() <= 4 * err0 + 1e-6
