"""Split-KV ("flash-decoding") batched decode attention: chunk kernel + LSE combine.

The warp-per-head kernel of ``attention.reference.warp_decode`` gives one warp a whole
sequence: with few sequences and a long context, H*M warps cannot keep the
GPU busy. Here each (head, sequence) is cut into chunks of ``chunk``
positions and every chunk gets its own warp:

1. ``flash_decode_chunk_kernel``: grid ``(H, M, n_splits)``, block 32. Warp
   ``(h, m, s)`` runs the online softmax of ``attention.core.warp`` over positions
   ``s*chunk .. min((s+1)*chunk, seq_lens[m]) - 1`` and writes its partial
   state: running max ``part_max[m, h, s]``, running sum ``part_sum[m, h, s]``
   and the unnormalised accumulator ``part_acc[m, h, s, :]``. A chunk past the
   sequence's end writes the empty state (``-inf``, 0, zeros).
2. ``flash_decode_combine_kernel``: grid ``(H, M)``, block 32 (lanes over D).
   Merges the ``n_splits`` partial states with
   ``attention.core.warp.online_softmax_merge`` (empty states get factor 0, never
   NaN), then normalises: ``out = acc / l``, ``lse = max + log(l)``; a
   zero-length sequence gives zeros and ``-inf``.

Layouts (C-contiguous), as ``batched_decode_attention``:
    q           [M, H, D]                      float32
    k_cache     [KV_SLOTS, H_kv, max_seq, D]   float32 (or per-slot pointer tables)
    v_cache     [KV_SLOTS, H_kv, max_seq, D]   float32
    seq_lens    [M] int32,  slot_table [M] int32
    part_max    [M, H, n_splits] float32, part_sum [M, H, n_splits] float32
    part_acc    [M, H, n_splits, D] float32
    out         [M, H, D] float32,  lse [M, H] float32

Planted defects (``defect=``, falsification suite only), the switches of
``attention.reference.warp_decode`` applied to the chunk kernel: "stuck_rescale",
"gqa_mod", "slot_off_by_one", "batch_max_len".

``choose_decode_method`` is the heuristic between the two paths and
``decode(..., method="auto"|"warp"|"split")`` dispatches.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from attention.core import checks
from attention.core.pointers import is_cache_list
from attention.reference.warp_decode import (
    KERNEL_DEFECTS,
    WARP,
    batched_decode_attention,
    check_batched,
    check_output,
    kv_loader,
    n_chunks,
    position_loop,
    stage_caches,
)
from attention.core.device import (
    device_empty,
    finish,
    is_host_array,
    jit,
    launch_stream,
    to_device,
    to_host,
)
from attention.core.warp import online_softmax_merge

SPLIT_DEFECTS = KERNEL_DEFECTS
METHODS = ("auto", "warp", "split", "fast")
MIN_CHUNK = 64  # positions per chunk below which a split costs more than it saves
TARGET_WARPS = 2 * 132  # default split count aims for this many warps (two per H200 SM)


@functools.lru_cache(maxsize=None)
def flash_decode_chunk_kernel(chunks, defect=None, pointers=None):
    """Chunk kernel for ``chunks = ceil(D/32)``; ``defect`` / ``pointers`` as
    ``attention.reference.warp_decode.batched_decode_kernel``.

    Arguments: q [M, H, D] f32, k_cache / v_cache [KV_SLOTS, H_kv, max_seq, D]
    f32 (or uint64 [KV_SLOTS] pointer tables), seq_lens [M] i32, slot_table
    [M] i32, scale f32, chunk i32 (positions per split), part_max / part_sum
    [M, H, n_splits] f32, part_acc [M, H, n_splits, D] f32.
    """
    if defect not in (None,) + SPLIT_DEFECTS:
        raise ValueError(f"defect: expected one of {SPLIT_DEFECTS} or None, got {defect!r}")
    CH = chunks
    GQA_MOD = defect == "gqa_mod"
    SLOT_SHIFT = 1 if defect == "slot_off_by_one" else 0
    MAX_LEN = defect == "batch_max_len"
    _, n_kv_of = kv_loader(pointers)
    # the warp kernel's position loop over this chunk's positions
    attend_positions = position_loop(chunks, defect == "stuck_rescale", pointers)

    def kernel(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk,
               part_max, part_sum, part_acc):
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        split = cuda.blockIdx.z
        lane = cuda.threadIdx.x
        n_heads = q.shape[1]
        head_dim = q.shape[2]
        n_slots = k_cache.shape[0]
        n_kv = n_kv_of(k_cache)

        # -- which slot, kv head and positions this warp reads --
        slot = (slot_table[seq] + SLOT_SHIFT) % n_slots
        if GQA_MOD:
            kv_head = head % n_kv
        else:
            kv_head = head * n_kv // n_heads
        length = seq_lens[seq]
        if MAX_LEN:
            for other in range(seq_lens.shape[0]):
                length = max(length, seq_lens[other])
        start = split * chunk
        stop = min(start + chunk, length)  # stop <= start: an empty chunk

        acc = cuda.local.array(CH, float32)
        m, l = attend_positions(q, k_cache, v_cache, scale, seq, head, slot, kv_head,
                                start, stop, lane, head_dim, acc)

        # -- epilogue: the partial state, unnormalised (empty: -inf, 0, zeros) --
        for c in range(CH):
            d = lane + c * WARP
            if d < head_dim:
                part_acc[seq, head, split, d] = acc[c]
        if lane == 0:
            part_max[seq, head, split] = m
            part_sum[seq, head, split] = l

    kernel.__name__ = "flash_decode_chunk" + ("" if pointers is None else "_ptr") + (
        "" if defect is None else "_" + defect)
    return jit(kernel, fastmath=True)


@functools.lru_cache(maxsize=None)
def flash_decode_combine_kernel(chunks):
    """Combine kernel for ``chunks = ceil(D/32)``.

    Arguments: part_max / part_sum [M, H, n_splits] f32, part_acc
    [M, H, n_splits, D] f32, out [M, H, D] f32, lse [M, H] f32.
    Compiled without fastmath: empty partial states carry ``-inf`` maxima and
    the merge must see them as such.
    """
    CH = chunks

    def kernel(part_max, part_sum, part_acc, out, lse):
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        head_dim = out.shape[2]
        n_splits = part_max.shape[2]

        acc = cuda.local.array(CH, float32)
        for c in range(CH):
            acc[c] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        # -- merge the partial states in split order (every lane the same scalars) --
        for split in range(n_splits):
            m, l, alpha, beta = online_softmax_merge(
                m, l, part_max[seq, head, split], part_sum[seq, head, split])
            for c in range(CH):
                d = lane + c * WARP
                if d < head_dim:
                    acc[c] = acc[c] * alpha + part_acc[seq, head, split, d] * beta

        # -- epilogue: normalise; an empty sequence gives zeros and -inf --
        inv = float32(1.0) / l if l > float32(0.0) else float32(0.0)
        for c in range(CH):
            d = lane + c * WARP
            if d < head_dim:
                out[seq, head, d] = acc[c] * inv
        if lane == 0:
            lse[seq, head] = m + math.log(l) if l > float32(0.0) else float32(-math.inf)

    kernel.__name__ = "flash_decode_combine"
    return jit(kernel, fastmath=False)


def split_plan(max_len, m_count, n_heads, *, num_splits=None, chunk=None):
    """``(n_splits, chunk)`` covering ``max_len`` positions.

    Given ``chunk``: ``ceil(max_len / chunk)`` splits. Given ``num_splits``:
    chunks of ``ceil(max_len / num_splits)``. Both: they must cover
    ``max_len``. Neither: enough splits for about ``TARGET_WARPS`` warps, with
    chunks of at least ``MIN_CHUNK`` positions.
    """
    max_len = max(int(max_len), 1)
    if chunk is not None:
        if not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise checks.RangeError(f"chunk: expected a positive int, got {chunk!r}")
        chunk = int(chunk)
    if num_splits is not None:
        if not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
            raise checks.RangeError(f"num_splits: expected a positive int, got {num_splits!r}")
        num_splits = int(num_splits)
    if chunk is not None and num_splits is not None:
        if chunk * num_splits < max_len:
            raise checks.RangeError(
                f"num_splits: {num_splits} chunks of {chunk} cover {chunk * num_splits} "
                f"positions, fewer than the longest sequence ({max_len})")
        return num_splits, chunk
    if chunk is not None:
        return -(-max_len // chunk), chunk
    if num_splits is None:
        wanted = -(-TARGET_WARPS // max(1, m_count * n_heads))
        num_splits = max(1, min(wanted, max_len // MIN_CHUNK))
    chunk = -(-max_len // num_splits)
    return -(-max_len // chunk), chunk


def flash_decode_attention(q, k_cache, v_cache, seq_lens, slot_table=None, *, scale=None,
                           num_splits=None, chunk=None, out=None, lse=None, stream=None,
                           return_lse=False, defect=None):
    """Split-KV decode attention; arguments and results as ``batched_decode_attention``.

    q:          [M, H, D] float32
    k_cache:    [KV_SLOTS, H_kv, max_seq, D] float32 (or a list of per-slot
                [H_kv, max_seq, D] device arrays, GPU only); v_cache likewise
    seq_lens:   [M] int (0 gives zeros, LSE -inf); slot_table [M] int
    num_splits, chunk: the split plan (``split_plan``); default from the shape
    out, lse:   optional output buffers [M, H, D] and [M, H] float32
    stream:     numba stream; None synchronises before returning
    Returns out [M, H, D] (and lse [M, H] with ``return_lse``).
    """
    m_count, n_heads, _, _, head_dim, lens, slots = check_batched(
        q, k_cache, v_cache, seq_lens, slot_table)
    scale = checks.check_scale(scale, head_dim)
    check_output("out", out, (m_count, n_heads, head_dim))
    check_output("lse", lse, (m_count, n_heads))
    max_len = int(lens.max()) if lens.size else 0
    n_splits, chunk = split_plan(max_len, m_count, n_heads, num_splits=num_splits, chunk=chunk)
    host = is_host_array(q)
    if m_count == 0:
        o, s = np.zeros((0, n_heads, head_dim), np.float32), np.zeros((0, n_heads), np.float32)
        return (o, s) if return_lse else o
    st = launch_stream(stream)
    d_k, d_v, pointers, keep = stage_caches(k_cache, v_cache, stream)
    chunk_kernel = flash_decode_chunk_kernel(n_chunks(head_dim), defect, pointers)
    combine_kernel = flash_decode_combine_kernel(n_chunks(head_dim))
    d_q = to_device(q, stream)
    d_lens, d_slots = to_device(lens, stream), to_device(slots, stream)
    d_out = device_empty((m_count, n_heads, head_dim), np.float32, stream) if out is None \
        else to_device(out, stream)
    d_lse = device_empty((m_count, n_heads), np.float32, stream) if lse is None \
        else to_device(lse, stream)
    part_max = device_empty((m_count, n_heads, n_splits), np.float32, stream)
    part_sum = device_empty((m_count, n_heads, n_splits), np.float32, stream)
    part_acc = device_empty((m_count, n_heads, n_splits, head_dim), np.float32, stream)
    chunk_kernel[(n_heads, m_count, n_splits), WARP, st](
        d_q, d_k, d_v, d_lens, d_slots, np.float32(scale), np.int32(chunk),
        part_max, part_sum, part_acc)
    combine_kernel[(n_heads, m_count), WARP, st](part_max, part_sum, part_acc, d_out, d_lse)
    result = (d_out, d_lse)
    if host:
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    del keep
    return result if return_lse else result[0]


def choose_decode_method(m_count, n_kv_heads, max_len, n_sms=132):
    """"split" for few sequences over a long context, else "warp".

    The warp kernel streams each (sequence, kv group)'s cache through the warps
    of one group; when there are fewer such streams than SMs
    (``M * H_kv < n_sms``) part of the GPU idles unless the context is cut
    into chunks, which pays off once there are at least two chunks of
    ``MIN_CHUNK`` positions (``max_len >= 2 * MIN_CHUNK``; below that the
    combine launch costs more than the split saves).
    """
    if max_len >= 2 * MIN_CHUNK and m_count * n_kv_heads < n_sms:
        return "split"
    return "warp"


def decode(q, k_cache, v_cache, seq_lens, slot_table=None, *, method="auto", **kwargs):
    """Batched decode attention by any path.

    method: "warp" (``batched_decode_attention``), "split"
    (``flash_decode_attention``), "fast" (``decode_fast.batched_decode_attention_fast``:
    group-shared split-KV kernel, fp32/fp16/bf16 caches) or "auto": "fast" for
    pooled caches, else ``choose_decode_method`` between "warp" and "split"
    (per-slot cache lists, and planted defects, which only the warp and split
    kernels carry). Other keyword arguments go to the chosen launcher
    (``num_splits`` is the fast path's ``n_split``; ``chunk`` only for "split").
    """
    if method not in METHODS:
        raise checks.AttentionInputError(f"method: expected one of {METHODS}, got {method!r}")
    if method == "auto":
        if kwargs.get("defect") is None and not is_cache_list(k_cache):
            method = "fast"
        else:
            m_count, _, n_kv, _, _, lens, _ = check_batched(q, k_cache, v_cache, seq_lens,
                                                            slot_table)
            method = choose_decode_method(m_count, n_kv, int(lens.max()) if lens.size else 0)
    if method == "split":
        return flash_decode_attention(q, k_cache, v_cache, seq_lens, slot_table, **kwargs)
    if method == "fast":
        from attention.decode.fast import batched_decode_attention_fast

        if kwargs.pop("defect", None) is not None:
            raise checks.AttentionInputError(
                "defect: the fast path carries no planted defects (use method='warp' or 'split')")
        kwargs.pop("chunk", None)
        n_split = kwargs.pop("num_splits", None)
        return batched_decode_attention_fast(q, k_cache, v_cache, seq_lens, slot_table,
                                             n_split=n_split, **kwargs)
    for key in ("num_splits", "chunk"):
        kwargs.pop(key, None)
    return batched_decode_attention(q, k_cache, v_cache, seq_lens, slot_table, **kwargs)
