"""Paged latent cache for MLA decode (``mla.paged``): ``mla_decode(...,
page_table=)``, ``MLADecodeGraph(..., page_table=)``, ``paged_append_latent``.

The contract: a paged cache ``[num_pages, P, r + d_rope]`` read through a page
table ``[B, max_pages]`` gives, for every method, the bits of the contiguous
cache ``[B, max_seq, r + d_rope]`` holding the same rows (same kernels, same
sums; only the row addressing differs).

Hostile fixtures (``paged_case``): pages handed out in a shuffled order (the
test asserts the table is not the identity), every non-empty sequence's first
page shared with the longest one (a read-only common prefix), spare pages and
the tail of each last page NaN, table entries past a sequence's pages
2**31 - 1, lengths 0, 1, P, P + 1 and the capacity 2P in one batch. A read of
a row or entry it must not touch gives NaN or a fault.

* plain process: bad input raised before any copy or launch (the error names
  the argument); compile-only PTX of the paged kernels;
* simulator / GPU (``device``): bit equality with the contiguous cache over a
  covering set of page sizes (1, 3, 16, 64) x methods x cache dtypes, and the
  float64 oracle (``mla.oracle.mla_decode_paged_ref``, ``parity``'s tolerance);
  the tensor-core GEMMs' own page look-ups (tiles inside one page and across
  pages); the captured decode reading cache and table in place; a device table
  checked on the device; the append's canary (every other byte unchanged); the
  planted defects caught;
* GPU (``gpu``): DeepSeek-V3 widths, 128 heads, page 64, every method.

Simulator time of this file: about 40-50 s on the 2-core CI machine (the GEMM
path costs 1-2 s a decode there, the tensor-core one about 3 s at 16 heads).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla.dims import DEEPSEEK_V3, MlaDims
from mla.oracle import mla_decode_paged_ref, paged_rows_ref
from mla.paged import DEFAULT_PAGE_SIZE, pages_needed
from tests.conftest import MODE, small
from validation.fixtures import MLA_HUGE_ENTRY as HUGE
from validation.fixtures import mla_append_case, mla_paged_case, mla_paged_hostile
from validation.fixtures import mla_build_pages as build_pages
from validation.suite_mla import parity
SIM_TILE = 8 if small() else None  # flash tiles of 8 rows: pages of 16 / 64 hold whole tiles
DIMS = MlaDims(n_head=2, d_nope=8, d_rope=4, d_v=8, kv_rank=12)  # rows of 16 words


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------

def paged_case(page_size, dtype=np.float32, *, dims=DIMS, lengths=None, seed=0, s_q=None):
    """``validation.fixtures.mla_paged_case`` at the tests' small dims by default."""
    return mla_paged_case(page_size, dtype, dims=dims, lengths=lengths, seed=seed, s_q=s_q)


def decode(c, paged, **kw):
    from mla.pipeline import mla_decode

    if paged:
        kw.setdefault("page_table", c["table"])
    cache = c["pages"] if paged else c["cont"]
    return mla_decode(c["q_nope"], c["q_pe"], cache, c["lengths"], c["w_uk"], c["w_uv"], **kw)


def assert_hostile(c):
    """The fixture really is hostile: shuffled, shared, NaN-padded, huge entries."""
    why = mla_paged_hostile(c)
    assert why is None, why


