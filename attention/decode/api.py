"""``decode(...)``: decode attention in one call, for numpy users and quick experiments.

Builds a ``DecodePlan`` for the arguments' geometry and dtypes (kept in a small
cache, so repeated calls of one geometry plan once), stages numpy inputs on
the device, runs the plan and returns numpy for numpy inputs. Serving code
that calls decode every step should hold a ``DecodePlan`` and call its
``run``: this function's staging, host checks and cache look-up cost host
time that ``run`` does not.

FP8 e4m3 caches (uint8 codes, ``attention.cache.fp8``) take their scales as
``DecodePlan.run`` does: ``k_scale`` / ``v_scale`` float32, ``[1]`` with
``fp8_scales="tensor"`` (default) or ``[KV_SLOTS, H_kv, max_seq]`` (the cache's
shape without D, as ``fp8_append`` / ``DecodeState`` write them) with
``fp8_scales="token_head"``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from attention.core import checks
from attention.core.device import is_host_array, to_device, to_host
from attention.decode import fast
from attention.decode.plan import DecodePlan, _array_dtype

PLAN_CACHE_SIZE = 8
_PLANS = OrderedDict()  # key -> DecodePlan, most recently used last


def _cached_plan(key, make):
    pl = _PLANS.get(key)
    if pl is None:
        pl = _PLANS[key] = make()
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return pl


def clear_plan_cache():
    """Drop the plans ``decode`` keeps (and their device buffers)."""
    _PLANS.clear()


def plan_for(q, k_cache, *, scale=None, n_split=None, fp8_scales="tensor"):
    """The cached ``DecodePlan`` ``decode`` uses for ``q`` [M, H, D] and
    ``k_cache`` [KV_SLOTS, H_kv, max_seq, D] (call its ``check()`` after
    ``decode(..., stream=s)`` with device lengths); ``fp8_scales`` for uint8
    (fp8 e4m3) caches, as ``DecodePlan``'s."""
    m, h, d = checks.check_array("q", q, (("M", None), ("H", None), ("D", None)),
                                 contiguous=False)
    n_slots, n_kv, max_seq, dk = checks.check_array(
        "k_cache", k_cache, (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None),
                             ("D", None)), contiguous=False)
    qdt, cdt = _array_dtype(q), _array_dtype(k_cache)
    if d != dk:
        raise checks.ShapeError(f"q: expected head_dim D={dk} (k_cache's), got D={d}")
    is_fp8 = cdt == fast.FP8_DTYPE
    if cdt not in fast.CACHE_DTYPES and not is_fp8:
        raise checks.DTypeError(f"k_cache: expected float32, float16, bfloat16 or uint8 (fp8 "
                                f"e4m3 codes), got {cdt}")
    if is_fp8:
        if qdt not in fast.CACHE_DTYPES:
            raise checks.DTypeError(
                f"q: expected float32, float16 or bfloat16 with an fp8 cache, got {qdt}")
    elif qdt not in (np.dtype(np.float32), cdt):
        raise checks.DTypeError(f"q: expected float32 or the cache's {cdt}, got {qdt}")
    _check_fp8_scales(fp8_scales, is_fp8, cdt)
    scale = checks.check_scale(scale, d)
    key = (m, h, n_kv, d, n_slots, max_seq, str(cdt), str(qdt), scale, n_split, fp8_scales)
    return _cached_plan(key, lambda: DecodePlan(
        m, h, n_kv, d, n_slots, max_seq, cache_dtype=cdt, q_dtype=qdt, scale=scale,
        n_split=n_split, fp8_scales=fp8_scales))


def _check_fp8_scales(fp8_scales, is_fp8, cdt):
    if fp8_scales not in fast.FP8_SCALES:
        raise checks.AttentionInputError(
            f"fp8_scales: expected one of {fast.FP8_SCALES}, got {fp8_scales!r}")
    if fp8_scales != "tensor" and not is_fp8:
        raise checks.AttentionInputError(
            f"fp8_scales: {fp8_scales!r} needs an fp8 cache (uint8 e4m3 codes), got k_cache "
            f"dtype {cdt}")


