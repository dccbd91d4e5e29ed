"""Warp-per-head decode ("incremental") attention: single sequence and batched.

One warp computes one (query head, sequence) pair: lane ``j`` holds elements
``j, j+32, j+64, ...`` of the head (``ceil(D/32)`` per lane, predicated past
``D``), so head_dim 1..256 works, multiples of 32 or not. For each cached
position the warp forms ``q . k`` with a shuffle-down reduction broadcast from
lane 0, applies the online-softmax update of ``attention.core.warp`` and rescales
its fp32 accumulators. The running sum and accumulators take one position at a
time, so they are Kahan-compensated (``compensated_rescale_add``): a plain fp32
sum over thousands of positions drifts to several times the error of numpy's
blocked float32 sum. Grid ``(H, M)``, block 32.

Layouts (C-contiguous):
    q           [M, H, D]                      float32
    k_cache     [KV_SLOTS, H_kv, max_seq, D]   float32 (pooled, head-first)
    v_cache     [KV_SLOTS, H_kv, max_seq, D]   float32
    seq_lens    [M] int32: sequence m attends positions 0..seq_lens[m]-1
    slot_table  [M] int32: sequence m reads cache slot slot_table[m]
    out         [M, H, D] float32,  lse [M, H] float32 (natural log; -inf if empty)

GQA: query head ``h`` reads kv head ``h * H_kv // H``.

Per-slot caches: ``k_cache``/``v_cache`` may instead be lists of KV_SLOTS
``[H_kv, max_seq, D]`` device arrays; the kernel then reads slot ``s`` through
a ``uint64`` table of their addresses (``attention.core.pointers``, GPU only).

Planted defects (``defect=``, for the falsification suite only; the same
kernel source with one switch flipped, see ``validation/defects.py``):
    "stuck_rescale"    alpha computed after the max was overwritten (== 1.0)
    "gqa_mod"          kv head ``h % H_kv`` instead of ``h * H_kv // H``
    "slot_off_by_one"  reads slot ``slot_table[m] + 1`` (mod KV_SLOTS)
    "batch_max_len"    every sequence uses the batch's largest length
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int64

from attention.core import checks
from attention.core.device import (
    device_empty,
    device_fn,
    finish,
    host_ints,
    is_host_array,
    jit,
    launch_stream,
    to_device,
    to_host,
)
from attention.core.pointers import is_cache_list, pointer_table
from attention.core.warp import (compensated_rescale_add, online_softmax_update, softmax_finish,
                   warp_sum_down)

WARP = 32
KERNEL_DEFECTS = ("stuck_rescale", "gqa_mod", "slot_off_by_one", "batch_max_len")
CACHE_DTYPES = (np.float32,)


def n_chunks(head_dim):
    """Elements per lane: ``ceil(head_dim / 32)``."""
    return (head_dim + WARP - 1) // WARP


def kv_loader(pointers):
    """The device function reading one cache element, for a pooled cache or a
    per-slot pointer table.

    ``pointers`` None: ``load(cache, slot, g, pos, d, head_dim)`` reads
    ``cache[slot, g, pos, d]`` of a pooled ``[KV_SLOTS, H_kv, max_seq, D]``
    array. ``pointers = (H_kv, max_seq)``: ``cache`` is a ``uint64 [KV_SLOTS]``
    table of addresses of ``[H_kv, max_seq, D]`` float32 slots (GPU only,
    ``attention.core.pointers``). Returns ``(load, n_kv_of)``: ``n_kv_of(cache)``
    is the number of kv heads.
    """
    if pointers is None:
        def load(cache, slot, g, pos, d, head_dim):
            return cache[slot, g, pos, d]

        def n_kv_of(cache):
            return cache.shape[1]
    else:
        from attention.core.pointers import load_f32

        N_KV, MAX_SEQ = int(pointers[0]), int(pointers[1])

        def load(cache, slot, g, pos, d, head_dim):
            return load_f32(cache[slot], (int64(g) * MAX_SEQ + pos) * head_dim + d)

        def n_kv_of(cache):
            return N_KV
    return device_fn(load), device_fn(n_kv_of)


@functools.lru_cache(maxsize=None)
def position_loop(chunks, stuck=False, pointers=None):
    """The warp kernels' loop over one sequence's positions ``start .. stop-1``
    (the warp kernel: all of them; the split-KV chunk kernel: one chunk), as a
    device function of the calling warp:

        m, l = attend(q, k_cache, v_cache, scale, seq, head, slot, kv_head,
                      start, stop, lane, head_dim, acc)

    q [M, H, D], caches as ``kv_loader(pointers)`` reads them. Lane ``j`` holds
    ``d = j + 32 c`` (``c < chunks``) of q (pre-scaled), each score is a
    ``warp_sum_down``, the online softmax is ``online_softmax_update``, and the
    running sum ``l`` and accumulator ``acc`` (the caller's local array of
    ``chunks`` float32, the lane's elements, overwritten) carry Kahan
    compensation, folded in on return
    (plain fp32 running sums over every position drift to several times numpy's
    blocked error). No position: ``(-inf, 0, zeros)``. ``stuck``: the planted
    "stuck_rescale" (the old max overwritten before the rescale reads it).
    """
    CH, STUCK = chunks, stuck
    load, _ = kv_loader(pointers)

    def attend(q, k_cache, v_cache, scale, seq, head, slot, kv_head, start, stop, lane,
               head_dim, acc):
        # -- this lane's slice of q, pre-scaled --
        q_reg = cuda.local.array(CH, float32)
        acc_c = cuda.local.array(CH, float32)  # Kahan compensation of acc
        for c in range(CH):
            d = lane + c * WARP
            q_reg[c] = float32(q[seq, head, d]) * scale if d < head_dim else float32(0.0)
            acc[c] = float32(0.0)
            acc_c[c] = float32(0.0)

        m = float32(-math.inf)
        l = float32(0.0)
        l_c = float32(0.0)
        for pos in range(start, stop):
            # -- score: q . k[pos], reduced across the warp --
            part = float32(0.0)
            for c in range(CH):
                d = lane + c * WARP
                if d < head_dim:
                    part += q_reg[c] * float32(load(k_cache, slot, kv_head, pos, d, head_dim))
            s = warp_sum_down(part)

            # -- online softmax --
            if STUCK:
                m_new = max(m, s)
                m = m_new  # the old max is gone before the rescale reads it
                alpha = math.exp(m - m_new)
                p = math.exp(s - m_new)
            else:
                m, _, alpha, p = online_softmax_update(m, l, s)

            # -- rescale what came before, add this position's value (compensated) --
            l, l_c = compensated_rescale_add(l, l_c, alpha, p)
            for c in range(CH):
                d = lane + c * WARP
                if d < head_dim:
                    acc[c], acc_c[c] = compensated_rescale_add(
                        acc[c], acc_c[c], alpha,
                        p * float32(load(v_cache, slot, kv_head, pos, d, head_dim)))
        for c in range(CH):
            acc[c] = acc[c] - acc_c[c]
        return m, l - l_c

    return device_fn(attend)


@functools.lru_cache(maxsize=None)
def batched_decode_kernel(chunks, defect=None, pointers=None):
    """The batched warp-per-head kernel for ``chunks = ceil(D/32)`` (1..8).

    ``defect`` selects a planted defect (see module docstring); None is the
    correct kernel. ``pointers`` None reads pooled caches; ``(H_kv, max_seq)``
    reads per-slot caches through ``uint64 [KV_SLOTS]`` pointer tables passed
    as ``k_cache``/``v_cache`` (GPU only). Compiled lazily per argument types.
    """
    if defect not in (None,) + KERNEL_DEFECTS:
        raise ValueError(f"defect: expected one of {KERNEL_DEFECTS} or None, got {defect!r}")
    CH = chunks
    _, n_kv_of = kv_loader(pointers)
    attend_positions = position_loop(chunks, defect == "stuck_rescale", pointers)
    GQA_MOD = defect == "gqa_mod"
    SLOT_SHIFT = 1 if defect == "slot_off_by_one" else 0
    MAX_LEN = defect == "batch_max_len"

    def kernel(q, k_cache, v_cache, seq_lens, slot_table, scale, out, lse):
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        n_heads = q.shape[1]
        head_dim = q.shape[2]
        n_slots = k_cache.shape[0]
        n_kv = n_kv_of(k_cache)

        # -- which slot, kv head and length this warp reads --
        slot = (slot_table[seq] + SLOT_SHIFT) % n_slots
        if GQA_MOD:
            kv_head = head % n_kv
        else:
            kv_head = head * n_kv // n_heads
        length = seq_lens[seq]
        if MAX_LEN:
            for other in range(seq_lens.shape[0]):
                length = max(length, seq_lens[other])

        acc = cuda.local.array(CH, float32)
        m, l = attend_positions(q, k_cache, v_cache, scale, seq, head, slot, kv_head,
                                0, length, lane, head_dim, acc)

        # -- epilogue: normalise; an empty sequence gives zeros and -inf --
        inv, lse_h = softmax_finish(m, l)  # accurate 1 / l and log l
        for c in range(CH):
            d = lane + c * WARP
            if d < head_dim:
                out[seq, head, d] = acc[c] * inv
        if lane == 0:
            lse[seq, head] = lse_h

    kernel.__name__ = "batched_decode" + ("" if pointers is None else "_ptr") + (
        "" if defect is None else "_" + defect)
    return jit(kernel, fastmath=True)


def _check_cache_geometry(k_cache, v_cache, head_dim, cache_dtypes):
    """(KV_SLOTS, H_kv, max_seq) of a pooled cache pair or a per-slot list pair."""
    if is_cache_list(k_cache) or is_cache_list(v_cache):
        if not (is_cache_list(k_cache) and is_cache_list(v_cache)):
            raise checks.LayoutError(
                "v_cache: expected a per-slot list like k_cache (or both pooled arrays)")
        if len(v_cache) != len(k_cache):
            raise checks.ShapeError(
                f"v_cache: expected {len(k_cache)} per-slot caches (as k_cache), "
                f"got {len(v_cache)}")
        if not k_cache:
            raise checks.ShapeError("k_cache: expected at least one per-slot cache, got none")
        n_kv, max_seq = None, None
        for name, lst in (("k_cache", k_cache), ("v_cache", v_cache)):
            for i, a in enumerate(lst):
                n_kv, max_seq, _ = checks.check_array(
                    f"{name}[{i}]", a, (("H_kv", n_kv), ("max_seq", max_seq), ("D", head_dim)),
                    dtypes=(np.float32,))
        return len(k_cache), n_kv, max_seq
    n_slots, n_kv, max_seq, _ = checks.check_array(
        "k_cache", k_cache,
        (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", head_dim)),
        dtypes=cache_dtypes,
    )
    checks.check_array(
        "v_cache", v_cache,
        (("KV_SLOTS", n_slots), ("H_kv", n_kv), ("max_seq", max_seq), ("D", head_dim)),
        dtypes=cache_dtypes,
    )
    checks.check_same_dtype([("k_cache", k_cache), ("v_cache", v_cache)])
    return n_slots, n_kv, max_seq


def check_batched(q, k_cache, v_cache, seq_lens, slot_table, *, cache_dtypes=CACHE_DTYPES):
    """Validate a batched decode call; returns (M, H, H_kv, max_seq, D, lens, slots).

    ``k_cache``/``v_cache`` are pooled ``[KV_SLOTS, H_kv, max_seq, D]`` arrays
    or lists of KV_SLOTS per-slot ``[H_kv, max_seq, D]`` device arrays.
    """
    m_count, n_heads, head_dim = checks.check_array(
        "q", q, (("M", None), ("H", None), ("D", None)), dtypes=(np.float32,)
    )
    checks.check_head_dim("q", head_dim)
    n_slots, n_kv, max_seq = _check_cache_geometry(k_cache, v_cache, head_dim, cache_dtypes)
    checks.check_heads(n_heads, n_kv)
    if n_slots < m_count:
        raise checks.ShapeError(
            f"k_cache: expected KV_SLOTS >= M={m_count} slots, got {n_slots}"
        )
    lens = checks.check_lengths("seq_lens", host_ints(seq_lens), max_seq, count=m_count)
    slots = checks.check_slot_table(
        None if slot_table is None else host_ints(slot_table), m_count, n_slots
    )
    return m_count, n_heads, n_kv, max_seq, head_dim, lens, slots


def stage_caches(k_cache, v_cache, stream):
    """Device operands for the kernels: pooled arrays as device views, or
    per-slot lists as ``uint64`` pointer tables. Returns
    ``(d_k, d_v, pointers, keep)`` with ``pointers`` the ``(H_kv, max_seq)``
    key of the pointer-reading kernel (None for pooled caches) and ``keep``
    the arrays that must outlive the launch."""
    if is_cache_list(k_cache):
        d_k, shape, keep_k = pointer_table(k_cache, "k_cache", stream=stream)
        d_v, _, keep_v = pointer_table(v_cache, "v_cache", shape=shape, stream=stream)
        return d_k, d_v, (shape[0], shape[1]), (keep_k, keep_v)
    return to_device(k_cache, stream), to_device(v_cache, stream), None, ()


def check_output(name, given, shape):
    """Validate an optional output buffer (before anything is launched)."""
    if given is not None:
        checks.check_array(name, given, tuple((f"d{i}", s) for i, s in enumerate(shape)),
                           dtypes=(np.float32,))


def _output(name, given, shape, stream):
    if given is None:
        return device_empty(shape, np.float32, stream)
    check_output(name, given, shape)
    return to_device(given, stream)


def batched_decode_attention(q, k_cache, v_cache, seq_lens, slot_table=None, *,
                             scale=None, out=None, lse=None, stream=None,
                             return_lse=False, defect=None):
    """Decode attention for M sequences over a pooled KV cache.

    q:          [M, H, D] float32
    k_cache:    [KV_SLOTS, H_kv, max_seq, D] float32, KV_SLOTS >= M; or a list
                of KV_SLOTS per-slot [H_kv, max_seq, D] float32 device arrays,
                read through a device pointer table (GPU only)
    v_cache:    same form and shape as k_cache
    seq_lens:   [M] int: positions 0..seq_lens[m]-1 of the slot are attended;
                0 gives zeros (LSE -inf)
    slot_table: [M] int, the cache slot of sequence m (default ``arange(M)``);
                slots not in the table are never read
    scale:      default 1/sqrt(D)
    out, lse:   optional output buffers [M, H, D] and [M, H] float32
    stream:     numba stream; None synchronises before returning
    Returns out [M, H, D] (and lse [M, H] with ``return_lse``): numpy when q is
    numpy, else device arrays.
    """
    m_count, n_heads, _, _, head_dim, lens, slots = check_batched(
        q, k_cache, v_cache, seq_lens, slot_table)
    scale = checks.check_scale(scale, head_dim)
    check_output("out", out, (m_count, n_heads, head_dim))
    check_output("lse", lse, (m_count, n_heads))
    host = is_host_array(q)
    if m_count == 0:
        o, s = np.zeros((0, n_heads, head_dim), np.float32), np.zeros((0, n_heads), np.float32)
        return (o, s) if return_lse else o
    st = launch_stream(stream)
    d_k, d_v, pointers, keep = stage_caches(k_cache, v_cache, stream)
    kernel = batched_decode_kernel(n_chunks(head_dim), defect, pointers)
    d_q = to_device(q, stream)
    d_lens, d_slots = to_device(lens, stream), to_device(slots, stream)
    d_out = _output("out", out, (m_count, n_heads, head_dim), stream)
    d_lse = _output("lse", lse, (m_count, n_heads), stream)
    kernel[(n_heads, m_count), WARP, st](d_q, d_k, d_v, d_lens, d_slots,
                                         np.float32(scale), d_out, d_lse)
    result = (d_out, d_lse)
    if host:
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    del keep
    return result if return_lse else result[0]


def decode_attention(q, k_cache, v_cache, seq_len, *, scale=None, stream=None,
                     return_lse=False):
    """Warp-per-head decode attention of one sequence.

    q:        [H, D] float32
    k_cache:  [H_kv, max_seq, D] float32 (head-first)
    v_cache:  [H_kv, max_seq, D] float32
    seq_len:  int, positions 0..seq_len-1 are attended (0 gives zeros, LSE -inf)
    scale:    default 1/sqrt(D)
    Returns out [H, D] (and lse [H] with ``return_lse``).
    """
    checks.check_array("q", q, (("H", None), ("D", None)), dtypes=(np.float32,))
    checks.check_array("k_cache", k_cache, (("H_kv", None), ("max_seq", None),
                                            ("D", int(q.shape[1]))), dtypes=CACHE_DTYPES)
    checks.check_array("v_cache", v_cache, tuple(
        (label, int(n)) for label, n in zip(("H_kv", "max_seq", "D"), k_cache.shape)),
        dtypes=CACHE_DTYPES)
    if not isinstance(seq_len, (int, np.integer)):
        raise checks.DTypeError(f"seq_len: expected an int, got {type(seq_len).__name__}")
    checks.check_range("seq_len", int(seq_len), 0, int(k_cache.shape[1]), what="length")
    res = batched_decode_attention(
        _unsqueeze(q), _unsqueeze(k_cache), _unsqueeze(v_cache),
        np.array([seq_len], np.int32), None, scale=scale, stream=stream, return_lse=True)
    out, lse = res[0][0], res[1][0]
    return (out, lse) if return_lse else out


def _unsqueeze(x):
    """[...] -> [1, ...] without a copy (numpy or device array)."""
    if is_host_array(x):
        return x.reshape((1,) + x.shape)
    d = to_device(x)
    return d.reshape((1,) + tuple(d.shape))
