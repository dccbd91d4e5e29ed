"""Tensor-core decode (``attention.decode.mma``): 16-bit caches, the GQA group's
heads x the T queries as one 16-row mma tile.

The kernel's arithmetic is not the fp32 decode's: S = q.k accumulates in fp32
on the mma (16-bit inputs, exact products), the softmax is fp32 and P is
rounded to the cache's 16-bit type before P.V. So its baseline is a float32
numpy decode with the same roundings (``validation.baselines.decode_rounded_p``:
P rounded to the cache dtype, ``l`` the sum of the unrounded P), judged with the oracle on the same
16-bit inputs (``attention.oracle``, float64). An output passes when NaN and
inf sit where the oracle has them and

    max|kernel - oracle| <= 2 * max|baseline - oracle| + floor,

floor = 2 float32 ulps of max|oracle| (``validation.tolerance.floor``), for out
and for lse. Checked here:

* on the simulator (``device``) and on a GPU: pooled caches with a permuted
  slot table and NaN in every row past a length, paged HND (P 16, and P 5:
  not a power of two, a page entry a row) and NHD (P 32: two tiles a page)
  caches with shuffled pages, a shared prefix page
  and NaN in unused pages and tails; T_q 1, 2 and 4 with GQA group 4 (T_q 4:
  the 16 rows of a tile), lengths 0, shorter than a tile, on a tile edge and
  across splits; one split and several (the combine); warps whose tiles wrap
  around their ring; head dims 32 and 64; fp16 and bf16 (the kernel reads the
  caches as uint32 words, so bf16 runs on the simulator too); rows that
  attend nothing give zeros and LSE -inf, never NaN;
* the planted defects (``mma.DEFECTS``) each fail the same rule on a case the
  clean kernel passes (the positive controls): V fragments loaded without
  ``.trans``, a K tile stored with the next row's swizzle, the causal limit
  one position long at a tile edge;
* host checks: errors name the argument and the expected shape or range;
* compile-only: the kernels compile for sm_90 to ``mma.sync...m16n8k16``,
  ``ldmatrix`` (x4 and x2.trans) and ``cp.async`` with no local memory;
* on a GPU (``gpu``): B 32, H 32, H_kv 8, D 128, L 4096, T_q 1 and 4, fp16 and
  bf16, against the oracle.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from attention.core import checks
from attention.core.device import BFLOAT16
from attention.decode import mma
from tests.test_decode_paged import paged_case
from validation.baselines import decode_rounded_p as baseline
from validation.suite_mma import pooled_cache

F16 = np.dtype(np.float16)


# ---------------------------------------------------------------------------
# the baseline and the rule
# ---------------------------------------------------------------------------

def errors(got, ref, base):
    """(kernel's max error, the max rule's bound, same non-finite placement)."""
    from validation.tolerance import budget, max_abs_error, same_nonfinite

    return max_abs_error(got, ref), budget(ref, base), same_nonfinite(got, ref)


def judge(got, ref, base, what):
    for name, g, r, b in zip(("out", "lse"), got, ref, base):
        err, bound, placed = errors(g, r, b)
        assert placed, f"{what} {name}: NaN / inf placement differs from the oracle"
        assert err <= bound, f"{what} {name}: max err {err:.3e} > bound {bound:.3e}"


def fails(got, ref, base):
    """True where the rule rejects ``got`` (out or lse)."""
    for g, r, b in zip(got, ref, base):
        err, bound, placed = errors(g, r, b)
        if not placed or err > bound:
            return True
    return False


def oracle(q, k_rows, v_rows, lens, scale):
    from attention.oracle import decode_attention_multi_ref

    return decode_attention_multi_ref(q, k_rows, v_rows, lens, scale=scale)


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------

def pooled_case(rng, lens, n_kv, head_dim, dtype, cap=None, spare=1):
    """A pooled cache [M + spare, H_kv, cap, D] in a permuted slot order (the
    spare slots and every row past a length: NaN), and (slots [M], k_rows,
    v_rows [M, H_kv, cap, D]: the rows in sequence order)."""
    k, v, slots = pooled_cache(rng, lens, n_kv, head_dim, dtype, spare, cap)
    return k, v, slots, k[slots], v[slots]


def gathered(pages, table, lens, layout):
    """The rows of a paged cache in sequence order, [M, H_kv, max len, D] (zeros past a length)."""
    from attention.oracle import paged_rows

    n_kv = pages.shape[1] if layout == "HND" else pages.shape[2]
    rows = np.zeros((len(lens), n_kv, max(list(lens) + [1]), pages.shape[3]), pages.dtype)
    for m, n in enumerate(lens):
        rows[m, :, :n] = paged_rows(pages, table, m, n, layout)
    return rows


def queries(rng, m_count, t_q, n_heads, head_dim, dtype):
    return rng.standard_normal((m_count, t_q, n_heads, head_dim)).astype(dtype)


def run(q, k, v, lens, **kw):
    out, lse = mma.mma_decode(q, k, v, np.asarray(lens, np.int32), **kw)
    return np.asarray(out), np.asarray(lse)


def check_case(q, k_rows, v_rows, lens, got, dtype, what):
    scale = 1.0 / np.sqrt(q.shape[3])
    ref = oracle(q, k_rows, v_rows, lens, scale)
    base = baseline(q, k_rows, v_rows, lens, scale, dtype, norm="recip_after")
    judge(got, ref, base, what)
    for m, n in enumerate(lens):
        if n == 0:  # nothing to attend: zeros and -inf
            assert np.all(got[0][m] == 0) and np.all(got[1][m] == -np.inf), what
    assert not np.isnan(got[0]).any(), what


# ---------------------------------------------------------------------------
# against the oracle (simulator and GPU)
# ---------------------------------------------------------------------------

POOLED = [
    # (t_q, group, n_kv, lens, n_split, warps, stages, head_dim)
    # T_q 1, group 4 (4 rows), two kv heads, length 0, a part tile, one warp
    # whose three tiles wrap around its two-stage ring
    (1, 4, 2, [0, 5, 37], 1, 1, 2, 32),
    # T_q 4 x group 4 = 16 rows; two splits of one warp's tile each: query 0 of
    # the length-19 sequence ends on the tile edge at 16, the second split
    # holds only positions 16 .. 18, length 4 (= T) leaves the second split empty
    (4, 4, 1, [19, 4, 0], 2, 1, 2, 32),
    # head dim 64, the default warps and ring (the GPU's tile plan), 5 tiles
    (4, 4, 1, [70], None, mma.WARPS, mma.STAGES, 64),
]


@pytest.mark.device
@pytest.mark.parametrize("t_q,group,n_kv,lens,n_split,warps,stages,head_dim", POOLED,
                         ids=["t1-g4", "t4-g4-split2", "d64-default"])
def test_pooled_matches_the_oracle(t_q, group, n_kv, lens, n_split, warps, stages, head_dim):
    rng = np.random.default_rng(len(lens) + 10 * t_q + head_dim)
    k, v, slots, k_rows, v_rows = pooled_case(rng, lens, n_kv, head_dim, F16)
    q = queries(rng, len(lens), t_q, group * n_kv, head_dim, F16)
    got = run(q, k, v, lens, slot_table=slots, n_split=n_split, warps=warps, stages=stages)
    if n_split is not None:
        assert mma.plan(len(lens), group * n_kv, n_kv, head_dim, max(lens), "f16",
                        t_q=t_q, n_split=n_split, warps=warps)["n_split"] == n_split
    check_case(q, k_rows, v_rows, lens, got, F16, f"pooled T={t_q} G={group}")


PAGED = [
    # (layout, page, t_q, group, n_kv, lens, n_split)
    # pages of whole tiles (P a multiple of 16): one page entry a tile
    ("HND", 16, 4, 4, 1, [35, 17], 1),
    ("NHD", 32, 2, 4, 2, [40, 9], 1),
    # P 5: a page entry a row, pages crossing tiles and splits
    ("HND", 5, 1, 2, 2, [13, 37, 0], 2),
]


@pytest.mark.device
@pytest.mark.parametrize("layout,page,t_q,group,n_kv,lens,n_split", PAGED,
                         ids=["hnd-p16-t4", "nhd-p32-t2", "hnd-p5-t1-split2"])
def test_paged_matches_the_oracle(layout, page, t_q, group, n_kv, lens, n_split):
    rng = np.random.default_rng(page + t_q)
    head_dim = 32
    k, v, table = paged_case(rng, lens, page, n_kv, head_dim, F16, layout)
    q = queries(rng, len(lens), t_q, group * n_kv, head_dim, F16)
    got = run(q, k, v, lens, page_table=table, layout=layout, n_split=n_split, warps=2,
              stages=2)
    k_rows, v_rows = gathered(k, table, lens, layout), gathered(v, table, lens, layout)
    check_case(q, k_rows, v_rows, lens, got, F16, f"{layout} P={page} T={t_q}")


@pytest.mark.device
def test_bfloat16_device_arrays_match_the_oracle():
    """bf16 (P rounded to bf16: the baseline rounds it the same way), inputs
    already on the device and output buffers given, filled with NaN first (an
    element left unwritten shows)."""
    from attention.core.device import to_device, to_host

    rng = np.random.default_rng(3)
    lens = [21, 2]
    k, v, slots, k_rows, v_rows = pooled_case(rng, lens, 1, 32, BFLOAT16)
    q = queries(rng, 2, 2, 4, 32, BFLOAT16)
    d_out = to_device(np.full(q.shape, np.nan, np.float32))
    d_lse = to_device(np.full(q.shape[:3], np.nan, np.float32))
    d_q, d_k, d_v = (to_device(x.view(np.uint16)).view(BFLOAT16) for x in (q, k, v))
    got = mma.mma_decode(d_q, d_k, d_v, to_device(np.asarray(lens, np.int32)),
                         to_device(slots), out=d_out, lse=d_lse, warps=2, stages=2)
    assert got[0] is d_out and got[1] is d_lse
    got = (np.asarray(to_host(d_out)), np.asarray(to_host(d_lse)))
    check_case(q, k_rows, v_rows, lens, got, BFLOAT16, "bf16 T=2")


# ---------------------------------------------------------------------------
# planted defects: each caught by the same rule, the clean kernel passes
# ---------------------------------------------------------------------------

_DEFECT_RUNS = {}


def defect_case():
    """T_q 4 x group 4, one sequence of length 19 (query 0 ends on the tile edge
    at 16) and one of length 4: (q, k, v, slots, k_rows, v_rows, lens, ref, base)."""
    if "case" not in _DEFECT_RUNS:
        rng = np.random.default_rng(11)
        lens = [19, 4]
        k, v, slots, k_rows, v_rows = pooled_case(rng, lens, 1, 32, F16)
        q = queries(rng, 2, 4, 4, 32, F16)
        scale = 1.0 / np.sqrt(32)
        _DEFECT_RUNS["case"] = (q, k, v, slots, lens, oracle(q, k_rows, v_rows, lens, scale),
                                baseline(q, k_rows, v_rows, lens, scale, F16,
                                         norm="recip_after"))
    return _DEFECT_RUNS["case"]


def defect_run(defect):
    q, k, v, slots, lens, ref, base = defect_case()
    return run(q, k, v, lens, slot_table=slots, warps=1, stages=2, defect=defect), ref, base


@pytest.mark.device
def test_clean_kernel_passes_the_defect_case():
    got, ref, base = defect_run(None)
    judge(got, ref, base, "clean kernel on the defect case")


@pytest.mark.device
@pytest.mark.parametrize("defect", mma.DEFECTS)
def test_planted_defect_is_caught(defect):
    got, ref, base = defect_run(defect)
    assert fails(got, ref, base), f"{defect}: passed the rule"


@pytest.mark.device
def test_p_bf16_mutant_is_caught_on_f16_and_inert_on_bf16():
    """The precision mutant (P rounded to bf16's 8 bits where the kernel and
    its baseline round to f16's 11) fails the rule on the f16 defect case; on
    a bf16 cache P is packed to bf16 anyway, so the mutant's bits are the
    clean kernel's."""
    got, ref, base = defect_run("p_bf16")
    assert fails(got, ref, base), "p_bf16: passed the rule on an f16 cache"
    rng = np.random.default_rng(3)
    lens = [21, 9]
    k, v, slots, _, _ = pooled_case(rng, lens, 1, 32, BFLOAT16)
    q = queries(rng, 2, 1, 4, 32, BFLOAT16)
    clean = run(q, k, v, lens, slot_table=slots, warps=1, stages=2)
    mutant = run(q, k, v, lens, slot_table=slots, warps=1, stages=2, defect="p_bf16")
    for c, m in zip(clean, mutant):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(m))


