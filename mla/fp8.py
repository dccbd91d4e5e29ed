"""FP8 latent cache for MLA decode: the row format, its scales and the numpy reference.

Row format (one cached position, ``row_bytes(r, d_rope) = r + 2 d_rope`` bytes,
uint8; 640 bytes at DeepSeek-V3's r 512, d_rope 64):

    bytes 0 .. r - 1          c_kv as OCP e4m3 codes (``attention.cache.fp8``'s
                              encoding: round to nearest even, saturation at
                              +-448, never NaN from a finite value)
    bytes r .. r + 2 d_rope   k_pe as float16, little-endian (RoPE stays 16-bit,
                              as in FlashMLA's fp8 layout)

Caches (C-contiguous uint8): contiguous ``[B, max_seq, RB]`` (sequence b in
slot b, as ``mla_decode``'s 16-bit cache) or paged ``[num_pages, page_size,
RB]`` with ``mla.paged``'s page table.

Scales (the value meant by code ``c`` of a row is ``e4m3(c) * s``), float32:

* ``"tensor"``: one scale for the whole cache, an array ``[1]`` given by the
  caller (> 0, finite); ``code = e4m3(c_kv / s)``;
* ``"token"``: one scale a cached row, ``[B, max_seq]`` (contiguous) or
  ``[num_pages, page_size]`` (paged), computed by the append as ``amax / 448``
  over the row's r c_kv values (NaN counted as 0); an all-zero row gets scale 0
  and codes 0, never NaN. MLA has one latent "head", so this is the per-(token,
  head) mode of ``attention.cache.fp8``.

What the decode attends (``mla.mma``'s fp8 mode): per token each c_kv value
dequantized in float32, ``fl32(e4m3(c) * s)`` (one rounding), then rounded to
float16 (to nearest even) into the tensor-core tile, the same operand rounding
as the 16-bit cache path; per tensor the codes' values (exact in float16), with
``s`` applied to the scores' c_kv part and to the output instead. k_pe as
stored. ``dequantize(..., rounded=True)`` gives the per-token operands (and,
for a power-of-two tensor scale, values the per-tensor decode's results equal
bit for bit); ``rounded=False`` the exact ``e4m3(c) * s`` (float64) the oracle
takes. Values past float16's range (``|e4m3(c) s| > 65504``) would become inf
in a float16 tile: per-token scales of float16-range rows never get there; a
per-tensor scale must keep ``448 s`` below it (``check_tensor_scale``), so that
every dequantized value is a float16 value as in a 16-bit cache, although the
per-tensor decode itself no longer rounds them.
"""

from __future__ import annotations

import numpy as np

from attention.cache.fp8 import E4M3_MAX, decode_e4m3, quantize_rows, row_scales
from attention.core import checks

SCALE_MODES = ("tensor", "token")
FP16_MAX = 65504.0


def row_bytes(rank, d_rope):
    """Bytes of one fp8 latent row: r e4m3 codes and d_rope float16 values."""
    return int(rank) + 2 * int(d_rope)


def check_tensor_scale(name, scale):
    """A host per-tensor scale [1] float32: finite, > 0 and ``448 s <= 65504``
    (every dequantized value a float16 value, as in a 16-bit cache; module
    docstring). Returns it."""
    checks.check_array(name, scale, (("1", 1),), dtypes=(np.float32,))
    s = float(np.asarray(scale)[0])
    if not (np.isfinite(s) and s > 0):
        raise checks.RangeError(f"{name}: expected a finite scale > 0, got {s}")
    if E4M3_MAX * s > FP16_MAX:
        raise checks.RangeError(f"{name}: expected a scale <= {FP16_MAX / E4M3_MAX:.4g} "
                                f"(448 scale must fit float16's 65504), got {s}")
    return scale