def assert_oracle(got, c, label):
    """Each sequence against the float64 oracles (``parity``'s tolerance), and
    the paged oracle (rows gathered, then the contiguous oracle)."""
    r = c["dims"].kv_rank
    ref = mla_decode_paged_ref(c["q_nope"], c["q_pe"], c["pages"].astype(np.float32),
                               c["table"], c["lengths"], c["w_uk"], c["w_uv"])
    for b, n in enumerate(c["lengths"]):
        if n == 0:
            assert not got[b].any(), f"{label}: empty sequence {b}: expected zeros"
            continue
        rows = paged_rows_ref(c["pages"], c["table"][b], n).astype(np.float32)
        np.testing.assert_array_equal(rows, c["cont"][b, :n].astype(np.float32))
        args = (c["q_nope"][b:b + 1], c["q_pe"][b:b + 1], rows[:, :r], rows[:, r:], c["w_uk"],
                c["w_uv"])
        p = parity(got[b:b + 1], args)
        assert p["ok"], (f"{label}: sequence {b} (length {n}): err {p['err_naive']:.3e} > "
                         f"tol {p['tol']:.3e}")
        assert np.abs(got[b] - ref[b]).max() <= p["tol"], f"{label}: sequence {b} vs paged oracle"


# ---------------------------------------------------------------------------
# bad input (plain process: raised before any copy or launch)
# ---------------------------------------------------------------------------

def _bad_decode(c, **kw):
    from mla.pipeline import mla_decode

    args = {"q_nope": c["q_nope"], "q_pe": c["q_pe"], "latent_cache": c["pages"],
            "lengths": c["lengths"], "w_uk": c["w_uk"], "w_uv": c["w_uv"],
            "page_table": c["table"]}
    args.update(kw)
    return mla_decode(**args)


@pytest.mark.parametrize("change,error,name", [
    (lambda c: {"page_table": c["table"].astype(np.int64)}, checks.DTypeError, "page_table"),
    (lambda c: {"page_table": c["table"][:-1]}, checks.ShapeError, "page_table"),
    (lambda c: {"page_table": c["table"][:, 0]}, checks.ShapeError, "page_table"),
    (lambda c: {"page_table": c["table"][:, :1]}, checks.RangeError, "page_table"),  # too short
    (lambda c: {"lengths": c["lengths"] + np.array([0, 0, 0, 0, 1])}, checks.RangeError,
     "page_table"),  # a length past the capacity
    (lambda c: {"lengths": c["lengths"] - np.array([1, 0, 0, 0, 0])}, checks.RangeError,
     "lengths"),
    (lambda c: {"latent_cache": c["pages"][:, :, :-1]}, checks.ShapeError, "latent_cache"),
    (lambda c: {"latent_cache": c["pages"][0]}, checks.ShapeError, "latent_cache"),
    (lambda c: {"latent_cache": c["pages"].astype(np.float64)}, checks.DTypeError,
     "latent_cache"),
    (lambda c: {"latent_cache": c["pages"][:, :0]}, checks.ShapeError, "latent_cache"),
])
def test_mla_decode_paged_bad_input(change, error, name):
    c = paged_case(3)
    with pytest.raises(error, match=name):
        _bad_decode(c, **change(c))


@pytest.mark.parametrize("entry", [-1, "num_pages", HUGE])
def test_host_table_entries_checked_where_used(entry):
    """An entry of a used page outside [0, num_pages) is refused before launch;
    the same value past a sequence's pages is never looked at (the fixture
    holds HUGE there, and the positive cases pass)."""
    c = paged_case(3)
    table = c["table"].copy()
    table[3, 1] = len(c["pages"]) if entry == "num_pages" else entry  # length P + 1: column 1 used
    with pytest.raises(checks.RangeError, match=r"page_table: sequence 3 column 1"):
        _bad_decode(c, page_table=table)


def test_paged_defects_and_graph_bad_input():
    from mla.decode_graph import MLADecodeGraph
    from mla.pipeline import mla_decode

    c = paged_case(3)
    with pytest.raises(ValueError, match="defect"):  # no page table: nothing paged to break
        mla_decode(c["q_nope"], c["q_pe"], c["cont"], c["lengths"], c["w_uk"], c["w_uv"],
                   defect="page_off_by_one")
    with pytest.raises(ValueError, match="defect"):
        _bad_decode(c, defect="append_page_off_by_one")
    args = (c["q_nope"], c["q_pe"], c["pages"], c["lengths"], c["w_uk"], c["w_uv"])
    with pytest.raises(checks.RangeError, match="page_table"):
        MLADecodeGraph(*args, page_table=c["table"][:, :1])
    with pytest.raises(checks.DTypeError, match="page_table"):
        MLADecodeGraph(*args, page_table=c["table"].astype(np.uint32))
    with pytest.raises(checks.ShapeError, match="latent_cache"):
        MLADecodeGraph(c["q_nope"], c["q_pe"], c["cont"][0], c["lengths"], c["w_uk"],
                       c["w_uv"], page_table=c["table"])


