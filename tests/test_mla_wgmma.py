"""The MLA tensor-core kernel on wgmma (``mla.mma`` ``wgmma`` 1: S = Q K^T; 2: S
and P.V; ``attention.gemm.wgmma``): the building blocks' PTX text, the kernel's
PTX and ptxas on ``sm_90a``, bad arguments, ``plan``'s default, and on a GPU
the mma.sync kernel's result.

On the simulator ``attention.gemm.wgmma`` emulates the instruction from its
descriptors (the swizzled addresses, the k steps' offsets, the MN-major
operand's atoms, the accumulator layout) with mma.sync's k-step rule, so the
forms of the kernel must give the same bits there: that checks the data
movement in CI. On a GPU: the same bits if the warp-group instruction rounds a
k step as mma.sync does (the H100 run of the S form: it does), and the float64
oracle's rule either way.
"""

from __future__ import annotations

import functools

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


def test_accumulate_text_reads_b_mn_major_and_keeps_the_accumulators():
    from attention.gemm import wgmma as WG

    text = WG.accumulate_text("f16", 128, 4)
    op = "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"
    assert text.count(op) == 4
    assert text.count("p1, 1, 1, 0, 1;") == 4  # accumulate, B transposed (MN-major)
    assert "p0" not in text
    # k step 3: A 96 bytes on, B 3 x 16 rows of 128 bytes on (16-byte units)
    assert "add.s64 wa, $128, 6;" in text and "add.s64 wb, $129, 384;" in text
    assert WG.accumulate_text("bf16", 16, 1, trans_b=0).count("p1, 1, 1, 0, 0;") == 1
    with pytest.raises(ValueError, match="steps"):
        WG.accumulate_text("f16", 16, 0)
    with pytest.raises(ValueError, match="n: expected"):
        WG.accumulate_text("f16", 264, 1)


def test_descriptor_fields():
    from attention.gemm import wgmma as WG

    d = WG.descriptor_host(0x12340)
    assert d & 0x3FFF == 0x1234 and (d >> 16) & 0x3FFF == 1 and (d >> 32) & 0x3FFF == 64
    assert d >> 62 == WG.SWIZZLE_128B
    assert (WG.descriptor_host(0x400, lbo=8192) >> 16) & 0x3FFF == 512
    with pytest.raises(ValueError, match="lbo"):
        WG.descriptor(24)


def test_bad_arguments_are_refused():
    from mla import mma as MM

    with pytest.raises(ValueError, match="wgmma: a 16-bit cache at row_groups 4"):
        MM.mla_mma_kernel("f16", 512, 64, 2, 64, False, None, None, None, True)
    with pytest.raises(ValueError, match="wgmma: a 16-bit cache at row_groups 4"):
        MM.mla_mma_kernel("f16", 512, 64, 4, 64, False, None, "tensor", None, True)
    with pytest.raises(ValueError, match="wgmma: 0 .off., 1 .S. or 2"):
        MM.mla_mma_kernel("f16", 512, 64, 4, 64, False, None, None, None, 3)
    with pytest.raises(ValueError, match="P.V's n"):
        MM.mla_mma_kernel("f16", 2048, 64, 4, 64, False, None, None, None, 2)


def test_plan_default_is_mma_sync_off_sm_90():
    """``plan``'s ``wgmma`` default (``wgmma_level``) off a GPU: 0 (mma.sync)
    for every cache; on a GPU, 2 at compute capability 9.0 for a 16-bit cache
    at RG 4 only. (The simulator's: the test below.)"""
    from mla import mma as MM

    if MM.SIMULATOR:
        pytest.skip("the simulator process: test_plan_default_on_the_simulator")
    want = 2 if MM._compute_capability() == (9, 0) else 0  # (None: no GPU here)
    assert MM.plan(2, 128, 512, 64, 256, "bf16")["wgmma"] == want
    assert MM.plan(2, 16, 512, 64, 256, "bf16")["wgmma"] == 0  # RG 2
    assert MM.plan(2, 128, 512, 64, 256, "f16", fp8="tensor")["wgmma"] == 0


@pytest.mark.device
def test_plan_default_on_the_simulator():
    """On the simulator the default is mma.sync (the wgmma emulation runs when
    asked for by name: True is S and P.V, 1 S alone)."""
    from mla import mma as MM

    if not MM.SIMULATOR:
        pytest.skip("the simulator's default; a GPU's: the test above")
    assert MM.plan(2, 128, 64, 64, 256, "f16")["wgmma"] == 0
    assert MM.plan(2, 128, 64, 64, 256, "f16", wgmma=True)["wgmma"] == 2
    assert MM.plan(2, 128, 64, 64, 256, "f16", wgmma=1)["wgmma"] == 1


