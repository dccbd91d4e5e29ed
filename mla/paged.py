"""Paged latent cache for MLA decode (FlashMLA-style): its checks, the row gather
of the FMA GEMMs, and the paged latent append.

Layout (C-contiguous):
    cache       [num_pages, page_size, r + d_rope] float32 or float16, rows
                ``[c_kv | k_pe]`` (page_size 64 by default: ``DEFAULT_PAGE_SIZE``;
                any size >= 1)
    page_table  [B, max_pages] int32: position ``p`` of sequence ``b`` is row
                ``p % page_size`` of page ``page_table[b, p // page_size]``
    lengths     [B] ints: positions cached per sequence (capacity
                ``max_pages * page_size``)

Pages may be shared between sequences (a read-only common prefix) and appear in
the table in any order: no kernel assumes they are distinct or ordered. Nothing
reads a table entry past a sequence's pages (columns ``>= ceil(lengths[b] /
page_size)``) nor a row past its length, so those may hold anything (the tests
put 2**31 - 1 in the entries and NaN in the rows).

Who reads it (``mla.pipeline.mla_decode(..., page_table=)``,
``mla.decode_graph.MLADecodeGraph(..., page_table=)``), every method giving the
bits of a contiguous cache holding the same rows:

* "flash": ``mla.kernels.attn_absorbed_kernel(..., page_size=P)`` looks the
  rows up where it stages a tile (one table look-up a tile inside a page);
* "gemm" where the tensor-core GEMM takes the score and P.V GEMMs
  (``attention.gemm.tgemm.tgemm_kernel(..., page_size=P)``): the same, where a
  slice of rows is copied to shared memory;
* "gemm_fma", and "gemm" where ``tgemm`` does not take the call (few heads,
  rows not 16-byte multiples): ``attention.gemm.sgemm`` has no paged
  addressing, so the first launch (``gather_rows_kernel``) copies each query's
  visible rows into a contiguous scratch ``[Q, max_vis, r + d_rope]``
  (``attn_gemm.Workspace.rows``, counted in the GEMM scratch budget) that the
  unchanged GEMMs read: one more read and write of the visible rows.

Contiguous kernels are built without any of this (``page_size=0``, the
default, is a compile-time switch: their PTX is unchanged).

Checks: ``check_paged_cache`` / ``check_page_table`` raise named errors before
anything is copied or launched (shape, dtype, a table too short for a length,
and, for a host table, every entry a sequence uses in ``[0, num_pages)``). A
device table's entries are checked on the device by ``page_check_kernel``: a
sequence with an entry out of range is attended as empty (zeros, LSE -inf;
nothing out of bounds is read) and a flag is raised (``FLAG_PAGE``), which
``mla_decode`` (without a stream) and ``MLADecodeGraph.check()`` turn into a
``RangeError`` naming ``page_table``.

``paged_append_latent`` writes new rows ``[B, T, r + d_rope]`` at positions
``lengths[b] + i`` through the table in one launch, element for element.

Planted defects (falsification suite only; compile-time switches, the
defect-free kernels unchanged):
    "page_off_by_one"         (``READ_DEFECTS``; ``mla_decode(..., defect=)``,
                              every method) rows read from page ``(entry + 1) %
                              num_pages``: the neighbouring page, in bounds
    "append_page_off_by_one"  (``APPEND_DEFECTS``; ``paged_append_latent``)
                              rows written into page ``(entry + 1) % num_pages``
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.core import checks
from attention.core.device import (
    SIMULATOR,
    device_fn,
    finish,
    is_host_array,
    jit,
    launch_stream,
    to_device,
)

from attention.cache.paged import _check_capacity, _check_pages, pages_needed

from . import kernels as K

DEFAULT_PAGE_SIZE = 64
READ_DEFECTS = K.PAGE_DEFECTS  # ("page_off_by_one",)
APPEND_DEFECTS = ("append_page_off_by_one",)
PAGED_DEFECTS = READ_DEFECTS + APPEND_DEFECTS
FLAG_LENGTH, FLAG_PAGE = 1, 2  # page_check_kernel's flag bits
APPEND_FLAG_CLEAR = (0, 2 ** 31 - 1)  # [rows not written, lowest sequence at fault]
_MAX_GRID_Y = 65535  # the append's B rides on grid y


# ---------------------------------------------------------------------------
# host checks (named errors before any copy or launch)
# ---------------------------------------------------------------------------


def check_paged_cache(name, cache, width=None):
    """``cache`` [num_pages, page_size, width] float32 / float16, C-contiguous.
    Returns (num_pages, page_size, width)."""
    n_pages, page_size, width = checks.check_array(
        name, cache, (("num_pages", None), ("page_size", None), ("r+d_rope", width)),
        dtypes=K.CACHE_DTYPES)
    if page_size < 1 or n_pages < 1:
        raise checks.ShapeError(f"{name}: expected at least one page of at least one row "
                                f"[num_pages>=1, page_size>=1, r+d_rope], got "
                                f"{(n_pages, page_size, width)}")
    return n_pages, page_size, width


def check_page_table(page_table, n_seq, lengths, page_size, n_pages, *, name="page_table"):
    """``page_table`` [B=n_seq, max_pages] int32 (C-contiguous on the device), long enough for
    every host length (``lengths[b] <= max_pages * page_size``); a host
    (numpy) table's entries of the pages each sequence uses in ``[0,
    n_pages)`` (entries past them are not looked at). ``lengths``: host ints
    [B] (or None: capacity not checked here). Returns max_pages."""
    # a numpy table is copied (any strides); a device one is read in place: C order
    max_pages = checks.check_array(name, page_table, (("B", n_seq), ("max_pages", None)),
                                   dtypes=(np.int32,),
                                   contiguous=not is_host_array(page_table))[1]
    if lengths is None:
        return max_pages
    lens = np.asarray(lengths, np.int64)
    capacity = max_pages * page_size
    over = np.flatnonzero(lens > capacity)
    if over.size:
        b = int(over[0])
        raise checks.RangeError(
            f"{name}: too short for sequence {b}: lengths[{b}]={int(lens[b])} needs "
            f"{pages_needed(lens[b], page_size)} pages of page_size={page_size}, the table "
            f"has max_pages={max_pages} (capacity {capacity} positions)")
    if is_host_array(page_table):
        for b in range(n_seq):
            used = np.asarray(page_table[b, :pages_needed(lens[b], page_size)], np.int64)
            bad = np.flatnonzero((used < 0) | (used >= n_pages))
            if bad.size:
                j = int(bad[0])
                raise checks.RangeError(
                    f"{name}: sequence {b} column {j} holds page {int(used[j])}, expected a "
                    f"page in [0, num_pages={n_pages})")
    return max_pages


# ---------------------------------------------------------------------------
# device check of lengths and page table
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def page_check_kernel(s_q=1):
    """``vis[b] = lengths[b]`` when ``0 <= lengths[b] <= max_pages * page_size``
    and every entry of the pages it uses is in ``[0, num_pages)``; else
    ``vis[b] = 0`` (attended as empty) and ``flag[0] |= FLAG_LENGTH`` (the
    length) or ``FLAG_PAGE`` (an entry). Only the entries of used pages are read.

    lengths [B] int32, page_table [B, max_pages] int32, page_size int32,
    num_pages int32, vis [B] int32 (out), flag [1] int32 (bits or-ed in).
    Grid ceil(B / block), one thread a sequence. ``s_q`` > 1 (multi-token
    decode, compile-time; 1 builds the kernel above unchanged): a length in
    ``1 .. s_q - 1`` is out of range too (``FLAG_LENGTH``).
    """
    S_Q = int(s_q)

    SHORT = S_Q > 1  # compile-time: with one query the test below folds away

    def kernel(lengths, page_table, page_size, num_pages, vis, flag):
        b = cuda.grid(1)
        if b < lengths.shape[0]:
            n = lengths[b]
            if n < 0 or n > page_table.shape[1] * page_size or (
                    SHORT and n > 0 and n < S_Q):
                vis[b] = 0
                cuda.atomic.or_(flag, 0, FLAG_LENGTH)
                return
            ok = True
            for j in range((n + page_size - 1) // page_size):
                page = page_table[b, j]
                if page < 0 or page >= num_pages:
                    ok = False
            if ok:
                vis[b] = n
            else:
                vis[b] = 0
                cuda.atomic.or_(flag, 0, FLAG_PAGE)

    if S_Q > 1:
        kernel.__name__ = kernel.__qualname__ = f"mla_page_check_sq{S_Q}"
    else:
        kernel.__name__ = kernel.__qualname__ = "mla_page_check"
    return jit(kernel)


def launch_page_check(d_lengths, d_page_table, page_size, n_pages, d_vis, d_flag, stream,
                      s_q=1):
    """Enqueue ``page_check_kernel`` (device arrays, no validation; ``s_q``:
    the new queries a sequence of a multi-token decode)."""
    n_b = int(d_lengths.shape[0])
    if n_b == 0:
        return
    block = 32 if SIMULATOR else 128
    kernel = page_check_kernel(int(s_q)) if s_q > 1 else page_check_kernel()
    kernel[(n_b + block - 1) // block, block, stream](
        d_lengths, d_page_table, np.int32(page_size), np.int32(n_pages), d_vis, d_flag)


def page_error(flag_word, lengths=None, capacity=None, s_q=1):
    """The ``RangeError`` of a ``page_check_kernel`` flag word, or None when no
    bit is raised (``lengths``, ``capacity``, ``s_q``: for the message)."""
    if flag_word & FLAG_LENGTH:
        if s_q > 1:
            return checks.RangeError(
                f"lengths: expected lengths 0 or in [s_q={s_q}, max_pages * page_size="
                f"{capacity}] at a run (the s_q new queries are the last positions of their "
                f"sequence); got {lengths}; that sequence was attended as empty")
        return checks.RangeError(f"lengths: expected lengths in [0, max_pages * page_size="
                                 f"{capacity}] at a run; got {lengths}")
    if flag_word & FLAG_PAGE:
        return checks.RangeError(
            "page_table: an entry of a page in use was outside [0, num_pages) at a run; "
            "that sequence was attended as empty (zeros, LSE -inf)")
    return None


# ---------------------------------------------------------------------------
# gather: the visible rows of each query into a contiguous scratch (sgemm path)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def gather_rows_kernel(page_size, defect=None):
    """``rows[q, t, :] = pages[page_table[q, t // P], t % P, :]`` for ``t < vis[q]``.

    pages [num_pages, P, W] float32 / float16; page_table [Q, max_pages]
    int32; vis [Q] int32 (rows past it neither read nor written); rows [Q, L,
    W], the pages' dtype (out; copied element for element: bit-exact).
    Grid (X, Q): block x of query q copies rows x, x + X, ...; threads stride
    over W. ``defect`` "page_off_by_one" (``READ_DEFECTS``) reads page
    ``(entry + 1) % num_pages``.
    """
    if defect not in (None,) + READ_DEFECTS:
        raise ValueError(f"defect: expected one of {READ_DEFECTS} or None, got {defect!r}")
    P = int(page_size)
    if P < 1:
        raise ValueError(f"page_size: expected a page size >= 1, got {page_size}")
    SHIFT = defect == "page_off_by_one"

    def kernel(pages, page_table, vis, rows):
        q = cuda.blockIdx.y
        width = rows.shape[2]
        for t in range(cuda.blockIdx.x, vis[q], cuda.gridDim.x):
            page = page_table[q, t // P]
            if SHIFT:  # the neighbouring page, kept in bounds
                page = (page + 1) % pages.shape[0]
            off = t % P
            for d in range(cuda.threadIdx.x, width, cuda.blockDim.x):
                rows[q, t, d] = pages[page, off, d]

    kernel.__name__ = kernel.__qualname__ = f"mla_gather_rows_p{P}" + (
        "" if defect is None else "_" + defect)
    return jit(kernel)


def launch_gather(d_pages, d_page_table, d_vis, d_rows, stream, defect=None):
    """Enqueue ``gather_rows_kernel`` for every query of ``d_rows`` [Q, L, W]
    (device arrays, no validation; L = the largest visible length)."""
    n_q, n_rows, width = (int(s) for s in d_rows.shape)
    if n_q == 0 or n_rows == 0:
        return
    # the simulator starts a Python thread per CUDA thread: few, long blocks there
    blocks = 1 if SIMULATOR else min(n_rows, 1024)
    gather_rows_kernel(int(d_pages.shape[1]), defect)[(blocks, n_q), K._threads(width, 128),
                                                      stream](
        d_pages, d_page_table, d_vis, d_rows)


# ---------------------------------------------------------------------------
# paged append
# ---------------------------------------------------------------------------


def place_row(page_table, lengths, b, i, page_size, n_pages, shift):
    """Device: ``(ok, page, off)`` of row ``i`` appended to sequence ``b``
    (position ``lengths[b] + i``: row ``off`` of page ``page``); ``ok`` False
    for a negative length, a position past the table or a page outside ``[0,
    n_pages)``. ``shift``: the planted ``append_page_off_by_one`` (the next
    page, kept in bounds)."""
    p = lengths[b] + i
    ok = lengths[b] >= 0 and p < page_table.shape[1] * page_size
    page = 0
    if ok:
        page = page_table[b, p // page_size]
        if shift:
            page = (page + 1) % n_pages
        ok = page >= 0 and page < n_pages
    return ok, page, p % page_size


place_row = device_fn(place_row)


def count_row(flag, b):
    """Device: count a row that cannot be placed in an append's ``flag`` [2]
    (``[rows not written, lowest sequence at fault]``), once a block."""
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(flag, 0, 1)
        cuda.atomic.min(flag, 1, b)


count_row = device_fn(count_row)


@functools.lru_cache(maxsize=None)
def paged_append_kernel(defect=None, checked=False):
    """Kernel ``(new_rows, cache, page_table, lengths, n_new[, flag])``.

    new_rows [B, T, W]; cache [num_pages, P, W] (written in place), same
    dtype; page_table [B, max_pages] int32; lengths [B] int32 (positions
    cached before the append; not modified); n_new [B] int32: rows of sequence
    b to write (``i < n_new[b]``). Row i of sequence b goes to position ``p =
    lengths[b] + i``: row ``p % P`` of page ``page_table[b, p // P]``, element
    for element. Grid (T, B); threads stride over W. ``checked``: a last
    argument ``flag`` [2] int32; a row whose length is negative, whose
    position is past the table or whose page is outside ``[0, num_pages)`` is
    not written and counted (``flag[0] += 1``, ``flag[1] = min(flag[1], b)``).
    Only the entries of written positions are read.
    """
    if defect not in (None,) + APPEND_DEFECTS:
        raise ValueError(f"defect: expected one of {APPEND_DEFECTS} or None, got {defect!r}")
    SHIFT = defect == "append_page_off_by_one"

    def copy_row(new_rows, cache, b, i, page, off):
        for d in range(cuda.threadIdx.x, cache.shape[2], cuda.blockDim.x):
            cache[page, off, d] = new_rows[b, i, d]

    copy_row = device_fn(copy_row)

    if checked:
        def kernel(new_rows, cache, page_table, lengths, n_new, flag):
            i = cuda.blockIdx.x
            b = cuda.blockIdx.y
            if i >= n_new[b]:
                return
            ok, page, off = place_row(page_table, lengths, b, i, cache.shape[1],
                                      cache.shape[0], SHIFT)
            if not ok:  # the whole block agrees: no barrier is skipped by part of it
                count_row(flag, b)
                return
            copy_row(new_rows, cache, b, i, page, off)
    else:
        def kernel(new_rows, cache, page_table, lengths, n_new):
            i = cuda.blockIdx.x
            b = cuda.blockIdx.y
            if i >= n_new[b]:
                return
            ok, page, off = place_row(page_table, lengths, b, i, cache.shape[1],
                                      cache.shape[0], SHIFT)
            if ok:  # (the host checked every row: always)
                copy_row(new_rows, cache, b, i, page, off)

    kernel.__name__ = kernel.__qualname__ = "mla_paged_append" + (
        "_checked" if checked else "") + ("" if defect is None else "_" + defect)
    return jit(kernel)


def _host_counts(name, x, count, hi=None):
    """Host ints [count], each >= 0 (and <= hi): int64 copy."""
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.shape[0] != count:
        raise checks.ShapeError(f"{name}: expected shape [B={count}], got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise checks.DTypeError(f"{name}: expected integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr > (np.iinfo(np.int32).max if hi is None else hi)))
    if bad.size:
        b = int(bad[0])
        what = ">= 0" if hi is None else f"in [0, T={hi}]"
        raise checks.RangeError(f"{name}: expected values {what}, got {name}[{b}]={int(arr[b])}")
    return arr


def append_counts(n_b, t_new, lengths, n_new, table, flag, *, page_size, n_pages, max_pages,
                  max_seq=None):
    """The host side an append of ``t_new`` rows to ``n_b`` sequences shares
    (``paged_append_latent``, ``mla.fp8_append.fp8_append_latent``): ``lengths``
    and ``n_new`` checked (host: values; device: shape and dtype); with both on
    the host, the capacity (``max_seq``: a contiguous cache's rows, else the
    table's ``max_pages * page_size``) and, with a host ``table``, every page
    written; a ``flag`` [2] int32. Returns ``(lens, counts, host, checked)``:
    int64 host copies (None where on the device), which of lengths / n_new /
    table are on the host, and whether the checked kernel must run."""
    host = {"lengths": isinstance(lengths, (np.ndarray, list, tuple)),
            "n_new": n_new is None or isinstance(n_new, (np.ndarray, list, tuple)),
            "page_table": is_host_array(table)}
    lens = counts = None
    if host["lengths"]:
        lens = _host_counts("lengths", lengths, n_b)
    else:
        checks.check_array("lengths", lengths, (("B", n_b),), dtypes=(np.int32,))
    if n_new is None:
        counts = np.full(n_b, t_new, np.int64)
    elif host["n_new"]:
        counts = _host_counts("n_new", n_new, n_b, hi=t_new)
    else:
        checks.check_array("n_new", n_new, (("B", n_b),), dtypes=(np.int32,))
    if host["lengths"] and host["n_new"]:
        if max_seq is not None:
            over = np.flatnonzero(lens + counts > max_seq)
            if over.size:
                b = int(over[0])
                raise checks.RangeError(
                    f"lengths: sequence {b} has lengths[{b}]={int(lens[b])} plus "
                    f"{int(counts[b])} new rows, past the cache's max_seq={max_seq}")
        else:
            _check_capacity(lens, counts, page_size, max_pages)
            if host["page_table"]:
                _check_pages(lens, np.asarray(table), counts, page_size, n_pages)
    checked = flag is not None or not all(host.values())
    if flag is not None:
        checks.check_array("flag", flag, (("2", 2),), dtypes=(np.int32,))
    return lens, counts, host, checked


def append_device_args(lens, counts, host, lengths, n_new, checked, flag, stream):
    """``(d_lengths, d_n_new, d_flag)`` of ``append_counts``' results: the host
    copies staged as int32, device arrays as given; ``d_flag`` None unless
    ``checked`` (a fresh ``APPEND_FLAG_CLEAR`` unless ``flag`` is given)."""
    d_lens = to_device(lens.astype(np.int32), stream) if host["lengths"] else to_device(lengths)
    d_counts = (to_device(counts.astype(np.int32), stream) if host["n_new"]
                else to_device(n_new))
    d_flag = None
    if checked:
        d_flag = (to_device(np.array(APPEND_FLAG_CLEAR, np.int32), stream) if flag is None
                  else to_device(flag, stream))
    return d_lens, d_counts, d_flag


def append_result(checked, flag, d_flag, stream):
    """Copy a host ``flag`` back, finish the call (``finish``) and return what an
    append returns: None unchecked, else the flag (host or device)."""
    if checked and is_host_array(flag):
        d_flag.copy_to_host(flag, stream=launch_stream(stream))
    finish(stream)
    if not checked:
        return None
    return flag if is_host_array(flag) else d_flag


def paged_append_latent(new_rows, cache, page_table, lengths, *, n_new=None, stream=None,
                        flag=None, defect=None):
    """Append rows ``[c_kv | k_pe]`` to B sequences of a paged latent cache, in one launch.

    new_rows:   [B, T, r + d_rope], the cache's dtype; T >= 1
    cache:      [num_pages, page_size, r + d_rope] float32 or float16; a numpy
                cache is updated in place (copied to the device and back), a
                device array written in place
    page_table: [B, max_pages] int32
    lengths:    [B] ints, positions cached before the append (not modified:
                the caller advances them)
    n_new:      optional [B] ints in [0, T]: rows of sequence b to write (its
                first ``n_new[b]`` of ``new_rows[b]``); default T each
    Row i of sequence b lands at position ``lengths[b] + i``, element for
    element (bit-exact); no other byte of the cache is written.

    Everything is validated before any copy or launch (named errors). With
    host (numpy / list) ``lengths``, ``n_new`` and a numpy ``page_table`` the
    lengths, the table's capacity, every page written (in ``[0,
    num_pages)``) and the rows (none written twice) are checked here and the
    call returns None. With any of them on the device (not copied back) the
    checked kernel runs: a row that cannot be placed is not written and is
    counted in the device ``flag`` [2] int32 (``[rows not written, lowest
    sequence at fault]``; a fresh ``[0, 2**31 - 1]`` unless ``flag`` is given,
    which then accumulates), which the call returns; read it once the stream's
    work is done. A ``flag`` given with host arrays selects the checked kernel
    too. ``defect``: ``APPEND_DEFECTS`` (falsification suite only) or None.
    """
    if defect not in (None,) + APPEND_DEFECTS:
        raise ValueError(f"defect: expected one of {APPEND_DEFECTS} or None, got {defect!r}")
    n_pages, page_size, width = check_paged_cache("cache", cache)
    n_b, t_new, _ = checks.check_array("new_rows", new_rows, (("B", None), ("T", None),
                                                               ("r+d_rope", width)),
                                       dtypes=(checks._dtype(cache),))
    if t_new < 1:
        raise checks.RangeError(f"new_rows: expected T >= 1 new rows a sequence, got T={t_new}")
    if n_b > _MAX_GRID_Y:
        raise checks.RangeError(f"new_rows: expected B <= {_MAX_GRID_Y} sequences, got {n_b}")
    max_pages = check_page_table(page_table, n_b, None, page_size, n_pages)
    lens, counts, host, checked = append_counts(n_b, t_new, lengths, n_new, page_table, flag,
                                                page_size=page_size, n_pages=n_pages,
                                                max_pages=max_pages)
    if n_b == 0:
        return flag if checked else None

    st = launch_stream(stream)
    d_cache = to_device(cache, stream)
    d_lens, d_counts, d_flag = append_device_args(lens, counts, host, lengths, n_new, checked,
                                                  flag, stream)
    args = [to_device(new_rows, stream), d_cache, to_device(page_table, stream), d_lens,
            d_counts] + ([d_flag] if checked else [])
    paged_append_kernel(defect, checked)[(t_new, n_b), K._threads(width, 128), st](*args)
    if is_host_array(cache):
        d_cache.copy_to_host(cache, stream=st)
    return append_result(checked, flag, d_flag, stream)