def _append_args(page_size=3, dtype=np.float16):
    rng = np.random.default_rng(5)
    cache = rng.standard_normal((6, page_size, 16)).astype(dtype)
    table = np.array([[4, 1, HUGE], [0, 2, HUGE]], np.int32)
    return {"new_rows": rng.standard_normal((2, 2, 16)).astype(dtype), "cache": cache,
            "page_table": table, "lengths": np.array([2, 4])}


@pytest.mark.parametrize("change,error,name", [
    (lambda a: {"new_rows": a["new_rows"][:, :, :-1]}, checks.ShapeError, "new_rows"),
    (lambda a: {"new_rows": a["new_rows"].astype(np.float32)}, checks.DTypeError, "new_rows"),
    (lambda a: {"new_rows": a["new_rows"][:, :0]}, checks.RangeError, "new_rows"),
    (lambda a: {"cache": a["cache"].astype(np.float64),
                "new_rows": a["new_rows"].astype(np.float64)}, checks.DTypeError, "cache"),
    (lambda a: {"page_table": a["page_table"][:, :1]}, checks.RangeError, "page_table"),
    (lambda a: {"page_table": a["page_table"].astype(np.int64)}, checks.DTypeError,
     "page_table"),
    (lambda a: {"page_table": np.array([[4, 9, 0], [0, 2, 0]], np.int32)}, checks.RangeError,
     "page_table: sequence 0 column 1 holds page 9"),
    # sequence 1 appends into page 1, row 1: where sequence 0 appends too
    (lambda a: {"page_table": np.array([[4, 1, HUGE], [0, 1, HUGE]], np.int32),
                "lengths": np.array([2, 3])}, checks.RangeError, "written twice"),
    (lambda a: {"lengths": np.array([2, -1])}, checks.RangeError, "lengths"),
    (lambda a: {"n_new": np.array([1, 3])}, checks.RangeError, "n_new"),
    (lambda a: {"n_new": np.array([1])}, checks.ShapeError, "n_new"),
    (lambda a: {"defect": "page_off_by_one"}, ValueError, "defect"),
])
def test_paged_append_bad_input(change, error, name):
    from mla.paged import paged_append_latent

    args = _append_args()
    args.update(change(args))
    before = np.array(args["cache"], copy=True)
    with pytest.raises(error, match=name):
        paged_append_latent(**args)
    np.testing.assert_array_equal(np.asarray(args["cache"]).view(np.uint8),
                                  before.view(np.uint8))


def test_defaults_and_exports():
    import mla

    assert DEFAULT_PAGE_SIZE == 64
    assert mla.paged_append_latent.__module__ == "mla.paged"
    assert pages_needed(0, 64) == 0 and pages_needed(65, 64) == 2


# ---------------------------------------------------------------------------
# compile-only (plain process, no GPU): the paged kernels' PTX
# ---------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("b_order", ["znk", "zkn"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compile_tgemm_paged(b_order, dtype):
    """The GPU plan at page 64 (tiles of 128 "znk" rows span two pages: rows
    looked up one by one; 32-row "zkn" slices lie in one page): no local
    memory, the same mmas and 16-byte copies as the contiguous kernel."""
    from numba import cuda, types

    from attention.gemm import tgemm
    from tests.test_mla_gemm import gemm_signature

    sig = list(gemm_signature(getattr(types, dtype)))
    sig[3] = types.Array(types.int32, 2, "C")  # zb: the page table [Z, max_pages]
    ptx, _ = cuda.compile_ptx(
        tgemm.tgemm_kernel(b_order, dtype == "float16", tgemm.GPU_PLAN, None, 64).py_func,
        tuple(sig), cc=(9, 0))
    assert ".local" not in ptx
    warps_m, warps_n, mt, nt = tgemm.GPU_PLAN[:4]
    assert ptx.count("mma.sync.aligned.m16n8k8") == (2 if dtype == "float16" else 3) * mt * nt
    assert "cp.async.cg.shared.global" in ptx and "paged64" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("page_size", [64, 3])