def _check_scales(k_scale, v_scale, k_cache, fp8_scales, lens=None, slots=None):
    """Host checks of ``decode``'s fp8 scales (before any staging or launch):
    both given, float32 of the mode's shape; numpy per-tensor scales finite
    and > 0, numpy per-(token, head) scales finite over every attended row
    (``lens`` / ``slots``: host lengths and slots, when known)."""
    if k_scale is None or v_scale is None:
        want = "[1]" if fp8_scales == "tensor" else "[KV_SLOTS, H_kv, max_seq]"
        raise checks.AttentionInputError(
            f"k_scale, v_scale: an fp8 cache (uint8 e4m3 codes) needs both (float32 {want}, "
            f"fp8_scales={fp8_scales!r})")
    n_slots, n_kv, max_seq = (int(n) for n in k_cache.shape[:3])
    if fp8_scales == "tensor":
        dims, other = (("1", 1),), (n_slots, n_kv, max_seq)
        hint = "per-(token, head) scales need fp8_scales='token_head'"
    else:
        dims, other = (("KV_SLOTS", n_slots), ("H_kv", n_kv), ("max_seq", max_seq)), (1,)
        hint = "per-tensor scales need fp8_scales='tensor'"
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        try:
            checks.check_array(name, x, dims, dtypes=(np.float32,))
        except checks.ShapeError as exc:
            extra = f"; {hint}" if tuple(getattr(x, "shape", ())) == other else ""
            raise checks.ShapeError(f"{exc} (fp8_scales={fp8_scales!r}{extra})") from None
        if not is_host_array(x):
            continue
        if fp8_scales == "tensor":
            v = float(x[0])
            if not (np.isfinite(v) and v > 0):
                raise checks.RangeError(f"{name}: expected a finite scale > 0, got {v}")
        elif lens is not None:
            for m, (n, slot) in enumerate(zip(lens, slots)):
                row = x[int(slot), :, :int(n)]
                if not np.isfinite(row).all():
                    g, p = (int(i[0]) for i in np.nonzero(~np.isfinite(row)))
                    raise checks.RangeError(
                        f"{name}: expected finite scales where rows are attended, got "
                        f"{row[g, p]} at [{int(slot)}, {g}, {p}] (sequence {m}, length {int(n)})")


