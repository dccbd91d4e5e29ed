"""paged_append: every sequence's T new K/V rows written through a page table, one launch.

Checked on the simulator (and on a GPU), bit for bit against a numpy reference
of the same semantics (``k_pages[page_table[m, p // P], :, p % P] = k_new[m, i]``
with ``p = lengths[m] + i``, HND; the NHD row is ``[page, p % P, g]``):

* both layouts, float32 and float16 (bfloat16 on a GPU only, compiled here),
  page sizes 1, 3 (not a power of two), 4 and 16, T 1 and 4;
* hostile fixtures: shuffled page tables (asserted not the identity), a prefix
  page shared by several sequences whose lengths run past it (it must stay
  untouched), unused table entries set to a huge index (the simulator raises on
  an out-of-bounds write, so a read of one shows), lengths 0, a multiple of the
  page size and a multiple plus one;
* canaries: pages filled with a NaN bit pattern; every element but the written
  rows is bit-identical afterwards;
* device page tables or lengths: the checked kernel flags a bad page index, a
  negative length or a position past the table, writes nothing for those
  tokens, and still writes the others;
* bad input (plain process, no kernel run): each argument named, caches untouched;
* every planted defect fails the same bit-exact comparison (positive control).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.cache.paged import (
    APPEND_DEFECTS,
    FLAG_CLEAR,
    PAGED_LAYOUTS,
    paged_append,
    paged_append_kernel,
    pages_needed,
)
from attention.core import checks
from tests.conftest import storage_dtype

HUGE = 2 ** 30  # unused page-table entries: never to be read
CANARY32 = np.uint32(0x7FC0DEAD)  # quiet NaNs with payloads no copy produces
CANARY16 = np.uint16(0x7E5A)
N_KV, HEAD_DIM = 2, 12



def _dtype(name):
    return storage_dtype(name, "the CUDA simulator has no bfloat16 (compiled in test_compile_ptx)")


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def canary(shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.itemsize == 4:
        return np.full(shape, CANARY32, np.uint32).view(dtype)
    return np.full(shape, CANARY16, np.uint16).view(dtype)


def page_shape(layout, n_pages, page, n_kv=N_KV, head_dim=HEAD_DIM):
    if layout == "HND":
        return (n_pages, n_kv, page, head_dim)
    return (n_pages, page, n_kv, head_dim)


def row(layout, page_index, offset):
    """Index of the [H_kv, D] rows of one position inside the pages."""
    if layout == "HND":
        return (page_index, slice(None), offset)
    return (page_index, offset)


def make_case(rng, lens, t_new, page, dtype, layout, share=True, spare=2,
              n_kv=N_KV, head_dim=HEAD_DIM):
    """(k_pages, v_pages, page_table, k_new, v_new, prefix page or None).

    Pages in a shuffled order; sequence 0's first page shared by every other
    sequence whose cached length covers a whole page (a common prefix, never
    appended to); the cached rows hold values, every other row the canary;
    ``HUGE`` in every table entry past a sequence's pages (one spare column)."""
    lens = [int(x) for x in lens]
    need = [pages_needed(max(n, 0) + t_new, page) for n in lens]
    owned = sum(need) + spare
    order = rng.permutation(owned)
    assert not np.array_equal(order, np.arange(owned))
    table = np.full((len(lens), max(need) + 1), HUGE, np.int32)
    at = 0
    for m, n in enumerate(need):
        table[m, :n] = order[at:at + n]
        at += n
    prefix = None
    if share and lens[0] >= page:
        prefix = int(table[0, 0])
        for m in range(1, len(lens)):
            if lens[m] >= page:
                table[m, 0] = prefix
    k = canary(page_shape(layout, owned, page, n_kv, head_dim), dtype)
    v = canary(page_shape(layout, owned, page, n_kv, head_dim), dtype)
    for m, n in enumerate(lens):
        for p in range(max(n, 0)):
            idx = row(layout, table[m, p // page], p % page)
            if (bits(k[idx]) == bits(canary(1, dtype))[0]).all():
                k[idx] = rng.standard_normal((n_kv, head_dim)).astype(dtype)
                v[idx] = rng.standard_normal((n_kv, head_dim)).astype(dtype)
    shape = (len(lens), t_new, n_kv, head_dim)
    k_new = (rng.standard_normal(shape) / 3).astype(dtype)
    v_new = (rng.standard_normal(shape) / 3).astype(dtype)
    return k, v, table, k_new, v_new, prefix


def reference(pages, new, table, lens, layout, write=None):
    """The pages after the append; ``write[m, i]`` False skips that token."""
    out = pages.copy()
    page = pages.shape[2] if layout == "HND" else pages.shape[1]
    for m in range(new.shape[0]):
        for i in range(new.shape[1]):
            if write is None or write[m, i]:
                p = int(lens[m]) + i
                out[row(layout, table[m, p // page], p % page)] = new[m, i]
    return out


def assert_same_bits(got, want, what):
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def differs(got, want):
    return not np.array_equal(bits(got), bits(want))


# ---- bit-exact against the reference ---------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("page", [1, 3, 4, 16])
@pytest.mark.parametrize("t_new", [1, 4])
def test_append_is_bit_exact(layout, dtype_name, page, t_new):
    dtype = _dtype(dtype_name)
    rng = np.random.default_rng(page * 100 + t_new * 10 + (layout == "NHD"))
    # a multiple of P (seq 0: owns the shared prefix), 0, a multiple plus one, P
    lens = np.array([2 * page, 0, page + 1, page], np.int32)
    k, v, table, k_new, v_new, prefix = make_case(rng, lens, t_new, page, dtype, layout)
    assert prefix is not None and (table[:, 0] == prefix).sum() == 3
    want_k = reference(k, k_new, table, lens, layout)
    want_v = reference(v, v_new, table, lens, layout)
    before_prefix = (k[prefix].copy(), v[prefix].copy())
    lens_before = lens.copy()
    assert paged_append(k_new, v_new, k, v, table, lens, layout=layout) is None
    assert_same_bits(k, want_k, "k_pages")
    assert_same_bits(v, want_v, "v_pages")
    assert_same_bits(k[prefix], before_prefix[0], "shared prefix page (K) written")
    assert_same_bits(v[prefix], before_prefix[1], "shared prefix page (V) written")
    np.testing.assert_array_equal(lens, lens_before)


@pytest.mark.device
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_only_the_written_rows_change(layout, dtype_name):
    """Canary everywhere: the written rows hold k_new / v_new bit for bit, and
    every other element keeps its NaN payload."""
    dtype = _dtype(dtype_name)
    rng = np.random.default_rng(7)
    page, t_new = 3, 4
    lens = np.array([3, 5, 0], np.int32)
    _, _, table, k_new, v_new, _ = make_case(rng, lens, t_new, page, dtype, layout)
    shape = page_shape(layout, table[table < HUGE].max() + 3, page)
    k, v = canary(shape, dtype), canary(shape, dtype)
    paged_append(k_new, v_new, k, v, table, lens, layout=layout)
    written = np.zeros(shape, bool)
    for m in range(len(lens)):
        for i in range(t_new):
            p = int(lens[m]) + i
            idx = row(layout, table[m, p // page], p % page)
            written[idx] = True
            assert_same_bits(k[idx], k_new[m, i], f"k row of sequence {m} token {i}")
            assert_same_bits(v[idx], v_new[m, i], f"v row of sequence {m} token {i}")
    assert written.sum() == len(lens) * t_new * N_KV * HEAD_DIM
    cw = CANARY32 if np.dtype(dtype).itemsize == 4 else CANARY16
    assert (bits(k)[~written] == cw).all() and (bits(v)[~written] == cw).all()


@pytest.mark.device
@pytest.mark.parametrize("threads", [4, 32])
def test_threads_stride_over_head_dim(threads):
    """The kernel launched directly with fewer threads than D (a stride loop of
    four steps) and with more (idle threads)."""
    from numba import cuda

    rng = np.random.default_rng(threads)
    page, t_new, head_dim = 4, 2, 16
    lens = np.array([5, 4], np.int32)
    k, v, table, k_new, v_new, _ = make_case(rng, lens, t_new, page, np.float32, "HND",
                                             head_dim=head_dim)
    want_k = reference(k, k_new, table, lens, "HND")
    want_v = reference(v, v_new, table, lens, "HND")
    d_k, d_v = cuda.to_device(k), cuda.to_device(v)
    paged_append_kernel("HND")[(t_new, len(lens), N_KV), threads](
        cuda.to_device(k_new), cuda.to_device(v_new), d_k, d_v, cuda.to_device(table),
        cuda.to_device(lens))
    assert_same_bits(d_k.copy_to_host(), want_k, "k_pages")
    assert_same_bits(d_v.copy_to_host(), want_v, "v_pages")


@pytest.mark.device
def test_pooled_cache_is_hnd_with_one_column():
    """The pooled cache [KV_SLOTS, H_kv, max_seq, D] with a one-column table of
    slots gives what batched_kv_scatter writes."""
    from attention.cache.scatter import batched_kv_scatter

    rng = np.random.default_rng(3)
    slots, max_seq = 3, 8
    pooled = canary((slots, N_KV, max_seq, HEAD_DIM), np.float32)
    k_rows = rng.standard_normal((2, N_KV, HEAD_DIM)).astype(np.float32)
    v_rows = rng.standard_normal((2, N_KV, HEAD_DIM)).astype(np.float32)
    positions = np.array([3, 7], np.int32)
    slot_table = np.array([2, 0], np.int32)
    k_a, v_a = pooled.copy(), pooled.copy()
    batched_kv_scatter(k_rows, v_rows, k_a, v_a, positions, slot_table)
    k_b, v_b = pooled.copy(), pooled.copy()
    paged_append(k_rows[:, None], v_rows[:, None], k_b, v_b, slot_table[:, None].copy(),
                 positions)
    assert_same_bits(k_b, k_a, "k")
    assert_same_bits(v_b, v_a, "v")


# ---- device page tables and lengths: the checked kernel and its flag ---------

def flagged_case(rng, layout, dtype=np.float32):
    """M 4, P 4, T 3, max_pages 3 (capacity 12). Sequence 0 is fine; 1 has an
    out-of-range page in the column it appends to (3 tokens flagged); 2 runs
    past the table (position 11 written, 12 and 13 flagged); 3 has a negative
    length (3 tokens flagged). Entries no written position uses hold HUGE."""
    page, t_new = 4, 3
    lens = np.array([4, 1, 11, -1], np.int32)
    n_pages = 9
    order = rng.permutation(n_pages)
    table = np.full((4, 3), HUGE, np.int32)
    table[0, :2] = order[:2]
    table[1, 0] = n_pages  # out of range, used by positions 1, 2, 3
    table[2, :] = order[2:5]
    shape = page_shape(layout, n_pages, page)
    k, v = canary(shape, dtype), canary(shape, dtype)
    shape = (4, t_new, N_KV, HEAD_DIM)
    k_new = rng.standard_normal(shape).astype(dtype)
    v_new = rng.standard_normal(shape).astype(dtype)
    write = np.zeros((4, t_new), bool)
    write[0, :] = True
    write[2, 0] = True
    return k, v, table, lens, k_new, v_new, write


@pytest.mark.device
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("on_device", ["both", "page_table", "lengths"])
def test_device_table_flags_bad_tokens_and_writes_the_rest(layout, on_device):
    """Either index array on the device selects the checked kernel. Host lengths
    are still checked on the host, so with a device table alone they are kept
    legal: sequence 2 appends at 9..11 (inside the table) and sequence 3 at 0,
    whose table row is all HUGE (3 tokens flagged)."""
    from numba import cuda

    rng = np.random.default_rng(11)
    k, v, table, lens, k_new, v_new, write = flagged_case(rng, layout)
    n_bad = 3 + 2 + 3
    if on_device == "page_table":
        lens[2], lens[3] = 9, 0
        write[2, :] = True
        n_bad = 3 + 3
    want_k = reference(k, k_new, table, lens, layout, write)
    want_v = reference(v, v_new, table, lens, layout, write)
    d_k, d_v = cuda.to_device(k), cuda.to_device(v)
    d_table = cuda.to_device(table) if on_device in ("both", "page_table") else table
    d_lens = cuda.to_device(lens) if on_device in ("both", "lengths") else lens
    stream = cuda.stream()
    flag = paged_append(cuda.to_device(k_new), cuda.to_device(v_new), d_k, d_v, d_table, d_lens,
                        layout=layout, stream=stream)
    stream.synchronize()
    assert flag is not None and not isinstance(flag, np.ndarray)
    assert flag.copy_to_host().tolist() == [n_bad, 1]
    assert_same_bits(d_k.copy_to_host(), want_k, "k_pages")
    assert_same_bits(d_v.copy_to_host(), want_v, "v_pages")
    if on_device != "page_table":
        np.testing.assert_array_equal(d_lens.copy_to_host(), lens)  # not advanced


@pytest.mark.device
def test_clean_device_append_leaves_the_flag_clear_and_accumulates_a_given_one():
    from numba import cuda

    rng = np.random.default_rng(5)
    lens = np.array([4, 0, 5], np.int32)
    k, v, table, k_new, v_new, _ = make_case(rng, lens, 2, 4, np.float16, "NHD")
    want_k = reference(k, k_new, table, lens, "NHD")
    d_k, d_v = cuda.to_device(k), cuda.to_device(v)
    d_table, d_lens = cuda.to_device(table), cuda.to_device(lens)
    flag = paged_append(k_new, v_new, d_k, d_v, d_table, d_lens, layout="NHD")
    assert flag.copy_to_host().tolist() == list(FLAG_CLEAR)
    assert_same_bits(d_k.copy_to_host(), want_k, "k_pages")
    # a caller's flag: raised by a second, bad append (a negative length), and returned
    mine = cuda.to_device(np.array([2, 1], np.int32))
    bad = cuda.to_device(np.array([4, -3, 5], np.int32))
    got = paged_append(k_new, v_new, d_k, d_v, d_table, bad, layout="NHD", flag=mine)
    assert got is mine
    assert mine.copy_to_host().tolist() == [2 + 2, 1]
    assert_same_bits(d_k.copy_to_host(), want_k, "k_pages")  # the same rows again


# ---- bad input: named errors before anything is copied or written -------------

def good_args(layout="HND"):
    page, t_new = 4, 2
    lens = np.array([4, 1, 6], np.int32)
    table = np.array([[0, 3, HUGE], [5, HUGE, HUGE], [2, 4, HUGE]], np.int32)
    shape = page_shape(layout, 7, page)
    return {"k_new": np.ones((3, t_new, N_KV, HEAD_DIM), np.float32),
            "v_new": np.ones((3, t_new, N_KV, HEAD_DIM), np.float32),
            "k_pages": canary(shape, np.float32), "v_pages": canary(shape, np.float32),
            "page_table": table, "lengths": lens}


def _table(**cells):
    t = good_args()["page_table"].copy()
    for key, val in cells.items():
        m, j = (int(c) for c in key[1:].split("_"))
        t[m, j] = val
    return t


BAD = [
    ("k_new dtype", {"k_new": np.ones((3, 2, 2, 12), np.float64)}, checks.DTypeError,
     r"k_new: expected dtype float32, got float64"),
    ("v_new dtype", {"v_new": np.ones((3, 2, 2, 12), np.float16)}, checks.DTypeError,
     r"v_new: expected dtype float32"),
    ("k_pages dtype", {"k_pages": np.zeros((7, 2, 4, 12), np.int32)}, checks.DTypeError,
     r"k_pages: expected dtype"),
    ("v_pages dtype", {"v_pages": np.zeros((7, 2, 4, 12), np.float16)}, checks.DTypeError,
     r"v_pages: expected dtype float32"),
    ("k_pages rank", {"k_pages": np.zeros((7, 2, 48), np.float32)}, checks.ShapeError,
     r"k_pages: expected shape \[num_pages, H_kv, page_size, D\]"),
    ("v_pages shape", {"v_pages": np.zeros((6, 2, 4, 12), np.float32)}, checks.ShapeError,
     r"v_pages: expected shape \[num_pages=7, H_kv=2, page_size=4, D=12\]"),
    ("k_pages not contiguous", {"k_pages": np.zeros((7, 2, 4, 24), np.float32)[..., ::2]},
     checks.LayoutError, r"k_pages: expected a C-contiguous"),
    ("k_new heads", {"k_new": np.ones((3, 2, 1, 12), np.float32)}, checks.ShapeError,
     r"k_new: expected shape \[M, T, H_kv=2, D=12\]"),
    ("k_new head_dim", {"k_new": np.ones((3, 2, 2, 8), np.float32)}, checks.ShapeError,
     r"k_new: expected shape \[M, T, H_kv=2, D=12\]"),
    ("v_new tokens", {"v_new": np.ones((3, 1, 2, 12), np.float32)}, checks.ShapeError,
     r"v_new: expected shape \[M=3, T=2, H_kv=2, D=12\]"),
    ("T = 0", {"k_new": np.ones((3, 0, 2, 12), np.float32),
               "v_new": np.ones((3, 0, 2, 12), np.float32)}, checks.RangeError,
     r"k_new: expected T >= 1 new tokens a sequence, got T=0"),
    ("pages in the other layout", {"k_pages": np.zeros((7, 4, 2, 12), np.float32),
                                   "v_pages": np.zeros((7, 4, 2, 12), np.float32)},
     checks.ShapeError, r"k_new: expected shape \[M, T, H_kv=4, D=12\]"),
    ("page_table dtype", {"page_table": _table().astype(np.int64)}, checks.DTypeError,
     r"page_table: expected dtype int32, got int64"),
    ("page_table rows", {"page_table": _table()[:2]}, checks.ShapeError,
     r"page_table: expected shape \[M=3, max_pages\]"),
    ("page_table rank", {"page_table": _table()[0]}, checks.ShapeError, r"page_table"),
    ("lengths shape", {"lengths": np.array([4, 1], np.int32)}, checks.ShapeError,
     r"lengths: expected shape \[M=3\]"),
    ("lengths dtype", {"lengths": np.array([4.0, 1.0, 6.0])}, checks.DTypeError,
     r"lengths: expected integers"),
    ("negative length", {"lengths": np.array([4, -1, 6], np.int32)}, checks.RangeError,
     r"lengths: expected lengths >= 0, got lengths\[1\]=-1"),
    ("page table too short", {"lengths": np.array([4, 1, 11], np.int32)}, checks.RangeError,
     (r"page_table: too short for sequence 2: lengths\[2\]=11 plus T=2 new tokens need 4 "
      r"pages of page_size=4, the table has max_pages=3")),
    ("page index past the pool", {"page_table": _table(m1_0=7)}, checks.RangeError,
     r"page_table: sequence 1 column 0 holds page 7, expected a page in \[0, num_pages=7\)"),
    ("negative page index", {"page_table": _table(m2_1=-2)}, checks.RangeError,
     r"page_table: sequence 2 column 1 holds page -2"),
    ("huge entry in a used column", {"lengths": np.array([4, 3, 6], np.int32)},
     checks.RangeError, r"page_table: sequence 1 column 1 holds page 1073741824"),
    ("a row written twice", {"page_table": _table(m1_0=3)}, checks.RangeError,
     r"page_table: page 3 offset 1 is written twice \(sequences \[0, 1\]\)"),
    ("bad layout", {"layout": "NDH"}, checks.LayoutError,
     r"layout: expected one of \('HND', 'NHD'\), got 'NDH'"),
    ("flag shape", {"flag": np.zeros(3, np.int32)}, checks.ShapeError,
     r"flag: expected shape \[2\]"),
    ("flag dtype", {"flag": np.zeros(2, np.int64)}, checks.DTypeError,
     r"flag: expected dtype int32"),
    ("bad defect", {"defect": "no_such_defect"}, ValueError, r"defect"),
]


@pytest.mark.parametrize("name,change,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_and_leaves_the_caches_untouched(name, change, error, message):
    args = good_args()
    args.update(change)
    kw = {key: args.pop(key) for key in ("layout", "flag", "defect") if key in args}
    before = {key: np.array(args[key], copy=True) for key in ("k_pages", "v_pages", "page_table",
                                                               "lengths")}
    with pytest.raises(error, match=message):
        paged_append(**args, **kw)
    for key, arr in before.items():
        np.testing.assert_array_equal(np.ascontiguousarray(args[key]).view(np.uint8),
                                      arr.view(np.uint8),
                                      err_msg=f"{key} changed")


class _Stop(Exception):
    pass


def test_host_checks_read_only_the_used_table_entries(monkeypatch):
    """HUGE and negative entries past the used columns pass validation (the
    first copy to the device is cut off: no kernel runs in this process)."""
    from attention.cache import paged

    def no_copy(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(paged, "to_device", no_copy)
    args = good_args("NHD")
    args["page_table"][1, 1:] = -5
    with pytest.raises(_Stop):
        paged_append(**args, layout="NHD")


def test_pages_needed_and_names():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pages_needed(7, 1) == 7 and pages_needed(16, 16) == 1
    with pytest.raises(checks.RangeError, match="length"):
        pages_needed(-1, 4)
    with pytest.raises(checks.RangeError, match="page_size"):
        pages_needed(3, 0)
    assert PAGED_LAYOUTS == ("HND", "NHD")
    assert set(APPEND_DEFECTS) == {"append_page_off_by_one", "append_offset_stride",
                                   "append_behind"}
    with pytest.raises(checks.LayoutError, match="layout"):
        paged_append_kernel("XYZ")
    with pytest.raises(ValueError, match="defect"):
        paged_append_kernel("HND", "nope")
    assert paged_append_kernel("NHD", None, True) is paged_append_kernel("NHD", None, True)
    assert paged_append_kernel("NHD", None, True).py_func.__name__ == "paged_append_NHD_checked"
    assert paged_append_kernel("HND", "append_behind").py_func.__name__ == \
        "paged_append_HND_append_behind"


@pytest.mark.compile
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("checked", [False, True])
def test_compile_ptx(layout, kind, checked):
    """Every dtype (bfloat16 included, which the simulator cannot run) and both
    kernels compile for sm_90, with no local memory."""
    from numba import cuda, types

    elem = {"f32": types.float32, "f16": types.float16, "bf16": cuda.types.bfloat16}[kind]
    arr = types.Array(elem, 4, "C")
    sig = (arr, arr, arr, arr, types.Array(types.int32, 2, "C"), types.int32[::1])
    if checked:
        sig += (types.int32[::1],)
    ptx, _ = cuda.compile_ptx(paged_append_kernel(layout, None, checked).py_func, sig,
                              cc=(9, 0))
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ("atom.global" in ptx) == checked


# ---- planted defects: caught by the same comparison ----------------------------

@pytest.mark.device
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("defect", (None,) + APPEND_DEFECTS)
def test_planted_defect_is_caught(defect, path, layout):
    """H_kv 2 and P 4 (the stride defect is invisible where the layouts
    coincide); sequences 2 and 3 share sequence 0's first page with lengths 5
    and 4 (a multiple of P: append_behind writes its last row). ``None``: the
    same fixture passes the comparison (negative control)."""
    from numba import cuda

    rng = np.random.default_rng(17)
    lens = np.array([4, 2, 5, 4], np.int32)
    k, v, table, k_new, v_new, prefix = make_case(rng, lens, 2, 4, np.float32, layout)
    assert prefix is not None and table[3, 0] == prefix
    want_k = reference(k, k_new, table, lens, layout)
    want_v = reference(v, v_new, table, lens, layout)
    shared = (k[prefix].copy(), v[prefix].copy())
    if path == "device":
        d_k, d_v = cuda.to_device(k), cuda.to_device(v)
        paged_append(k_new, v_new, d_k, d_v, cuda.to_device(table), cuda.to_device(lens),
                     layout=layout, defect=defect)
        k, v = d_k.copy_to_host(), d_v.copy_to_host()
    else:
        paged_append(k_new, v_new, k, v, table, lens, layout=layout, defect=defect)
    if defect is None:
        assert_same_bits(k, want_k, "k_pages")
        assert_same_bits(v, want_v, "v_pages")
        return
    assert differs(k, want_k) and differs(v, want_v), f"{defect} passed the bit-exact check"
    if defect == "append_behind":
        assert differs(k[prefix], shared[0]) and differs(v[prefix], shared[1]), \
            "append_behind did not write into the shared prefix page"
