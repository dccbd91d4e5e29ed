"""Paged KV-cache append: every sequence's new K/V rows written in one launch.

Layouts (C-contiguous), named by ``layout``:
    "HND" (default)  k_pages, v_pages [num_pages, H_kv, page_size, D]
    "NHD"            k_pages, v_pages [num_pages, page_size, H_kv, D]  (vLLM / FlashInfer)
    page_table       [M, max_pages] int32: positions ``j*page_size .. (j+1)*page_size - 1``
                     of sequence m live in page ``page_table[m, j]``
    lengths          [M] int: positions cached per sequence BEFORE this append
    k_new, v_new     [M, T, H_kv, D], the pages' dtype (float32, float16, bfloat16); T >= 1

The pooled contiguous cache ``[KV_SLOTS, H_kv, max_seq, D]`` of
``attention.cache.scatter`` is the "HND" layout with ``page_size = max_seq``
and a page table of one column (``[[slot_0], [slot_1], ...]``).

Semantics: token i of sequence m goes to position ``p = lengths[m] + i``, in
page ``page_table[m, p // page_size]`` at offset ``p % page_size``:

    HND  k_pages[page, g, offset, :] = k_new[m, i, g, :]   (V the same)
    NHD  k_pages[page, offset, g, :] = k_new[m, i, g, :]

Element for element (bit-exact, any dtype the pages have); nothing else is
written, and ``lengths`` is not modified (the caller advances it). Pages may be
shared between sequences (a read-only common prefix) and need not be distinct
or in order; the table entries past a sequence's used pages may hold anything
and are never read. Two tokens must not land on the same row (the host check
refuses it; the device check cannot see it: the result would be a race).

Kernel: grid ``(T, M, H_kv)`` (T on x: a long prefill chunk may pass 65535
tokens), ``min(128, D rounded up to 32)`` threads striding over ``D``.

Checking: with host (numpy) ``lengths`` and ``page_table`` the launcher checks
every length, capacity and used page index before the launch and runs the
unchecked kernel. With either on the device (no host copy allowed) it runs the
checked kernel, which takes a last argument ``flag`` [2] int32: a token whose
length is negative, whose position is past the table (``p >= max_pages *
page_size``) or whose page index is outside ``[0, num_pages)`` is not written
and raises the flag once (``flag[0] += 1`` per token, ``flag[1] = min(flag[1],
m)``); the launcher returns the flag for the caller to read.

Planted defects (``defect=``, falsification suite only; compile-time switches,
the defect-free kernel is unchanged):
    "append_page_off_by_one"  writes into page ``(page_table[m, j] + 1) % num_pages``:
                              the neighbouring page, kept in bounds so that a GPU
                              run corrupts rows instead of faulting
    "append_offset_stride"    addresses the row inside the page with the other
                              layout's strides (an HND row ``(g, offset)`` as the
                              NHD row ``(offset, g)`` and vice versa), kept inside
                              the page; invisible where the layouts coincide
                              (``H_kv == 1`` or ``page_size == 1``)
    "append_behind"           writes token i at ``max(lengths[m] + i - 1, 0)``: one
                              position early, so token 0 overwrites the last cached
                              row, which may sit in a shared prefix page
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    SIMULATOR,
    device_fn,
    finish,
    is_host_array,
    jit,
    launch_stream,
    to_device,
)

PAGED_LAYOUTS = ("HND", "NHD")
APPEND_DEFECTS = ("append_page_off_by_one", "append_offset_stride", "append_behind")
PAGED_DTYPES = (np.float32, np.float16) + (() if BFLOAT16 is None else (BFLOAT16,))

FLAG_CLEAR = (0, 2 ** 31 - 1)  # flag [count of tokens not written, first sequence at fault]
_MAX_GRID_YZ = 65535  # M rides on grid y, H_kv on grid z


def pages_needed(length, page_size):
    """Pages holding ``length`` positions: ``ceil(length / page_size)``."""
    length, page_size = int(length), int(page_size)
    if length < 0:
        raise checks.RangeError(f"length: expected a length >= 0, got {length}")
    if page_size < 1:
        raise checks.RangeError(f"page_size: expected a page size >= 1, got {page_size}")
    return -(-length // page_size)


def _check_layout(layout):
    if layout not in PAGED_LAYOUTS:
        raise checks.LayoutError(f"layout: expected one of {PAGED_LAYOUTS}, got {layout!r}")


@functools.lru_cache(maxsize=None)
def paged_append_kernel(layout="HND", defect=None, checked=False):
    """Kernel ``(k_new, v_new, k_pages, v_pages, page_table, lengths[, flag])``.

    Grid ``(T, M, H_kv)``, threads striding over ``D``. ``checked``: the kernel
    takes a last argument ``flag`` [2] int32 and neither writes nor faults on a
    bad token (negative length, position past the table, page index out of
    range): it raises the flag instead, once per token (from head 0, thread 0).
    The page index is read only for positions that are written.
    """
    _check_layout(layout)
    if defect not in (None,) + APPEND_DEFECTS:
        raise ValueError(f"defect: expected one of {APPEND_DEFECTS} or None, got {defect!r}")
    HND = layout == "HND"
    BEHIND = defect == "append_behind"
    PAGE_SHIFT = defect == "append_page_off_by_one"
    STRIDE = defect == "append_offset_stride"

    def copy_row(k_new, v_new, k_pages, v_pages, m, i, g, page, a, b):
        for d in range(cuda.threadIdx.x, k_new.shape[3], cuda.blockDim.x):
            k_pages[page, a, b, d] = k_new[m, i, g, d]
            v_pages[page, a, b, d] = v_new[m, i, g, d]

    copy_row = device_fn(copy_row)

    def row_index(k_pages, g, off):
        """(a, b): the page's axes 1 and 2 addressing head g at offset off."""
        if HND:
            if STRIDE:  # the NHD flat row (off, g) laid over the HND page
                r = off * k_pages.shape[1] + g
                return r // k_pages.shape[2], r % k_pages.shape[2]
            return g, off
        if STRIDE:  # the HND flat row (g, off) laid over the NHD page
            r = g * k_pages.shape[1] + off
            return r // k_pages.shape[2], r % k_pages.shape[2]
        return off, g

    row_index = device_fn(row_index)

    def position(lengths, m, i):
        p = lengths[m] + i
        if BEHIND:
            p = max(p - 1, 0)
        return p

    position = device_fn(position)

    def page_of(page_table, k_pages, m, col):
        page = page_table[m, col]
        if PAGE_SHIFT:
            page = (page + 1) % k_pages.shape[0]
        return page

    page_of = device_fn(page_of)

    if checked:
        def kernel(k_new, v_new, k_pages, v_pages, page_table, lengths, flag):
            i = cuda.blockIdx.x
            m = cuda.blockIdx.y
            g = cuda.blockIdx.z
            page_size = k_pages.shape[2] if HND else k_pages.shape[1]
            p = position(lengths, m, i)
            ok = lengths[m] >= 0 and p < page_table.shape[1] * page_size
            page = 0
            if ok:
                page = page_of(page_table, k_pages, m, p // page_size)
                ok = page >= 0 and page < k_pages.shape[0]
            if not ok:
                if g == 0 and cuda.threadIdx.x == 0:
                    cuda.atomic.add(flag, 0, 1)
                    cuda.atomic.min(flag, 1, m)
                return
            a, b = row_index(k_pages, g, p % page_size)
            copy_row(k_new, v_new, k_pages, v_pages, m, i, g, page, a, b)
    else:
        def kernel(k_new, v_new, k_pages, v_pages, page_table, lengths):
            i = cuda.blockIdx.x
            m = cuda.blockIdx.y
            g = cuda.blockIdx.z
            page_size = k_pages.shape[2] if HND else k_pages.shape[1]
            p = position(lengths, m, i)
            page = page_of(page_table, k_pages, m, p // page_size)
            a, b = row_index(k_pages, g, p % page_size)
            copy_row(k_new, v_new, k_pages, v_pages, m, i, g, page, a, b)

    kernel.__name__ = "paged_append_" + layout + ("_checked" if checked else "") + (
        "" if defect is None else "_" + defect)
    return jit(kernel)


def _threads(head_dim):
    return int(min(128, max(32, (head_dim + 31) // 32 * 32)))


def new_flag(stream=None):
    """A fresh device flag ``[0, 2**31 - 1]`` (no token flagged)."""
    return to_device(np.array(FLAG_CLEAR, np.int32), stream)


def _page_dims(layout, n_kv=None, page_size=None, head_dim=None, n_pages=None):
    if layout == "HND":
        return (("num_pages", n_pages), ("H_kv", n_kv), ("page_size", page_size), ("D", head_dim))
    return (("num_pages", n_pages), ("page_size", page_size), ("H_kv", n_kv), ("D", head_dim))


def _is_integer(x):
    return np.issubdtype(checks._dtype(x), np.integer)


def _host_lengths(lengths, count):
    """Host lengths: ``[M]`` integers, every one ``>= 0`` (as int64)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.shape[0] != count:
        raise checks.ShapeError(f"lengths: expected shape [M={count}], got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise checks.DTypeError(f"lengths: expected integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        m = int(neg[0])
        raise checks.RangeError(
            f"lengths: expected lengths >= 0, got lengths[{m}]={int(arr[m])}")
    return arr


def _check_capacity(lens, t_new, page_size, max_pages):
    """Every written position inside the table: ``lens + t_new <= capacity``
    (``t_new``: new rows a sequence, one count or an array [M])."""
    capacity = max_pages * page_size
    counts = np.broadcast_to(np.asarray(t_new, np.int64), lens.shape)
    over = np.flatnonzero(lens + counts > capacity)
    if over.size:
        m = int(over[0])
        n = int(counts[m])
        need = pages_needed(int(lens[m]) + n, page_size)
        raise checks.RangeError(
            f"page_table: too short for sequence {m}: lengths[{m}]={int(lens[m])} plus T={n} "
            f"new tokens need {need} pages of page_size={page_size}, the table has "
            f"max_pages={max_pages} (capacity {capacity} positions)")


def _check_pages(lens, table, t_new, page_size, n_pages):
    """Every page index of a written position in ``[0, num_pages)``, and no row
    written twice (pages may be shared: two sequences must not append into one
    row). ``t_new``: new rows a sequence, one count or an array [M]. Reads only
    the columns the append writes."""
    counts = np.broadcast_to(np.asarray(t_new, np.int64), lens.shape)
    width = int(counts.max()) if counts.size else 0
    pos = lens[:, None] + np.arange(width, dtype=np.int64)[None, :]  # [M, T]
    written = np.arange(width)[None, :] < counts[:, None]
    cols = np.where(written, pos // page_size, 0)
    pages = np.take_along_axis(np.asarray(table).astype(np.int64), cols, axis=1)
    bad = np.argwhere(written & ((pages < 0) | (pages >= n_pages)))
    if bad.size:
        m, i = (int(x) for x in bad[0])
        raise checks.RangeError(
            f"page_table: sequence {m} column {int(cols[m, i])} holds page {int(pages[m, i])}, "
            f"expected a page in [0, num_pages={n_pages})")
    rows = (pages * page_size + pos % page_size)[written]
    owner = np.nonzero(written)[0]
    uniq, counts_ = np.unique(rows, return_counts=True)
    if (counts_ > 1).any():
        row = int(uniq[counts_ > 1][0])
        who = sorted({int(x) for x in owner[rows == row]})
        raise checks.RangeError(
            f"page_table: page {row // page_size} offset {row % page_size} is written twice "
            f"(sequences {who}): expected every appended token on its own row")


def _writeback(host, d_arr, stream):
    """A numpy argument is updated in place (copied back after the launch)."""
    if host is None:
        return
    st = launch_stream(stream)
    if BFLOAT16 is not None and not SIMULATOR and host.dtype == BFLOAT16:
        d_arr.view(np.uint16).copy_to_host(host.view(np.uint16), stream=st)
    else:
        d_arr.copy_to_host(host, stream=st)


def paged_append(k_new, v_new, k_pages, v_pages, page_table, lengths, *, layout="HND",
                 stream=None, flag=None, defect=None):
    """Append T new K/V rows to each of M sequences of a paged cache, in one launch.

    k_new, v_new:     [M, T, H_kv, D], T >= 1, the pages' dtype
    k_pages, v_pages: [num_pages, H_kv, page_size, D] ("HND") or
                      [num_pages, page_size, H_kv, D] ("NHD"); numpy pages are
                      updated in place (copied to the device and back), device
                      arrays (numba, ``__cuda_array_interface__``) written in place
    page_table:       [M, max_pages] int32
    lengths:          [M] int, positions cached before the append (not modified)
    layout:           "HND" or "NHD"
    stream:           enqueue on it and return at once; None: synchronise

    Everything is validated before any copy, launch or write (named errors of
    ``attention.core.checks``). With host ``lengths`` (numpy, list) and
    ``page_table`` (numpy) the lengths (``>= 0``), the table's capacity
    (``lengths[m] + T <= max_pages * page_size``), every page index used (in
    ``[0, num_pages)``; entries past the used columns are not looked at) and
    the written rows (no row twice) are checked here too, and the call returns
    None. With either on the device (no host copy is made; host lengths are
    still checked) the kernel checks: the call returns the device ``flag`` [2]
    int32 (a fresh one ``[0, 2**31 - 1]`` unless ``flag`` is given, which then
    accumulates), where ``flag[0]`` counts the tokens not written and
    ``flag[1]`` is the lowest sequence at fault; read it once the stream's work
    is done. A ``flag`` given with host arrays also selects the checked kernel
    (a numpy flag is updated in place and returned).
    """
    _check_layout(layout)
    if defect not in (None,) + APPEND_DEFECTS:
        raise ValueError(f"defect: expected one of {APPEND_DEFECTS} or None, got {defect!r}")
    shape = checks.check_array("k_pages", k_pages, _page_dims(layout), dtypes=PAGED_DTYPES)
    if layout == "HND":
        n_pages, n_kv, page_size, head_dim = shape
    else:
        n_pages, page_size, n_kv, head_dim = shape
    checks.check_array("v_pages", v_pages,
                       _page_dims(layout, n_kv, page_size, head_dim, n_pages),
                       dtypes=(k_pages.dtype,))
    if page_size < 1:
        raise checks.RangeError(f"k_pages: expected page_size >= 1, got {page_size}")
    new_dims = (("M", None), ("T", None), ("H_kv", n_kv), ("D", head_dim))
    m_count, t_new = checks.check_array("k_new", k_new, new_dims, dtypes=(k_pages.dtype,))[:2]
    checks.check_array("v_new", v_new, (("M", m_count), ("T", t_new)) + new_dims[2:],
                       dtypes=(k_pages.dtype,))
    if t_new < 1:
        raise checks.RangeError(f"k_new: expected T >= 1 new tokens a sequence, got T={t_new}")
    if m_count > _MAX_GRID_YZ or n_kv > _MAX_GRID_YZ:
        raise checks.RangeError(
            f"k_new: expected M <= {_MAX_GRID_YZ} sequences and H_kv <= {_MAX_GRID_YZ} heads "
            f"(grid y and z), got M={m_count}, H_kv={n_kv}")
    max_pages = checks.check_array("page_table", page_table, (("M", m_count), ("max_pages", None)),
                                   dtypes=(np.int32,), contiguous=False)[1]
    host_lengths = isinstance(lengths, (np.ndarray, list, tuple))
    if host_lengths:
        lens = _host_lengths(lengths, m_count)
        _check_capacity(lens, t_new, page_size, max_pages)
    else:
        checks.check_array("lengths", lengths, (("M", m_count),), contiguous=False)
        if not _is_integer(lengths):
            raise checks.DTypeError(f"lengths: expected integers, got {checks._dtype(lengths)}")
    host_table = is_host_array(page_table)
    if host_lengths and host_table:
        _check_pages(lens, page_table, t_new, page_size, n_pages)
    checked = flag is not None or not (host_lengths and host_table)
    if flag is not None:
        if not hasattr(flag, "shape") or tuple(flag.shape) != (2,):
            raise checks.ShapeError(f"flag: expected shape [2] (tokens not written, first "
                                    f"sequence), got {getattr(flag, 'shape', type(flag))}")
        checks.check_array("flag", flag, (("2", 2),), dtypes=(np.int32,))
    if m_count == 0:
        return flag if checked else None

    st = launch_stream(stream)
    d_k, d_v = to_device(k_pages, stream), to_device(v_pages, stream)
    d_lengths = to_device(lens.astype(np.int32), stream) if host_lengths else to_device(lengths)
    args = [to_device(k_new, stream), to_device(v_new, stream), d_k, d_v,
            to_device(page_table, stream), d_lengths]
    d_flag = None
    if checked:
        d_flag = new_flag(stream) if flag is None else to_device(flag, stream)
        args.append(d_flag)
    paged_append_kernel(layout, defect, checked)[(t_new, m_count, n_kv), _threads(head_dim), st](
        *args)
    _writeback(k_pages if is_host_array(k_pages) else None, d_k, stream)
    _writeback(v_pages if is_host_array(v_pages) else None, d_v, stream)
    if checked and is_host_array(flag):
        _writeback(flag, d_flag, stream)
    finish(stream)
    if not checked:
        return None
    return flag if is_host_array(flag) else d_flag
