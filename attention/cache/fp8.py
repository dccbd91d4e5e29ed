"""FP8 (e4m3) KV caches: the format and the quantizing append.

Format: OCP e4m3 ("e4m3fn", numpy's ``ml_dtypes.float8_e4m3fn``), stored as
uint8: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. No infinities;
``S.1111.111`` is NaN; the largest finite value is 448, the smallest normal
2^-6, the smallest subnormal 2^-9. Every code decodes exactly to float32
(``decode_e4m3``).

Encoding (``encode_e4m3``, the numpy reference; ``e4m3_code``, the device
function: the same arithmetic, so the two agree bit for bit): round to nearest,
ties to even, and saturate: a finite magnitude of 448 or more gives +-448
(``0x7E`` / ``0xFE``), never NaN; NaN gives ``0x7F``; -0.0 gives ``0x00`` (the
sign is taken as ``x < 0``, false for NaN and -0.0).

Scales (the cache holds ``code``, the value meant is ``decode(code) * scale``):

* per tensor: one float32 ``k_scale`` and one ``v_scale`` (arrays of shape
  ``[1]``), given by the caller; ``code = e4m3(x / scale)``;
* per (token, kv head): a float32 scale a cached row, beside the cache in its
  layout without the D axis (``k_scales`` / ``v_scales``: HND ``[num_pages,
  H_kv, page_size]``, NHD ``[num_pages, page_size, H_kv]``), computed by the
  append as ``amax / 448`` over the row's D values (NaN counted as 0); a row of
  zeros gets scale 0 and codes 0 (no NaN).

``x / scale`` is one float32 division, correctly rounded (the kernels compile
without fast-math).

``fp8_append`` writes T new K/V rows a sequence (fp32, fp16 or bf16) into a
paged uint8 cache (``attention.cache.paged``'s layouts and page table; the
pooled cache ``[KV_SLOTS, H_kv, max_seq, D]`` is HND with a one-column table),
quantized, with their scales in per-token-head mode. One launch, grid ``(T,
M, H_kv)``; nothing else is written.

Planted defect (``defect=``, falsification only): "append_round_to_zero"
rounds magnitudes toward zero instead of to nearest.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from attention.core import checks
from attention.core.warp import block_max
from attention.core.device import (
    BFLOAT16,
    device_fn,
    finish,
    is_host_array,
    jit,
    launch_stream,
    to_device,
)

from .paged import (
    _check_capacity,
    _check_layout,
    _check_pages,
    _host_lengths,
    _page_dims,
    _writeback,
    new_flag,
)

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E4M3_MAX_CODE = 0x7E
MIN_NORMAL = 2.0 ** -6
FP8_DEFECTS = ("append_round_to_zero",)
SCALE_MODES = ("tensor", "token_head")
NEW_DTYPES = (np.float32, np.float16) + (() if BFLOAT16 is None else (BFLOAT16,))
THREADS = 128  # an append block: its warps' maxima meet in block_max
WARPS = THREADS // 32


def _value_table():
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (8 + man) * 2.0 ** (exp - 10.0))
    val = (sign * mag).astype(np.float32)
    val[(exp == 15) & (man == 7)] = np.nan
    return val


E4M3_VALUES = _value_table()  # float32 [256]: the value of each code


def decode_e4m3(codes):
    """float32 values of uint8 e4m3 ``codes`` (any shape; exact)."""
    return E4M3_VALUES[np.asarray(codes, np.uint8)]


def _rne(y):
    """Round half to even of non-negative float64 ``y`` (numpy), as ``_rne_dev``."""
    f = np.floor(y)
    r = y - f
    odd = np.fmod(f, 2.0) == 1.0
    return np.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


def encode_e4m3(x, round_to_zero=False):
    """uint8 e4m3 codes of float32 ``x`` (the module's rounding and saturation).

    The arithmetic is exact but for the one rounding: ``|x|`` scaled by a power
    of two into [8, 16) (normal) or units of 2^-9 (subnormal), then rounded to
    an integer. ``round_to_zero``: the planted defect's rounding (floor)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    neg = x < 0
    code = np.zeros(x.shape, np.int64)
    finite = np.isfinite(a) & (a < E4M3_MAX)
    with np.errstate(all="ignore"):
        sub = finite & (a < MIN_NORMAL)
        norm = finite & ~sub
        rnd = np.floor if round_to_zero else _rne
        code = np.where(sub, rnd(a * 512.0), code)
        e = np.floor(np.log2(np.where(norm, a, 1.0)))
        # log2 of a float32 near a power of two: make 2^e <= a < 2^(e+1) exact
        e = np.where(np.exp2(e) > a, e - 1, e)
        e = np.where(np.exp2(e + 1) <= a, e + 1, e)
        q = rnd(a * np.exp2(3.0 - e))
        code = np.where(norm, (e + 7) * 8 + (q - 8), code)
    code = np.where(finite, np.minimum(code, E4M3_MAX_CODE), E4M3_MAX_CODE)
    code = np.where(np.isnan(a), E4M3_NAN, code)
    return (code + np.where(neg, 0x80, 0)).astype(np.uint8)


def row_scales(rows):
    """Per-row scales of float32 ``rows [..., D]``: ``amax / 448`` in float32
    (NaN counted as 0), shape ``rows.shape[:-1]``."""
    a = np.abs(np.asarray(rows, np.float32))
    a = np.where(np.isnan(a), np.float32(0), a)
    return (a.max(axis=-1) / np.float32(E4M3_MAX)).astype(np.float32)


def quantize_rows(rows, scale, round_to_zero=False):
    """Codes of float32 ``rows [..., D]`` under ``scale`` (a float32 scalar or an
    array of ``rows.shape[:-1]``): ``e4m3(rows / scale)``, and 0 where the scale
    is 0 (a row of zeros)."""
    rows = np.asarray(rows, np.float32)
    s = np.broadcast_to(np.asarray(scale, np.float32), rows.shape[:-1])[..., None]
    with np.errstate(all="ignore"):
        y = (rows / s).astype(np.float32)
    codes = encode_e4m3(y, round_to_zero)
    return np.where(s == 0, np.uint8(0), codes).astype(np.uint8)


# ---------------------------------------------------------------------------
# device
# ---------------------------------------------------------------------------

def _rne_dev(y):
    f = math.floor(y)
    r = y - f
    if r > 0.5 or (r == 0.5 and f - 2.0 * math.floor(f * 0.5) == 1.0):
        return f + 1.0
    return f


_rne_dev = device_fn(_rne_dev)


def _code_dev(x, trunc):
    # the e4m3 code of float32 x (encode_e4m3's arithmetic)
    neg = x < float32(0.0)
    a = abs(x)
    if a != a:
        return int32(E4M3_NAN + (0x80 if neg else 0))
    if a >= float32(E4M3_MAX):
        return int32(E4M3_MAX_CODE + (0x80 if neg else 0))
    if a < float32(MIN_NORMAL):
        y = a * float32(512.0)
        q = math.floor(y) if trunc else _rne_dev(y)
        code = int32(q)
    else:
        e = -6
        p = float32(MIN_NORMAL)
        while a >= p * float32(2.0):
            p *= float32(2.0)
            e += 1
        y = a * (float32(8.0) / p)  # exact: p is a power of two
        q = math.floor(y) if trunc else _rne_dev(y)
        code = int32((e + 7) * 8 + int32(q) - 8)
    code = min(code, int32(E4M3_MAX_CODE))
    return code + (0x80 if neg else 0)


_code_dev = device_fn(_code_dev)


def e4m3_value(c):
    """Device: float32 value of the e4m3 code ``c`` (an integer 0..255)."""
    e = (c >> 3) & 15
    m = c & 7
    if e == 15 and m == 7:
        return float32(math.nan)
    if e == 0:
        v = float32(m) * float32(2.0 ** -9)
    else:
        v = float32(8 + m) * float32(2.0) ** (e - 10)
    return -v if c & 0x80 else v


e4m3_value = device_fn(e4m3_value)


@functools.lru_cache(maxsize=None)
def fp8_append_kernel(layout="HND", per_token=True, defect=None, checked=False):
    """Kernel ``(k_new, v_new, k_pages, v_pages, k_sc, v_sc, page_table, lengths[, flag])``.

    Grid ``(T, M, H_kv)``, one block a (token, sequence, kv head), threads
    striding over D. ``per_token``: ``k_sc`` / ``v_sc`` are the scale arrays
    (the row's scale is computed and written); else ``[1]`` arrays holding the
    per-tensor scales (read). ``checked``: as ``paged.paged_append_kernel``'s,
    a bad token is not written and raises ``flag``."""
    _check_layout(layout)
    if defect not in (None,) + FP8_DEFECTS:
        raise ValueError(f"defect: expected one of {FP8_DEFECTS} or None, got {defect!r}")
    HND = layout == "HND"
    TRUNC = defect == "append_round_to_zero"
    PER_TOKEN = bool(per_token)

    def amax(new, m, i, g):
        # the row's max |x| over D (NaN as 0), shared by the whole block
        red = cuda.shared.array(WARPS, float32)
        a = float32(0.0)
        for d in range(cuda.threadIdx.x, new.shape[3], cuda.blockDim.x):
            v = abs(float32(new[m, i, g, d]))
            if v > a:  # NaN compares false: counted as 0
                a = v
        return block_max(a, red)

    amax = device_fn(amax)

    def write_row(new, pages, sc, m, i, g, page, a, b):
        if PER_TOKEN:
            s = amax(new, m, i, g) / float32(E4M3_MAX)
            if cuda.threadIdx.x == 0:
                sc[page, a, b] = s
        else:
            s = sc[0]
        for d in range(cuda.threadIdx.x, new.shape[3], cuda.blockDim.x):
            code = 0
            if s != float32(0.0):
                code = _code_dev(float32(new[m, i, g, d]) / s, TRUNC)
            pages[page, a, b, d] = code

    write_row = device_fn(write_row)

    def locate(k_pages, page_table, lengths, m, i, g):
        page_size = k_pages.shape[2] if HND else k_pages.shape[1]
        p = lengths[m] + i
        page = page_table[m, p // page_size]
        off = p % page_size
        if HND:
            return page, g, off
        return page, off, g

    locate = device_fn(locate)

    if checked:
        def kernel(k_new, v_new, k_pages, v_pages, k_sc, v_sc, page_table, lengths, flag):
            i = cuda.blockIdx.x
            m = cuda.blockIdx.y
            g = cuda.blockIdx.z
            page_size = k_pages.shape[2] if HND else k_pages.shape[1]
            p = lengths[m] + i
            ok = lengths[m] >= 0 and p < page_table.shape[1] * page_size
            page = 0
            if ok:
                page = page_table[m, p // page_size]
                ok = page >= 0 and page < k_pages.shape[0]
            if not ok:  # the whole block agrees: no barrier is skipped by part of it
                if g == 0 and cuda.threadIdx.x == 0:
                    cuda.atomic.add(flag, 0, 1)
                    cuda.atomic.min(flag, 1, m)
                return
            page, a, b = locate(k_pages, page_table, lengths, m, i, g)
            write_row(k_new, k_pages, k_sc, m, i, g, page, a, b)
            write_row(v_new, v_pages, v_sc, m, i, g, page, a, b)
    else:
        def kernel(k_new, v_new, k_pages, v_pages, k_sc, v_sc, page_table, lengths):
            i = cuda.blockIdx.x
            m = cuda.blockIdx.y
            g = cuda.blockIdx.z
            page, a, b = locate(k_pages, page_table, lengths, m, i, g)
            write_row(k_new, k_pages, k_sc, m, i, g, page, a, b)
            write_row(v_new, v_pages, v_sc, m, i, g, page, a, b)

    kernel.__name__ = ("fp8_append_" + layout + ("_token" if PER_TOKEN else "_tensor")
                       + ("_checked" if checked else "") + ("" if defect is None else "_" + defect))
    return jit(kernel)  # no fast-math: x / scale is a correctly rounded division


def _scale_dims(layout, n_pages, n_kv, page_size):
    if layout == "HND":
        return (("num_pages", n_pages), ("H_kv", n_kv), ("page_size", page_size))
    return (("num_pages", n_pages), ("page_size", page_size), ("H_kv", n_kv))


def fp8_append(k_new, v_new, k_pages, v_pages, page_table, lengths, *, k_scale=None,
               v_scale=None, k_scales=None, v_scales=None, layout="HND", stream=None,
               flag=None, defect=None):
    """Quantize and append T new K/V rows to each of M sequences of an fp8 cache.

    k_new, v_new:     [M, T, H_kv, D] float32, float16 or bfloat16, T >= 1
    k_pages, v_pages: uint8 e4m3 codes, [num_pages, H_kv, page_size, D] ("HND")
                      or [num_pages, page_size, H_kv, D] ("NHD")
    page_table:       [M, max_pages] int32; lengths [M] ints (cached before)
    Per-tensor scales: ``k_scale``, ``v_scale`` float32 [1] (> 0, finite).
    Per-token-head scales: ``k_scales``, ``v_scales`` float32 [num_pages, H_kv,
    page_size] (HND) or [num_pages, page_size, H_kv] (NHD), written for the new
    rows. Exactly one of the two modes.
    Host lengths and table: checked before the launch (as ``paged_append``);
    on the device: the checked kernel and ``flag`` (returned). numpy caches and
    scale arrays are updated in place. Returns the flag (or None).
    """
    _check_layout(layout)
    tensor = k_scale is not None or v_scale is not None
    token = k_scales is not None or v_scales is not None
    if tensor == token:
        raise checks.AttentionInputError(
            "k_scale/v_scale (per tensor) or k_scales/v_scales (per token and head): expected "
            "exactly one of the two scale modes")
    names = ("k_scale", "v_scale") if tensor else ("k_scales", "v_scales")
    k_sc, v_sc = (k_scale, v_scale) if tensor else (k_scales, v_scales)
    for name, x in zip(names, (k_sc, v_sc)):
        if x is None:
            raise checks.AttentionInputError(f"{name}: required with {names[0]}")
    m, t_new, n_kv, d = checks.check_array(
        "k_new", k_new, (("M", None), ("T", None), ("H_kv", None), ("D", None)),
        dtypes=NEW_DTYPES)
    checks.check_array("v_new", v_new, (("M", m), ("T", t_new), ("H_kv", n_kv), ("D", d)),
                       dtypes=NEW_DTYPES)
    checks.check_same_dtype([("k_new", k_new), ("v_new", v_new)])
    if t_new < 1:
        raise checks.ShapeError(f"k_new: expected T >= 1 new tokens, got T={t_new}")
    dims = checks.check_array("k_pages", k_pages, _page_dims(layout, n_kv, None, d),
                              dtypes=(np.uint8,))
    n_pages, page_size = dims[0], (dims[2] if layout == "HND" else dims[1])
    checks.check_array("v_pages", v_pages, _page_dims(layout, n_kv, page_size, d, n_pages),
                       dtypes=(np.uint8,))
    if tensor:
        for name, x in zip(names, (k_sc, v_sc)):
            checks.check_array(name, x, (("1", 1),), dtypes=(np.float32,))
            if is_host_array(x) and not (np.isfinite(x[0]) and x[0] > 0):
                raise checks.RangeError(f"{name}: expected a finite scale > 0, got {x[0]}")
    else:
        for name, x in zip(names, (k_sc, v_sc)):
            checks.check_array(name, x, _scale_dims(layout, n_pages, n_kv, page_size),
                               dtypes=(np.float32,))
    _, max_pages = checks.check_array("page_table", page_table,
                                      (("M", m), ("max_pages", None)), dtypes=(np.int32,))
    host = is_host_array(lengths) and is_host_array(page_table)
    if host:
        lens = _host_lengths(lengths, m)
        _check_capacity(lens, t_new, page_size, max_pages)
        _check_pages(lens, np.asarray(page_table), t_new, page_size, n_pages)
    st = launch_stream(stream)
    arrays = [to_device(x, st) for x in (k_new, v_new, k_pages, v_pages, k_sc, v_sc,
                                         page_table, lengths)]
    kern = fp8_append_kernel(layout, token, defect, checked=not host)
    args = list(arrays)
    out_flag = None
    if not host:
        out_flag = new_flag(st) if flag is None else flag
        args.append(out_flag)
    kern[(t_new, m, n_kv), THREADS, st](*args)
    for x, dev in zip((k_pages, v_pages, k_sc, v_sc), arrays[2:6]):
        if is_host_array(x):
            _writeback(x, dev, stream)
    finish(stream)
    return out_flag


def quantize_append_ref(k_new, k_pages, k_scales, page_table, lengths, *, scale=None,
                        layout="HND", round_to_zero=False):
    """numpy reference of one of ``fp8_append``'s halves (K or V), in place on
    host copies: ``k_pages`` (uint8) and, per token and head, ``k_scales``
    (``scale`` None), or the per-tensor ``scale``."""
    k_new = np.asarray(k_new, np.float32)
    m_count, t_new, n_kv, _ = k_new.shape
    page_size = k_pages.shape[2] if layout == "HND" else k_pages.shape[1]
    for m in range(m_count):
        for i in range(t_new):
            p = int(lengths[m]) + i
            page, off = int(page_table[m, p // page_size]), p % page_size
            for g in range(n_kv):
                row = k_new[m, i, g]
                s = row_scales(row) if scale is None else np.float32(scale)
                idx = (page, g, off) if layout == "HND" else (page, off, g)
                if scale is None:
                    k_scales[idx] = s
                k_pages[idx] = quantize_rows(row, s, round_to_zero)
    return k_pages, k_scales