# ---------------------------------------------------------------------------
# host checks (no kernel runs)
# ---------------------------------------------------------------------------

def _small(t_q=1, group=4, n_kv=1, head_dim=32, cap=8, m_count=2, dtype=F16):
    q = np.zeros((m_count, t_q, group * n_kv, head_dim), dtype)
    k = np.zeros((m_count, n_kv, cap, head_dim), dtype)
    return q, k, k.copy()


def test_bad_inputs_are_named():
    q, k, v = _small()
    lens = np.array([3, 4], np.int32)
    with pytest.raises(checks.RangeError, match="k_cache: expected head_dim"):
        mma.mma_decode(*_small(head_dim=48), lens)
    with pytest.raises(checks.RangeError, match="q: the GQA group"):
        mma.mma_decode(*_small(t_q=8, group=4, cap=16), np.array([8, 9], np.int32))
    with pytest.raises(checks.DTypeError, match="q: expected dtype float16"):
        mma.mma_decode(q.astype(np.float32), k, v, lens)
    with pytest.raises(checks.DTypeError, match="k_cache: expected dtype"):
        mma.mma_decode(q, k.astype(np.float32), v, lens)
    with pytest.raises(checks.ShapeError, match=r"v_cache: expected shape \[KV_SLOTS=2"):
        mma.mma_decode(q, k, v[:, :, :4], lens)
    with pytest.raises(checks.RangeError, match="seq_lens: expected lengths in"):
        mma.mma_decode(q, k, v, np.array([3, 9], np.int32))
    with pytest.raises(checks.RangeError, match="seq_lens: sequence 1 has length 2"):
        mma.mma_decode(*_small(t_q=4), np.array([4, 2], np.int32))
    with pytest.raises(checks.ShapeError, match="t_q: q holds T=1"):
        mma.mma_decode(q, k, v, lens, t_q=4)
    with pytest.raises(checks.RangeError, match="slot_table: expected slots"):
        mma.mma_decode(q, k, v, lens, slot_table=np.array([0, 2], np.int32))
    pages = np.zeros((3, 1, 4, 32), F16)
    with pytest.raises(checks.AttentionInputError, match="slot_table: a paged call"):
        mma.mma_decode(q, pages, pages, lens, np.array([0, 1]),
                       page_table=np.zeros((2, 2), np.int32))
    with pytest.raises(checks.RangeError, match="page_table: sequence 1 names page 3"):
        mma.mma_decode(q, pages, pages, np.array([3, 5], np.int32),
                       page_table=np.array([[0, 7], [1, 3]], np.int32))
    with pytest.raises(checks.ShapeError, match=r"page_table: expected shape \[M=2"):
        mma.mma_decode(q, pages, pages, lens, page_table=np.zeros((3, 2), np.int32))
    with pytest.raises(checks.LayoutError, match="layout: expected 'HND'"):
        mma.mma_decode(q, pages, pages, lens, page_table=np.zeros((2, 2), np.int32),
                       layout="DHN")