def test_compile_flash_paged(page_size):
    from numba import cuda, types

    from mla import kernels as K

    d = DEEPSEEK_V3
    tile, hg = K.plan_blocks(d.n_head, d.latent_width)
    f32, i32 = types.float32, types.int32

    def arr(t, n):
        return types.Array(t, n, "C")

    ptx, _ = cuda.compile_ptx(
        K.attn_absorbed_kernel(d.kv_rank, d.d_rope, tile, hg, None, page_size).py_func,
        (arr(f32, 3), arr(f32, 3), arr(types.float16, 3), arr(i32, 2), arr(i32, 1),
         arr(i32, 1), f32, arr(f32, 3), arr(f32, 2)), cc=(9, 0))
    assert ".local" not in ptx and "shfl.sync.bfly.b32" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compile_paged_copies_are_bit_exact(dtype):
    """The append and the gather move elements without arithmetic."""
    from numba import cuda, types

    from mla import paged as PG

    dt, i32 = getattr(types, dtype), types.int32

    def arr(t, n):
        return types.Array(t, n, "C")

    for fn, sig in ((PG.paged_append_kernel().py_func,
                     (arr(dt, 3), arr(dt, 3), arr(i32, 2), arr(i32, 1), arr(i32, 1))),
                    (PG.paged_append_kernel(checked=True).py_func,
                     (arr(dt, 3), arr(dt, 3), arr(i32, 2), arr(i32, 1), arr(i32, 1),
                      arr(i32, 1))),
                    (PG.gather_rows_kernel(64).py_func,
                     (arr(dt, 3), arr(i32, 2), arr(i32, 1), arr(dt, 3)))):
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".entry" in ptx
        assert "cvt.f32.f16" not in ptx and "cvt.rn.f16.f32" not in ptx


# ---------------------------------------------------------------------------
# device (simulator at these shapes, or a GPU)
# ---------------------------------------------------------------------------

# a covering set: every page size, method and cache dtype, every kernel's
# look-up (flash: pages of 1 and 3 split the 8-row tiles, 16 and 64 hold
# them; the GEMM path at 2 heads gathers rows for sgemm)
COVER = [(1, "auto", "float32"), (1, "flash", "float32"), (3, "flash", "float16"),
         (3, "gemm", "float32"), (16, "flash", "float32"), (16, "gemm_fma", "float16"),
         (64, "gemm", "float16"), (64, "flash", "float32")]


@pytest.mark.device
@pytest.mark.parametrize("page_size,method,dtype", COVER,
                         ids=[f"P{p}-{m}-{d}" for p, m, d in COVER])
def test_paged_decode_bit_equal_to_contiguous(page_size, method, dtype):
    c = paged_case(page_size, np.dtype(dtype), seed=page_size)
    assert_hostile(c)
    tile = SIM_TILE if method == "flash" else None
    want = decode(c, False, method=method, tile=tile)
    got = decode(c, True, method=method, tile=tile)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
    assert_oracle(got, c, f"P {page_size} {method} {dtype}")