def _inputs(kind, rank, heads, lens, cap, seed):
    from attention.core.device import BFLOAT16

    rng = np.random.default_rng(seed)
    d_rope, n_b = 64, len(lens)
    dt = np.float16 if kind == "f16" else BFLOAT16
    qc = rng.standard_normal((n_b, heads, rank + d_rope)).astype(np.float32)
    lat = rng.standard_normal((n_b, cap, rank + d_rope)).astype(np.float32).astype(dt)
    return qc, lat, np.asarray(lens, np.int32), dt


@functools.lru_cache(maxsize=None)
def _run(kind, rank, heads, lens, cap, n_split, seed, level, defect):
    """(o_lat, lse) of the kernel at wgmma ``level`` (RG 4) over ``_inputs``'
    cache; cached, so the defect tests share their clean mma.sync run."""
    from attention.core.device import device_empty, to_device
    from mla import mma as MM

    qc, lat, lens_a, _ = _inputs(kind, rank, heads, lens, cap, seed)
    n_b = len(lens)
    table = np.arange(n_b, dtype=np.int32)[:, None]
    pl = MM.plan(n_b, heads, rank, 64, cap, kind, n_split=n_split, row_groups=4,
                 wgmma=level, defect=defect)
    o = device_empty((n_b, heads, rank), np.float32)
    lse = device_empty((n_b, heads), np.float32)
    pa, pm = MM.scratch(pl, n_b, heads)
    MM.launch(pl, to_device(qc), to_device(lat), to_device(lens_a), to_device(table), heads,
              0.07, o, lse, pa, pm, 0)
    return o.copy_to_host(), lse.copy_to_host()


def _both(kind, rank, heads, lens, cap, n_split, seed=3, defect=None, level=2):
    """o_lat and lse of the mma.sync and the wgmma (``level``) kernels (RG 4) over
    one random contiguous 16-bit cache, and the inputs; ``defect`` planted in the
    wgmma one."""
    lens = tuple(int(n) for n in lens)
    outs = [_run(kind, rank, heads, lens, cap, n_split, seed, 0, None),
            _run(kind, rank, heads, lens, cap, n_split, seed, level, defect)]
    qc, lat, lens_a, dt = _inputs(kind, rank, heads, lens, cap, seed)
    return outs, qc, lat, lens_a, dt


@pytest.mark.device
@pytest.mark.parametrize("kind,level", [("f16", 1), ("f16", 2)])
def test_wgmma_kernel_gives_the_mma_sync_bits_on_the_simulator(kind, level):
    """Rank 64 (W 128: two column blocks, so the block offsets count; P.V's
    quarters of 16 columns start inside a block's rows), 2 heads (rows 2 .. 63
    of the row block padded), lengths 70 and 5 (two tiles, a partial one), one
    split. Only on the simulator: there both forms sum a k step by the same
    rule. (bf16 moves the same bytes; its bits against mma.sync's are the GPU
    test's.)"""
    from attention.core.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the bits are compared on the simulator (its wgmma is mma.sync's rule); "
                    "the GPU test below compares the GPU's two forms")
    (o0, l0), (o1, l1) = _both(kind, 64, 2, [70, 5], 72, 1, level=level)[0]
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(l1, l0)
    assert np.isfinite(o1).all() and np.abs(o1).max() > 0


@pytest.mark.device
@pytest.mark.parametrize("defect,rank", [("swizzle_off_by_one", 64), ("ldmatrix_no_trans", 64),
                                         ("v_block_stride", 128)])
def test_planted_defects_change_the_wgmma_kernel_bits(defect, rank):
    """Positive controls of the test above (S and P.V on wgmma): the latent
    tiles stored with the next row's swizzle, which the wgmma, reading through
    the 128-byte swizzle of its descriptors, must see; V read K-major (trans-b
    0); V's column-block offset and LBO dropped (rank 128: quarters of 32
    columns, so the quarters past the first start in a second column block for
    it to lose)."""
    from attention.core.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the bits are compared on the simulator")
    (o0, l0), (o1, l1) = _both("f16", rank, 2, [70, 5], 72, 1, defect=defect)[0]
    assert not (np.array_equal(o1, o0) and np.array_equal(l1, l0))