def decode(q, k_cache, v_cache, seq_lens, slot_table=None, *, scale=None, out=None, lse=None,
           stream=None, return_lse=False, k_scale=None, v_scale=None, fp8_scales="tensor"):
    """Decode attention for M sequences over a pooled KV cache, in one call.

    q:          [M, H, D] float32 (or the cache's dtype); numpy or device array
    k_cache:    [KV_SLOTS, H_kv, max_seq, D] float32, float16 or bfloat16
                (numpy bfloat16: ``ml_dtypes.bfloat16``), or uint8 fp8 e4m3
                codes (K = code * scale; q then float32, float16 or
                bfloat16), KV_SLOTS >= M
    v_cache:    [KV_SLOTS, H_kv, max_seq, D] same dtype as k_cache
    seq_lens:   [M] int: positions 0..seq_lens[m]-1 of the slot are attended
                (0 gives zeros, LSE -inf)
    slot_table: [M] int, the cache slot of sequence m (default ``arange(M)``)
    scale:      default 1/sqrt(D)
    out, lse:   optional [M, H, D] / [M, H] float32 buffers, filled (numpy
                buffers too); numpy for numpy q, device arrays otherwise
    stream:     None: synchronise and ``check()`` before returning; a stream:
                enqueue only (device lengths and slots are then checked by
                ``plan_for(q, k_cache).check()``)
    return_lse: also return lse [M, H]
    k_scale, v_scale: fp8 caches only (required there), float32, numpy or
                device: ``fp8_scales="tensor"`` (default): [1], finite and > 0;
                ``"token_head"``: [KV_SLOTS, H_kv, max_seq], a scale a cached
                row (finite where attended: checked when numpy, with numpy
                lengths)
    fp8_scales: "tensor" or "token_head", as ``DecodePlan``'s
    Returns out (and lse): numpy when q is numpy, else device arrays (the
    plan's buffers when none were given: the next call of this geometry
    overwrites them). Numpy lengths and slots are checked on the host, device
    ones on the device (``RangeError`` naming the argument either way).
    """
    if q is None or not hasattr(q, "shape"):
        raise checks.DTypeError(f"q: expected an array of shape [M, H, D], got "
                                f"{type(q).__name__}")
    m_count = int(q.shape[0]) if len(q.shape) == 3 else None
    host = is_host_array(q)
    is_fp8 = hasattr(k_cache, "dtype") and _array_dtype(k_cache) == fast.FP8_DTYPE
    _check_fp8_scales(fp8_scales, is_fp8, _array_dtype(k_cache)
                      if hasattr(k_cache, "dtype") else None)
    if not is_fp8 and (k_scale is not None or v_scale is not None):
        raise checks.AttentionInputError(
            "k_scale, v_scale: only fp8 caches (uint8 e4m3 codes) take scales")
    if host or is_host_array(k_cache) or is_host_array(seq_lens) or seq_lens is None or \
            isinstance(seq_lens, (list, tuple)):
        # full host-side validation (lengths and slots included) before staging
        _, _, _, _, head_dim, _, lens, slots = fast.check_fast(
            q, k_cache, v_cache, seq_lens, slot_table, fp8=is_fp8)
        if is_fp8:
            _check_scales(k_scale, v_scale, k_cache, fp8_scales, lens, slots)
        scale = checks.check_scale(scale, head_dim)
        if m_count == 0:
            return _empty(q, return_lse)
        pl = plan_for(q, k_cache, scale=scale, fp8_scales=fp8_scales)
        d_lens, d_slots = to_device(lens, stream), to_device(slots, stream)
    else:
        if is_fp8:
            _check_scales(k_scale, v_scale, k_cache, fp8_scales)
        if m_count == 0:
            return _empty(q, return_lse)
        pl = plan_for(q, k_cache, scale=scale, fp8_scales=fp8_scales)
        d_lens = _as_int32_device(seq_lens, "seq_lens")
        d_slots = None if slot_table is None else _as_int32_device(slot_table, "slot_table")
    for name, buf, shape in (("out", out, pl.out_shape), ("lse", lse, pl.lse_shape)):
        if buf is not None:
            checks.check_array(name, buf, tuple((f"d{i}", s) for i, s in enumerate(shape)),
                               dtypes=(np.float32,))
    d_q, d_k, d_v = _stage(q, stream), _stage(k_cache, stream), _stage(v_cache, stream)
    d_out = None if out is None else _stage(out, stream)
    d_lse = None if lse is None else _stage(lse, stream)
    scales = {}
    if is_fp8:
        scales = {"k_scale": _stage(k_scale, stream), "v_scale": _stage(v_scale, stream)}
    res_out = pl.run(d_q, d_k, d_v, d_lens, d_slots, out=d_out, lse=d_lse, stream=stream,
                     **scales)
    res_lse = pl.lse if d_lse is None else d_lse
    if stream is None:
        pl.check()
    if host:
        h_out, h_lse = to_host(res_out, stream), to_host(res_lse, stream)
        if stream is not None:
            from numba import cuda

            cuda.synchronize()  # numpy results are complete when returned
        if out is not None:
            out[...] = h_out
            h_out = out
        if lse is not None:
            lse[...] = h_lse
            h_lse = lse
        return (h_out, h_lse) if return_lse else h_out
    return (res_out, res_lse) if return_lse else res_out



def _stage(x, stream):
    """numpy arrays copied to the device; device arrays (torch included) as they are."""
    return to_device(x, stream) if is_host_array(x) else x


def _as_int32_device(x, name):
    """A device int32 view of ``x``; a device array of another integer dtype is
    a DTypeError (converting it would be a copy the caller did not ask for)."""
    dt = _array_dtype(x)
    if dt != np.int32:
        raise checks.DTypeError(f"{name}: expected int32 device array, got {dt}")
    return x


def _empty(q, return_lse):
    h, d = int(q.shape[1]), int(q.shape[2])
    o, s = np.zeros((0, h, d), np.float32), np.zeros((0, h), np.float32)
    return (o, s) if return_lse else o