def quantize(rows, rank, scale=None, round_to_zero=False):
    """numpy reference of the quantizing append for rows ``[..., r + d_rope]``
    (float32, float16 or bfloat16 values): returns ``(codes uint8 [..., RB],
    scales float32 [...])``. ``scale`` None: per-token scales (``amax / 448``
    of each row's c_kv); else the per-tensor float32 scale (returned broadcast).
    ``round_to_zero``: the planted append defect's rounding."""
    rows = np.asarray(rows, np.float32)
    c_kv, k_pe = rows[..., :rank], rows[..., rank:]
    s = row_scales(c_kv) if scale is None else np.broadcast_to(
        np.float32(np.asarray(scale, np.float32).reshape(-1)[0]), rows.shape[:-1])
    codes = quantize_rows(c_kv, s, round_to_zero)
    with np.errstate(over="ignore"):
        pe = np.ascontiguousarray(k_pe.astype(np.float16)).view(np.uint8)
    return np.concatenate([codes, pe], axis=-1), np.array(s, np.float32)


def dequantize(codes, scales, rank, rounded=False):
    """Values of fp8 latent rows ``codes [..., RB]`` under ``scales`` (``[...]``
    per token, or a scalar / ``[1]`` per tensor): ``[..., r + d_rope]``.

    ``rounded=False``: float64, ``e4m3(c) * s`` exactly (the oracle's cache);
    ``rounded=True``: float32 holding the per-token decode's operands,
    ``fp16(fl32(e4m3(c) * s))`` (module docstring). k_pe is the stored float16
    either way."""
    codes = np.asarray(codes, np.uint8)
    c8 = codes[..., :rank]
    pe = np.ascontiguousarray(codes[..., rank:]).view(np.float16)
    s = np.broadcast_to(np.asarray(scales, np.float32), codes.shape[:-1])[..., None]
    if rounded:
        with np.errstate(over="ignore", invalid="ignore"):
            c = (decode_e4m3(c8) * s).astype(np.float32).astype(np.float16)
        return np.concatenate([c.astype(np.float32), pe.astype(np.float32)], axis=-1)
    c = decode_e4m3(c8).astype(np.float64) * s.astype(np.float64)
    return np.concatenate([c, pe.astype(np.float64)], axis=-1)


def is_fp8(cache):
    """True for a uint8 (fp8 rows) latent cache."""
    return np.dtype(checks._dtype(cache)) == np.uint8


def check_cache(latent_cache, latent_scale, rank, d_rope, *, n_b=None, paged=False):
    """An fp8 latent cache and its scales, checked before any copy or launch.

    latent_cache: uint8, contiguous ``[B=n_b, max_seq, r + 2 d_rope]`` or paged
    ``[num_pages, page_size, r + 2 d_rope]``; latent_scale: float32 ``[1]``
    (per tensor: a host one is checked by ``check_tensor_scale``) or the cache's
    shape without the row axis (per token). Returns ``(mode, dim0, dim1)``:
    "tensor" / "token" and the cache's first two extents."""
    rb = row_bytes(rank, d_rope)
    first = ("num_pages", None) if paged else ("B", n_b)
    second = ("page_size", None) if paged else ("max_seq", None)
    if latent_scale is None:
        raise checks.DTypeError(
            "latent_scale: a uint8 (fp8 e4m3) latent_cache needs its float32 scales: [1] per "
            "tensor or the cache's [.., ..] without the row axis per token (mla.fp8)")
    dim0, dim1, _ = checks.check_array(
        "latent_cache", latent_cache, (first, second, (f"r+2*d_rope={rb} bytes", rb)),
        dtypes=(np.uint8,))
    if paged and (dim0 < 1 or dim1 < 1):
        raise checks.ShapeError(f"latent_cache: expected at least one page of at least one "
                                f"row, got {(dim0, dim1, rb)}")
    shape = tuple(int(x) for x in latent_scale.shape)
    if shape == (1,):
        if isinstance(latent_scale, np.ndarray):  # a device scale is read as it is
            check_tensor_scale("latent_scale", latent_scale)
        else:
            checks.check_array("latent_scale", latent_scale, (("1", 1),), dtypes=(np.float32,))
        return "tensor", dim0, dim1
    checks.check_array("latent_scale", latent_scale,
                       ((first[0], dim0), (second[0], dim1)), dtypes=(np.float32,))
    return "token", dim0, dim1


__all__ = ["FP16_MAX", "SCALE_MODES", "check_cache", "check_tensor_scale", "dequantize",
           "is_fp8", "quantize", "row_bytes"]