@pytest.mark.device
def test_flash_tiles_inside_and_across_pages():
    """Pages of 1.5 flash tiles: tiles inside one page (one look-up, found at
    run time) alternate with tiles across two (rows looked up one by one)."""
    from mla import kernels as K

    tile = SIM_TILE or K.plan_blocks(DIMS.n_head, DIMS.latent_width)[0]
    page_size = 3 * tile // 2
    c = paged_case(page_size, lengths=[4 * tile + 1, 0, 1, page_size + 1], seed=12)
    assert_hostile(c)
    want = decode(c, False, method="flash", tile=tile)
    got = decode(c, True, method="flash", tile=tile)
    np.testing.assert_array_equal(got, want)
    assert_oracle(got, c, f"flash, pages of {page_size}")


@pytest.mark.device
def test_tensor_core_gemms_look_pages_up(monkeypatch):
    """A full tile of heads and 16-byte rows: method "gemm" runs the score and
    P.V GEMMs on tensor cores, which read the pages themselves (``tgemm`` with
    ``page_size``, no gather), bit for bit the contiguous run. Pages of 3 rows:
    every staged tile and slice spans pages (rows looked up one by one), in
    whole tiles and at the bounded edge."""
    from attention.gemm import tgemm

    nh = tgemm.tile_shape()[0]  # full tiles of heads: the unbounded copies too
    dims = MlaDims(n_head=nh, d_nope=8, d_rope=4, d_v=8, kv_rank=12)
    c = paged_case(3, dims=dims, lengths=[17], seed=2)
    calls, real = [], tgemm.launch

    def spy(*args, **kw):
        calls.append((kw["b_order"], kw.get("page_size", 0)))
        return real(*args, **kw)

    monkeypatch.setattr(tgemm, "launch", spy)
    want = decode(c, False, method="gemm")
    assert sorted(calls) == [("zkn", 0), ("znk", 0)]
    calls.clear()
    got = decode(c, True, method="gemm")
    assert sorted(calls) == [("zkn", 3), ("znk", 3)], f"tensor-core GEMMs launched: {calls}"
    np.testing.assert_array_equal(got, want)
    assert_oracle(got, c, "tensor cores, pages of 3")