def test_plan_chunks_are_whole_rounds_of_warp_tiles():
    pl = mma.plan(3, 8, 2, 64, 1000, "f16", n_split=3, warps=4)
    assert pl["chunk"] % (16 * 4) == 0 and pl["chunk"] * pl["n_split"] >= 1000
    assert pl["grid"] == (pl["n_split"], 2, 3) and pl["block"] == 128
    assert mma.plan(3, 8, 2, 64, 0, "f16")["n_split"] == 1


# ---------------------------------------------------------------------------
# compile-only: PTX
# ---------------------------------------------------------------------------

def _signature():
    from numba import types

    u32, i32, f32 = types.uint32, types.int32, types.float32
    arr = types.Array
    return (arr(u32, 4, "C"), arr(u32, 1, "C"), arr(u32, 1, "C"), arr(i32, 1, "C"),
            arr(i32, 2, "C"), i32, i32, i32, i32, f32, i32, arr(f32, 4, "C"),
            arr(f32, 3, "C"), arr(f32, 4, "C"), arr(f32, 4, "C"))


@functools.lru_cache(maxsize=None)
def _ptx(kind, head_dim, group, t_q, paging, defect=None, pdl=False):
    from numba import cuda

    kern = mma.mma_decode_kernel(kind, head_dim, group, t_q, mma.WARPS, mma.STAGES, paging,
                                 defect, pdl=pdl)
    ptx, _ = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0))
    return ptx


