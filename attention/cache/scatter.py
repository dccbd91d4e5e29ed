"""KV-cache scatter kernels: write this token's K/V rows into head-first caches.

Layouts (C-contiguous):
    cache (pooled)  [KV_SLOTS, H_kv, max_seq, D]
    cache (single)  [H_kv, max_seq, D]  (a pool of one slot)
    rows            [M, H_kv, D]: row m goes to cache[slot_table[m], :, positions[m], :]

The kernel copies element for element (bit-exact, any dtype the cache has) and
touches nothing else. Grid ``(M, H_kv)``, ``min(D, 128)`` threads striding
over ``D``.

Planted defect (``defect=``, falsification suite only):
    "scatter_pos_plus_one"   writes at ``positions[m] + 1``
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    device_fn,
    finish,
    host_ints,
    is_host_array,
    jit,
    launch_stream,
    to_device,
)

SCATTER_DEFECTS = ("scatter_pos_plus_one",)
SCATTER_DTYPES = (np.float32, np.float16) + (() if BFLOAT16 is None else (BFLOAT16,))


@functools.lru_cache(maxsize=None)
def scatter_kernel(pair, defect=None, checked=False):
    """Kernel writing one tensor (``pair=False``) or K and V together.

    A position ``>= max_seq`` is skipped (``attention.decode.step`` marks
    finished sequences so). ``checked``: the kernel takes a last argument
    ``flag`` [2] int32, and a position outside ``[0, max_seq)`` is not written
    and raises it (``flag[0] += 1``, ``flag[1] = min(flag[1], m)``), for
    callers that cannot check positions on the host
    (``attention.decode.step.DecodeState``).
    """
    if defect not in (None,) + SCATTER_DEFECTS:
        raise ValueError(f"defect: expected one of {SCATTER_DEFECTS} or None, got {defect!r}")
    SHIFT = 1 if defect == "scatter_pos_plus_one" else 0
    PAIR = pair

    def copy_rows(k_rows, v_rows, k_cache, v_cache, m, g, slot, pos):
        for d in range(cuda.threadIdx.x, k_rows.shape[2], cuda.blockDim.x):
            k_cache[slot, g, pos, d] = k_rows[m, g, d]
            if PAIR:
                v_cache[slot, g, pos, d] = v_rows[m, g, d]

    copy_rows = device_fn(copy_rows)

    if checked:
        def kernel(k_rows, v_rows, k_cache, v_cache, positions, slot_table, flag):
            m = cuda.blockIdx.x
            g = cuda.blockIdx.y
            slot = slot_table[m]
            pos = positions[m] + SHIFT
            if pos < 0 or pos >= k_cache.shape[2]:
                if g == 0 and cuda.threadIdx.x == 0:
                    cuda.atomic.add(flag, 0, 1)
                    cuda.atomic.min(flag, 1, m)
                return
            copy_rows(k_rows, v_rows, k_cache, v_cache, m, g, slot, pos)
    else:
        def kernel(k_rows, v_rows, k_cache, v_cache, positions, slot_table):
            m = cuda.blockIdx.x
            g = cuda.blockIdx.y
            slot = slot_table[m]
            pos = positions[m] + SHIFT
            if pos >= k_cache.shape[2]:
                return
            copy_rows(k_rows, v_rows, k_cache, v_cache, m, g, slot, pos)

    kernel.__name__ = "kv_scatter" + ("_pair" if pair else "") + (
        "_checked" if checked else "") + ("" if defect is None else "_" + defect)
    return jit(kernel)


def _threads(head_dim):
    return int(min(128, max(32, (head_dim + 31) // 32 * 32)))


def _positions(name, positions, count, max_seq):
    pos = host_ints(positions)
    if pos.ndim != 1 or pos.shape[0] != count:
        raise checks.ShapeError(f"{name}: expected shape [M={count}], got {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise checks.DTypeError(f"{name}: expected integers, got {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() >= max_seq):
        bad = int(pos[(pos < 0) | (pos >= max_seq)][0])
        raise checks.RangeError(f"{name}: expected positions in [0, max_seq={max_seq}), got {bad}")
    return pos.astype(np.int32)


def _writeback(host_cache, d_cache, stream):
    """numpy caches are updated in place (copied back after the launch)."""
    if host_cache is not None:
        d_cache.copy_to_host(host_cache, stream=launch_stream(stream))


def kv_scatter(src, cache, pos, *, stream=None, defect=None):
    """Write one position's K (or V) into a head-first cache: ``cache[:, pos, :] = src``.

    src:   [H_kv*D] (interleaved heads) or [H_kv, D]
    cache: [H_kv, max_seq, D], same dtype as src; a numpy cache is updated in place
    pos:   int, 0 <= pos < max_seq
    """
    n_kv, max_seq, head_dim = checks.check_array(
        "cache", cache, (("H_kv", None), ("max_seq", None), ("D", None)), dtypes=SCATTER_DTYPES)
    if len(src.shape) == 1:
        checks.check_array("src", src, (("H_kv*D", n_kv * head_dim),), dtypes=(cache.dtype,))
    else:
        checks.check_array("src", src, (("H_kv", n_kv), ("D", head_dim)), dtypes=(cache.dtype,))
    if not isinstance(pos, (int, np.integer)):
        raise checks.DTypeError(f"pos: expected an int, got {type(pos).__name__}")
    checks.check_range("pos", int(pos), 0, max_seq - 1, what="position")
    d_src = to_device(src, stream).reshape((1, n_kv, head_dim))
    d_cache = to_device(cache, stream)
    pooled = d_cache.reshape((1, n_kv, max_seq, head_dim))
    d_pos = to_device(np.array([pos], np.int32), stream)
    d_slot = to_device(np.zeros(1, np.int32), stream)
    scatter_kernel(False, defect)[(1, n_kv), _threads(head_dim), launch_stream(stream)](
        d_src, d_src, pooled, pooled, d_pos, d_slot)
    _writeback(cache if is_host_array(cache) else None, d_cache, stream)
    finish(stream)
    return cache


def batched_kv_scatter(k_new, v_new, k_cache, v_cache, positions, slot_table=None, *,
                       stream=None, defect=None):
    """Write each sequence's new K/V row: ``cache[slot_table[m], :, positions[m], :]``.

    k_new, v_new:     [M, H_kv, D]
    k_cache, v_cache: [KV_SLOTS, H_kv, max_seq, D], dtype of k_new; numpy caches
                      are updated in place
    positions:        [M] int, 0 <= positions[m] < max_seq
    slot_table:       [M] int, distinct slots (default ``arange(M)``)
    """
    n_slots, n_kv, max_seq, head_dim = checks.check_array(
        "k_cache", k_cache, (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", None)),
        dtypes=SCATTER_DTYPES)
    checks.check_array("v_cache", v_cache, (("KV_SLOTS", n_slots), ("H_kv", n_kv),
                                            ("max_seq", max_seq), ("D", head_dim)),
                       dtypes=(k_cache.dtype,))
    m_count = int(k_new.shape[0]) if len(k_new.shape) else -1
    checks.check_array("k_new", k_new, (("M", None), ("H_kv", n_kv), ("D", head_dim)),
                       dtypes=(k_cache.dtype,))
    checks.check_array("v_new", v_new, (("M", m_count), ("H_kv", n_kv), ("D", head_dim)),
                       dtypes=(k_cache.dtype,))
    if m_count > n_slots:
        raise checks.ShapeError(f"k_cache: expected KV_SLOTS >= M={m_count} slots, got {n_slots}")
    pos = _positions("positions", positions, m_count, max_seq)
    slots = checks.check_slot_table(
        None if slot_table is None else host_ints(slot_table), m_count, n_slots, distinct=True)
    if m_count == 0:
        return k_cache, v_cache
    st = launch_stream(stream)
    d_k, d_v = to_device(k_cache, stream), to_device(v_cache, stream)
    scatter_kernel(True, defect)[(m_count, n_kv), _threads(head_dim), st](
        to_device(k_new, stream), to_device(v_new, stream), d_k, d_v,
        to_device(pos, stream), to_device(slots, stream))
    _writeback(k_cache if is_host_array(k_cache) else None, d_k, stream)
    _writeback(v_cache if is_host_array(v_cache) else None, d_v, stream)
    finish(stream)
    return k_cache, v_cache