@pytest.mark.device
@pytest.mark.parametrize("tiles_a_page", [2, 1.5])
def test_tgemm_paged_tiles_in_one_page_and_defect(tiles_a_page):
    """``tgemm.launch(..., page_size=P)`` against the contiguous launch, both
    orders (the latent rows [L, W] are b[n, k] of the score GEMM and b[k, n]
    of the P.V one), then a bounded tail; a second batch within its first
    page (its other entries HUGE). P of 2 tiles (a multiple of the n tile and
    the k slice): every whole tile inside one page, one look-up (compiled
    in). P of 1.5 tiles: tiles inside a page (one look-up, found at run time)
    alternate with tiles across two (rows looked up one by one).
    ``page_off_by_one`` is caught."""
    from attention.core.device import to_device, to_host
    from attention.gemm import tgemm

    rng = np.random.default_rng(3)
    bm, bn = tgemm.tile_shape()
    page_size = int(tiles_a_page * bn)
    width, n_rows = 16, 3 * bn + 3
    vis = np.array([n_rows, bn + 1], np.int32)
    rows = rng.standard_normal((2, n_rows, width)).astype(np.float32)
    pages, table, _ = build_pages(rows, vis, page_size, pages_needed(n_rows, page_size), rng,
                                  share_first=False)
    assert (table[1, 1:] == HUGE).all()
    lw = -(-n_rows // 4) * 4
    a = {"znk": rng.standard_normal((2, bm, width)).astype(np.float32),
         "zkn": rng.standard_normal((2, bm, lw)).astype(np.float32)}
    for order in ("znk", "zkn"):
        n_ext, k_ext = (vis, np.full(2, width, np.int32)) if order == "znk" else (
            np.full(2, width, np.int32), vis)
        max_n = n_rows if order == "znk" else width
        outs = []
        runs = ((False, None), (True, None)) + (((True, "page_off_by_one"),)
                                                 if tiles_a_page == 2 else ())
        for paged, defect in runs:
            c = to_device(np.full((2, bm, max_n), np.nan, np.float32))
            b = pages if paged else rows
            kw = {"page_size": page_size, "page_defect": defect} if paged else {}
            tgemm.launch(to_device(a[order]), to_device(b), c,
                         to_device(table if paged else np.arange(2, dtype=np.int32)),
                         to_device(n_ext), to_device(k_ext), 0.5, a_order="zmk",
                         b_order=order, c_order="zmn", max_n=max_n, n_batch=2, stream=0, **kw)
            outs.append(to_host(c))
        np.testing.assert_array_equal(outs[1], outs[0])
        if len(outs) > 2:
            assert not np.array_equal(outs[2], outs[0]), f"{order}: page_off_by_one not caught"


@pytest.mark.device
def test_graph_reads_paged_cache_and_table_in_place():
    """``MLADecodeGraph`` over device lengths and a device table: a run gives
    the contiguous ``mla_decode``'s bits; an entry written out of range into
    the table between runs is seen by the next run (that sequence attends
    nothing, ``check()`` names page_table), the others unchanged."""
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph

    c = paged_case(3, seed=4)
    d_lens = cuda.to_device(c["lengths"].astype(np.int32))
    d_table = cuda.to_device(c["table"])
    g = MLADecodeGraph(c["q_nope"], c["q_pe"], c["pages"], d_lens, c["w_uk"], c["w_uv"],
                       page_table=d_table)
    g.run(sync=True)
    want = decode(c, False, method="gemm")
    good = g.out.copy_to_host()
    np.testing.assert_array_equal(good, want)
    assert np.isneginf(g.lse.copy_to_host()[0]).all()

    bad = c["table"].copy()
    bad[3, 1] = len(c["pages"])  # sequence 3 (length P + 1) uses column 1
    d_table.copy_to_device(bad)
    with pytest.raises(checks.RangeError, match="page_table"):
        g.run(sync=True)
    out = g.out.copy_to_host()
    assert not out[3].any(), "a sequence with a bad page must attend nothing"
    np.testing.assert_array_equal(out[[0, 1, 2, 4]], good[[0, 1, 2, 4]])


@pytest.mark.device
def test_device_table_checked_on_the_device():
    """A device table gives the host table's bits; one whose used entry is out
    of range raises RangeError naming page_table after the launches (no read
    out of bounds: the sequence attends nothing)."""
    from numba import cuda

    c = paged_case(3, seed=6)
    host = decode(c, True, method="flash", tile=SIM_TILE)
    dev = decode(c, True, method="flash", tile=SIM_TILE,
                 page_table=cuda.to_device(c["table"]))
    np.testing.assert_array_equal(dev, host)
    bad = c["table"].copy()
    bad[4, 1] = -7
    with pytest.raises(checks.RangeError, match="page_table"):
        decode(c, True, method="flash", tile=SIM_TILE, page_table=cuda.to_device(bad))


@pytest.mark.device
@pytest.mark.parametrize("method", ["flash", "gemm_fma"])
def test_page_off_by_one_is_caught(method):
    c = paged_case(3, seed=8)
    tile = SIM_TILE if method == "flash" else None
    clean = decode(c, False, method=method, tile=tile)
    got = decode(c, True, method=method, tile=tile, defect="page_off_by_one")
    assert not np.array_equal(got, clean)
    r = c["dims"].kv_rank
    b, n = 4, int(c["lengths"][4])
    rows = c["cont"][4, :n]
    args = (c["q_nope"][b:b + 1], c["q_pe"][b:b + 1], rows[:, :r], rows[:, r:], c["w_uk"],
            c["w_uv"])
    assert not parity(got[b:b + 1], args)["ok"]


def _append_case(dtype, seed=9):
    return mla_append_case(dtype, seed)


@pytest.mark.device
@pytest.mark.parametrize("dtype,where", [("float16", "host"), ("float32", "device")])
def test_paged_append_canary(dtype, where):
    """One launch writes each new row where the table says, bit for bit, and
    no other byte of the cache (host arrays: checked on the host; device
    arrays: the checked kernel, whose flag stays clear)."""
    from numba import cuda

    from mla.paged import paged_append_latent

    cache, new_rows, table, lengths, n_new, want = _append_case(np.dtype(dtype))
    assert not np.array_equal(cache.view(np.uint8), want.view(np.uint8))
    if where == "host":
        assert paged_append_latent(new_rows, cache, table, lengths, n_new=n_new) is None
        got = cache
    else:
        d_cache = cuda.to_device(cache)
        flag = paged_append_latent(cuda.to_device(new_rows), d_cache, cuda.to_device(table),
                                   cuda.to_device(lengths.astype(np.int32)),
                                   n_new=cuda.to_device(n_new.astype(np.int32)))
        assert flag.copy_to_host().tolist() == [0, HUGE]
        got = d_cache.copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.device
def test_paged_append_device_flag_and_defect():
    """A device table whose entry for a written row is out of range: that row
    is not written (every byte else as the clean append), the flag counts it
    and names the sequence. ``append_page_off_by_one`` breaks the canary."""
    from numba import cuda

    from mla.paged import paged_append_latent

    cache, new_rows, table, lengths, n_new, want = _append_case(np.float32, seed=10)
    bad = table.copy()
    bad[3, 2] = 99  # sequence 3 (length 5, 3 new rows of pages of 3): positions 6 and 7
    want_bad = want.copy()
    want_bad[table[3, 2], :2] = cache[table[3, 2], :2]
    d_cache = cuda.to_device(cache)
    flag = paged_append_latent(new_rows, d_cache, cuda.to_device(bad), lengths, n_new=n_new)
    assert flag.copy_to_host().tolist() == [2, 3]
    np.testing.assert_array_equal(d_cache.copy_to_host().view(np.uint8),
                                  want_bad.view(np.uint8))

    planted = cache.copy()
    paged_append_latent(new_rows, planted, table, lengths, n_new=n_new,
                        defect="append_page_off_by_one")
    assert not np.array_equal(planted.view(np.uint8), want.view(np.uint8))


@pytest.mark.device
@pytest.mark.gpu
def test_full_size_every_method_bit_equal():
    """DeepSeek-V3 widths, 128 heads (tensor-core GEMMs with page look-ups),
    page 64, lengths 0 .. 1000; every method and the captured decode give the
    contiguous cache's bits; the FMA path within the oracle's tolerance."""
    from mla.decode_graph import MLADecodeGraph

    assert MODE == "gpu" and not small()
    c = paged_case(DEFAULT_PAGE_SIZE, dims=DEEPSEEK_V3, lengths=[0, 1, 64, 65, 700, 1000],
                   seed=11)
    assert_hostile(c)
    for method in ("auto", "gemm", "gemm_fma", "flash"):
        np.testing.assert_array_equal(decode(c, True, method=method),
                                      decode(c, False, method=method), err_msg=method)
    g = MLADecodeGraph(c["q_nope"], c["q_pe"], c["pages"], c["lengths"], c["w_uk"],
                       c["w_uv"], page_table=c["table"])
    g.run(sync=True)
    np.testing.assert_array_equal(g.out.copy_to_host(), decode(c, False, method="gemm"))
    assert_oracle(decode(c, True, method="gemm_fma"), c, "full size gemm_fma")


@pytest.mark.device
def test_validation_suite_passes_clean_and_catches_each_defect():
    """``validation.suite_mla_paged`` (the defect catalogue's paged-latent and
    multi-token MLA family): its clean run passes and each planted defect fails
    at least one of its checks."""
    from validation import suite_mla_paged as S

    clean = S.run_suite(None)
    assert clean and all(c.passed for c in clean), [c for c in clean if not c.passed]
    for defect in S.DEFECTS:
        assert any(not c.passed for c in S.run_suite(defect)), f"{defect}: not caught"
