"""Quantizing append into MLA's fp8 latent cache (the format: ``mla.fp8``).

``fp8_append_latent`` writes T new rows ``[c_kv | k_pe]`` a sequence into an
fp8 latent cache, one launch: each row becomes ``row_bytes(r, d_rope) = r + 2
d_rope`` bytes, the r e4m3 codes of c_kv then the d_rope float16 values of k_pe
(little-endian), exactly as ``mla.fp8.quantize`` (the numpy reference, matched
bit for bit):

    new_rows    [B, T, r + d_rope] float32 or float16, T >= 1
    cache       uint8, paged ``[num_pages, P, RB]`` with ``page_table [B,
                max_pages]`` int32 (``mla.paged``'s table: position p of
                sequence b is row ``p % P`` of page ``page_table[b, p // P]``),
                or contiguous ``[B, max_seq, RB]`` (``page_table=None``:
                sequence b in slot b, one page of max_seq rows a sequence)
    lengths     [B] ints: positions cached before the append (not modified)
    n_new       optional [B] ints in [0, T]: rows of sequence b written

r and d_rope come from the widths: ``W = r + d_rope`` (new_rows) and ``RB = r +
2 d_rope`` (cache) give ``d_rope = RB - W``, ``r = 2 W - RB`` (r >= 1, d_rope >=
0). RB must be a multiple of 16: the decode reads a row as 16-byte chunks.

Scales (exactly one mode):

* ``scale=``: per tensor, float32 ``[1]`` (finite, > 0, ``448 s <= 65504``:
  ``mla.fp8.check_tensor_scale``), read; ``code = e4m3(c_kv / s)``;
* ``scales=``: per token, float32 ``[num_pages, P]`` (``cache.shape[:2]``),
  written for the new rows: ``s = amax / 448`` over the row's r c_kv values
  (NaN as 0, one block reduction); a zero row gets scale 0 and codes 0.

The encoder is ``attention.cache.fp8``'s device ``_code_dev`` (round to nearest
even, saturation at +-448, never NaN from a finite value); ``x / s`` is one
correctly rounded float32 division (the kernel compiles without fast-math).
k_pe: float16 of the float32 value, round to nearest even (``mma16.ops("f16")``'s
pack: ``cvt.rn`` on a GPU; a NaN's payload is not specified).

Checks: everything named (``attention.core.checks``) before any copy or launch
(shapes, dtypes, the widths, the scale mode and a host tensor scale); with host
``lengths``, ``n_new`` (numpy / list) and table (numpy, or the contiguous
cache's implicit one) the lengths, the capacity, every page written and no row
written twice are checked on the host too, and the call returns None. With any
of them on the device, or a ``flag`` given, the checked kernel runs: a row
that cannot be placed (negative length, position past the table, page outside
``[0, num_pages)``) is not written and counted in the device ``flag`` [2] int32
(``[rows not written, lowest sequence at fault]``, fresh ``[0, 2**31 - 1]``
unless given), which is returned, as ``mla.paged.paged_append_latent``. numpy
caches and scales are updated in place; no other byte of them is written.

Planted defect (``defect=``, falsification only; ``FP8_APPEND_DEFECTS``):
"append_round_to_zero" rounds code magnitudes toward zero instead of to nearest
(``quantize(..., round_to_zero=True)`` is its reference).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from attention.cache.fp8 import E4M3_MAX, _code_dev
from attention.core import checks
from attention.core.device import (
    device_fn,
    is_host_array,
    jit,
    launch_stream,
    to_device,
)
from attention.core.warp import block_max
from attention.gemm import mma16

from .fp8 import check_tensor_scale
from .paged import (
    _MAX_GRID_Y,
    append_counts,
    append_device_args,
    append_result,
    check_page_table,
    count_row,
    place_row,
)

FP8_APPEND_DEFECTS = ("append_round_to_zero",)
NEW_DTYPES = (np.float32, np.float16)
ROW_ALIGN = 16  # bytes: the decode reads a cached row as 16-byte chunks
THREADS = 128  # a block: its warps' maxima meet in block_max
WARPS = THREADS // 32


def _check_defect(defect):
    if defect not in (None,) + FP8_APPEND_DEFECTS:
        raise ValueError(f"defect: expected one of {FP8_APPEND_DEFECTS} or None, got {defect!r}")


@functools.lru_cache(maxsize=None)
def fp8_append_kernel(per_token, defect=None, checked=False):
    """Kernel ``(new_rows, cache, sc, page_table, lengths, n_new[, flag])``.

    new_rows [B, T, W] float32 / float16; cache [num_pages, P, RB] uint8
    (written in place; r = 2 W - RB, d_rope = RB - W); ``sc``: ``per_token``
    scales [num_pages, P] float32 (written), else the tensor scale [1] float32
    (read); page_table [B, max_pages] int32; lengths, n_new [B] int32. Row i <
    n_new[b] of sequence b goes to position ``p = lengths[b] + i``: row ``p %
    P`` of page ``page_table[b, p // P]``. Grid (T, B), one block a row,
    ``THREADS`` (128) threads striding over the row. ``checked``: a
    last argument ``flag`` [2] int32; a row that cannot be placed is not
    written and counted (``flag[0] += 1``, ``flag[1] = min(flag[1], b)``).
    """
    _check_defect(defect)
    PER_TOKEN = bool(per_token)
    TRUNC = defect == "append_round_to_zero"
    pack = mma16.ops("f16")[1]

    def amax(new_rows, b, i, rank):
        # max |c_kv| of the row (NaN as 0), the same value in every thread
        red = cuda.shared.array(WARPS, float32)
        a = float32(0.0)
        for d in range(cuda.threadIdx.x, rank, cuda.blockDim.x):
            v = abs(float32(new_rows[b, i, d]))
            if v > a:  # NaN compares false: counted as 0
                a = v
        return block_max(a, red)

    amax = device_fn(amax)

    def write_row(new_rows, cache, sc, b, i, page, off):
        width = new_rows.shape[2]
        rank = 2 * width - cache.shape[2]
        if PER_TOKEN:
            s = amax(new_rows, b, i, rank) / float32(E4M3_MAX)
            if cuda.threadIdx.x == 0:
                sc[page, off] = s
        else:
            s = sc[0]
        for d in range(cuda.threadIdx.x, rank, cuda.blockDim.x):
            code = 0
            if s != float32(0.0):
                code = _code_dev(float32(new_rows[b, i, d]) / s, TRUNC)
            cache[page, off, d] = code
        for j in range(cuda.threadIdx.x, width - rank, cuda.blockDim.x):
            bits = pack(float32(new_rows[b, i, rank + j]), float32(0.0))
            cache[page, off, rank + 2 * j] = bits & 0xFF
            cache[page, off, rank + 2 * j + 1] = (bits >> 8) & 0xFF

    write_row = device_fn(write_row)

    if checked:
        def kernel(new_rows, cache, sc, page_table, lengths, n_new, flag):
            i = cuda.blockIdx.x
            b = cuda.blockIdx.y
            if i >= n_new[b]:
                return
            ok, page, off = place_row(page_table, lengths, b, i, cache.shape[1],
                                      cache.shape[0], False)
            if not ok:  # the whole block agrees: no barrier is skipped by part of it
                count_row(flag, b)
                return
            write_row(new_rows, cache, sc, b, i, page, off)
    else:
        def kernel(new_rows, cache, sc, page_table, lengths, n_new):
            i = cuda.blockIdx.x
            b = cuda.blockIdx.y
            if i >= n_new[b]:
                return
            ok, page, off = place_row(page_table, lengths, b, i, cache.shape[1],
                                      cache.shape[0], False)
            if ok:  # (the host checked every row: always)
                write_row(new_rows, cache, sc, b, i, page, off)

    kernel.__name__ = kernel.__qualname__ = (
        "mla_fp8_append" + ("_token" if PER_TOKEN else "_tensor")
        + ("_checked" if checked else "") + ("" if defect is None else "_" + defect))
    return jit(kernel)  # no fast-math: x / s is a correctly rounded division


def _widths(width, row_bytes_):
    """(r, d_rope) of new rows of ``width`` values and cache rows of
    ``row_bytes_`` bytes, checked."""
    if row_bytes_ % ROW_ALIGN:
        raise checks.ShapeError(
            f"cache: expected a row of RB bytes a multiple of {ROW_ALIGN} (the decode reads "
            f"rows as 16-byte chunks), got RB={row_bytes_}")
    d_rope, rank = row_bytes_ - width, 2 * width - row_bytes_
    if d_rope < 0 or rank < 1:
        raise checks.ShapeError(
            f"new_rows: expected r + d_rope values a row for the cache's RB={row_bytes_} "
            f"bytes (r + 2 d_rope), with r >= 1 and d_rope >= 0; got W={width}: r = 2W - RB "
            f"= {rank}, d_rope = RB - W = {d_rope}")
    return rank, d_rope


def fp8_append_latent(new_rows, cache, page_table, lengths, *, scales=None, scale=None,
                      n_new=None, stream=None, flag=None, defect=None):
    """Quantize rows ``[c_kv | k_pe]`` and append them to B sequences of an fp8
    latent cache, in one launch.

    new_rows:   [B, T, r + d_rope] float32 or float16; T >= 1
    cache:      uint8, paged [num_pages, page_size, RB] (``page_table`` [B,
                max_pages] int32) or, with ``page_table=None``, contiguous [B,
                max_seq, RB] (sequence b in slot b); RB = r + 2 d_rope, a
                multiple of 16
    lengths:    [B] ints, positions cached before the append (not modified)
    scales:     per-token mode: float32 [num_pages, page_size] (or [B,
                max_seq]), written for the new rows
    scale:      per-tensor mode: float32 [1] (finite, > 0, 448 s <= 65504)
    n_new:      optional [B] ints in [0, T] (rows of sequence b written);
                default T each
    Exactly one of ``scales`` / ``scale``. Row i of sequence b lands at
    position ``lengths[b] + i`` as ``mla.fp8.quantize`` gives it; nothing else
    is written. Checks and the return value (None on the host-checked path,
    else the device ``flag`` [2] int32) as ``mla.paged.paged_append_latent``:
    module docstring. ``defect``: ``FP8_APPEND_DEFECTS`` or None.
    """
    _check_defect(defect)
    contiguous = page_table is None
    dims = ((("B", None), ("max_seq", None), ("RB", None)) if contiguous
            else (("num_pages", None), ("page_size", None), ("RB", None)))
    n_pages, page_size, rb = checks.check_array("cache", cache, dims, dtypes=(np.uint8,))
    if n_pages < 1 or page_size < 1:
        raise checks.ShapeError(f"cache: expected at least one page of at least one row, got "
                                f"shape {(n_pages, page_size, rb)}")
    n_b, t_new, width = checks.check_array(
        "new_rows", new_rows, (("B", n_pages if contiguous else None), ("T", None),
                               ("r+d_rope", None)), dtypes=NEW_DTYPES)
    _widths(width, rb)
    if t_new < 1:
        raise checks.RangeError(f"new_rows: expected T >= 1 new rows a sequence, got T={t_new}")
    if n_b > _MAX_GRID_Y:
        raise checks.RangeError(f"new_rows: expected B <= {_MAX_GRID_Y} sequences, got {n_b}")

    if (scales is None) == (scale is None):
        raise checks.AttentionInputError(
            "scale (per tensor, [1]) or scales (per token, cache.shape[:2]): expected exactly "
            "one of the two scale modes")
    per_token = scales is not None
    if per_token:
        sc_dims = ((("B", n_pages), ("max_seq", page_size)) if contiguous
                   else (("num_pages", n_pages), ("page_size", page_size)))
        checks.check_array("scales", scales, sc_dims, dtypes=(np.float32,))
        sc = scales
    elif is_host_array(scale):
        sc = check_tensor_scale("scale", scale)
    else:
        checks.check_array("scale", scale, (("1", 1),), dtypes=(np.float32,))
        sc = scale

    if contiguous:
        table, max_pages = np.arange(n_b, dtype=np.int32)[:, None], 1
    else:
        table = page_table
        max_pages = check_page_table(page_table, n_b, None, page_size, n_pages)
    lens, counts, host, checked = append_counts(
        n_b, t_new, lengths, n_new, table, flag, page_size=page_size, n_pages=n_pages,
        max_pages=max_pages, max_seq=page_size if contiguous else None)
    if n_b == 0:
        return flag if checked else None

    st = launch_stream(stream)
    d_cache = to_device(cache, stream)
    d_sc = to_device(sc, stream)
    d_lens, d_counts, d_flag = append_device_args(lens, counts, host, lengths, n_new, checked,
                                                  flag, stream)
    args = [to_device(new_rows, stream), d_cache, d_sc, to_device(table, stream), d_lens,
            d_counts] + ([d_flag] if checked else [])
    kern = fp8_append_kernel(per_token, defect, checked)
    kern[(t_new, n_b), THREADS, st](*args)
    if is_host_array(cache):
        d_cache.copy_to_host(cache, stream=st)
    if per_token and is_host_array(scales):
        d_sc.copy_to_host(scales, stream=st)
    return append_result(checked, flag, d_flag, stream)


__all__ = ["FP8_APPEND_DEFECTS", "fp8_append_kernel", "fp8_append_latent"]