@pytest.mark.compile
@pytest.mark.parametrize("kind,level", [("f16", 1), ("bf16", 1), ("f16", 2), ("bf16", 2)])
def test_kernel_compiles_to_wgmma_for_sm_90a(kind, level):
    """36 wgmma m64n16k16 a tile (9 column blocks of 4 k steps) in place of S's
    mma.sync and ldmatrix; P.V: its 64 mma.sync (level 1) or 4 wgmma m64n128k16
    (level 2, no mma.sync left); the async-proxy fence (twice at level 2); no
    local memory; ptxas for sm_90a spills nothing at 128 registers (RG 4)."""
    from numba import cuda

    from mla import mma as MM
    from tests.test_mla_mma import _signature
    from tests.test_prefill_mma import _ptxas_report, spill_bytes

    kern = MM.mla_mma_kernel(kind, 512, 64, 4, 64, False, None, None, None, level)
    ptx, _ = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0, "a"), fastmath=True,
                              launch_bounds=(512,))
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16") == 36
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16") == (4 if level == 2 else 0)
    assert ptx.count("mma.sync.aligned.m16n8k16") == (64 if level == 1 else 0)
    assert ptx.count("fence.proxy.async.shared::cta") == level
    assert ".local" not in ptx and "ld.local" not in ptx
    report = _ptxas_report(ptx, "sm_90a")
    if report is None:
        pytest.skip("no ptxas report: cuda.core (nvJitLink) is not installed")
    assert spill_bytes(report) == 0, report


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the full shape on a GPU (wgmma needs sm_90a)")
@pytest.mark.parametrize("kind,level,rank", [("f16", 1, 512), ("bf16", 1, 512),
                                             ("f16", 2, 512), ("bf16", 2, 512),
                                             ("f16", 2, 64)])
def test_wgmma_kernel_matches_the_mma_sync_kernel(kind, level, rank):
    """B 3 / 64 heads (one RG 4 row block) / lengths 300, 64 and 1, two splits,
    rank 512 (and 64: P.V's quarters start inside a block's rows): the wgmma
    kernel against the mma.sync one, and both against the float64 oracle (q
    rounded to the cache type as the kernels round it)."""
    ((o0, l0), (o1, l1)), qc, lat, lens, dt = _both(kind, rank, 64, [300, 64, 1], 320, 2,
                                                    level=level)
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


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the full shape on a GPU (wgmma needs sm_90a)")
@pytest.mark.parametrize("defect", ["swizzle_off_by_one", "ldmatrix_no_trans", "v_block_stride"])
def test_planted_defects_change_the_wgmma_kernel_on_the_gpu(defect):
    """The simulator's positive controls on the GPU, at rank 512 (S and P.V on
    wgmma): each planted switch changes the output."""
    (o0, l0), (o1, l1) = _both("f16", 512, 64, [300, 64, 1], 320, 2, defect=defect)[0]
    assert not (np.array_equal(o1, o0) and np.array_equal(l1, l0))


# ---------------------------------------------------------------------------
# error growth over decode steps of the 16-bit tensor-core MLA
# ---------------------------------------------------------------------------

def test_mla_mma_growth_run_is_registered_and_float16_only():
    from validation import growth

    assert "mla_mma_decode" in growth.GROWTH_KERNELS
    assert growth.REGISTRY_KERNEL["mla_mma_decode"] == "mla_mma"
    assert growth.MLA_GPU_HEADS["mla_mma_decode"] > 32  # RG 4 on a GPU (the wgmma plan)
    rec = growth.run_growth(growth.GrowthJob("mla_mma_decode", "float32", 0, 2, True))
    assert rec["status"] == "unsupported" and "float16 latent cache" in rec["detail"], rec


@pytest.mark.device
def test_mla_mma_growth_run_passes_and_a_planted_defect_fails_it(monkeypatch):
    """Three steps on the simulator (1024 on a GPU): every step within the rule,
    the cache rows the appended ones, NaN past the last. The control: the same
    run with V read without its transpose (``ldmatrix_no_trans``) fails."""
    import mla.pipeline
    from validation import growth

    rec = growth.run_growth(growth.GrowthJob("mla_mma_decode", "float16", 0, 3, True))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["cache_ok"] and len(rec["series"]["step"]) == 3
    monkeypatch.setattr(mla.pipeline, "mla_decode",
                        functools.partial(mla.pipeline.mla_decode, defect="ldmatrix_no_trans"))
    bad = growth.run_growth(growth.GrowthJob("mla_mma_decode", "float16", 0, 3, True))
    assert bad["status"] == "fail", bad