@pytest.mark.compile
@pytest.mark.parametrize("kind,head_dim,group,t_q,paging", [
    ("f16", 128, 4, 4, None), ("bf16", 128, 4, 1, "NHD"), ("f16", 64, 2, 4, "HND")])
def test_compiles_to_mma_ldmatrix_and_cp_async_without_local_memory(kind, head_dim, group,
                                                                       t_q, paging):
    ptx = _ptx(kind, head_dim, group, t_q, paging)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx
    # Q and K fragments (one x4 a k step), V fragments (one x4.trans two n tiles)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * (head_dim // 16)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == head_dim // 16
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group 2" in ptx
    assert ".local" not in ptx and "ld.local" not in ptx
    assert "griddepcontrol" not in ptx  # no programmatic dependent launch unless asked
    # per tile: D/16 * 2 mma for S, D/8 for P V, each once in the unrolled loop body
    assert ptx.count("mma.sync.aligned.m16n8k16") == head_dim // 8 + head_dim // 8


@pytest.mark.compile
def test_no_trans_defect_loads_v_without_trans():
    """The planted switch acts in the PTX (the others act in the simulator tests)."""
    ptx = _ptx("f16", 128, 4, 4, None, "ldmatrix_no_trans")
    assert ".trans.shared" not in ptx
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 3 * (128 // 16)
    assert ".local" not in ptx


@pytest.mark.compile
def test_pdl_kernel_releases_the_combine_before_any_load():
    """With ``pdl`` every block releases its dependents (the combine) before it
    reads anything, and never waits itself (it is the primary); without it there
    is no grid-dependency instruction at all (checked with the plain kernel's PTX in
    ``test_compiles_to_mma_ldmatrix_and_cp_async_without_local_memory``)."""
    with_pdl = _ptx("f16", 128, 4, 4, None, pdl=True)
    body = with_pdl[with_pdl.index("{", with_pdl.index(".entry")):]
    release = body.index("griddepcontrol.launch_dependents")
    assert release < body.index("ld.global")
    assert "griddepcontrol.wait" not in with_pdl


def test_pdl_defaults_off_where_it_cannot_run():
    """The default follows ``attention.core.pdl.capable()``: off on the simulator
    and with no GPU (the plan says so), and one split never needs it."""
    from attention.core.pdl import capable

    pl = mma.plan(1, 32, 8, 128, 32768, "f16")
    assert pl["n_split"] > 1
    assert pl["pdl"] is capable()
    assert mma.plan(1, 32, 8, 128, 32768, "f16", n_split=1)["pdl"] is False
    assert mma.plan(1, 32, 8, 128, 32768, "f16", pdl=False)["pdl"] is False
    assert "_pdl" in mma.plan(1, 32, 8, 128, 32768, "f16", pdl=True)["kernel"].__name__


# ---------------------------------------------------------------------------
# GPU: the full shape
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f16", "f8"])
def test_gpu_pdl_combine_gives_the_same_bits(kind):
    """B 1 / L 16384 (a split plan): out and LSE are the same bits whether the
    combine is a programmatic dependent of the main kernel or launched plainly."""
    from attention.core.pdl import capable

    if not capable():
        pytest.skip("programmatic dependent launch needs sm_90 and a cuda.core that asks "
                    "for it (attention.core.pdl.off_reason)")
    rng = np.random.default_rng(77)
    h, n_kv, d, cap = 32, 8, 128, 16384
    if kind == "f8":
        k = rng.integers(0, 0x7F, (1, n_kv, cap, d), dtype=np.uint8)
        v = rng.integers(0, 0x7F, (1, n_kv, cap, d), dtype=np.uint8)
        scales = dict(k_scale=0.01, v_scale=0.02)
    else:
        k = rng.standard_normal((1, n_kv, cap, d), np.float32).astype(F16)
        v = rng.standard_normal((1, n_kv, cap, d), np.float32).astype(F16)
        scales = {}
    q = queries(rng, 1, 1, h, d, F16)
    lens = np.array([cap], np.int32)
    assert mma.plan(1, h, n_kv, d, cap, mma.FP8_KIND if kind == "f8" else "f16")["pdl"]
    (o1, l1), (o0, l0) = (run(q, k, v, lens, pdl=pdl, **scales) for pdl in (True, False))
    assert np.array_equal(o1, o0) and np.array_equal(l1, l0)


@pytest.mark.gpu
@pytest.mark.parametrize("t_q", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_full_shape_matches_the_oracle(t_q, dtype):
    """B 32, H 32, H_kv 8, D 128, L 4096 (lengths from T_q to L, one 0), pooled."""
    dt = F16 if dtype == "float16" else BFLOAT16
    rng = np.random.default_rng(40 + t_q)
    b, h, n_kv, d, cap = 32, 32, 8, 128, 4096
    lens = rng.integers(t_q, cap + 1, b)
    lens[0], lens[1] = cap, 0
    k = rng.standard_normal((b, n_kv, cap, d), np.float32).astype(dt)
    v = rng.standard_normal((b, n_kv, cap, d), np.float32).astype(dt)
    q = queries(rng, b, t_q, h, d, dt)
    got = run(q, k, v, lens)
    check_case(q, k, v, list(lens), got, dt, f"full shape T={t_q} {dtype}")
