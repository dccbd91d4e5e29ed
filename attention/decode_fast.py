"""Fast batched decode attention: one block per (split, kv group, sequence).

Same contract as ``attention.decode.batched_decode_attention`` (read its
docstring), built for bandwidth:

* **A block per (KV chunk, kv group, sequence).** The ``GB`` query heads of a
  kv group (GQA) that a block serves share every K/V row it loads, so K and V
  are read from memory once per kv group, not once per query head.
* **Whole rows per warp, vector loads.** Lane ``j`` holds elements
  ``c*32*VEC + j*VEC + v`` (``v < VEC``, ``c < CH``) of a row, so one warp
  instruction reads ``32*VEC`` consecutive elements: 16-byte loads for fp32
  (``VEC=4``), 8-byte loads for fp16/bf16 rows of D=128. Loads go through
  ``load_row_vec`` (an LLVM vector load; on the simulator a plain loop).
  Head sizes that are not a multiple of 32 use scalar, predicated loads.
* **Several positions per warp at once.** A warp loads ``U`` consecutive K
  and V rows before it uses any (``2*U`` independent loads in flight), forms
  ``U*GB`` scores with ``attention.warp.warp_sum``, takes the tile's softmax
  (max over its ``U`` scores, ``U`` exponentials) and folds the tile into its
  running state with ``attention.warp.online_softmax_merge``: two
  exponentials per tile and head instead of two per position.
* **fp16 / bf16 caches, fp32 accumulation.** Rows are converted to float32
  as they are loaded (bf16 by a 16-bit shift, fp16 by ``cvt.f32.f16``).
* **Split-KV.** Each sequence's positions are cut into ``n_split`` chunks so
  that ``M * H_kv * n_split`` blocks fill the 132 SMs even when ``M * H_kv``
  is small; each block writes an unnormalised partial (acc, m, l) and a
  combine kernel merges the partials with ``online_softmax_merge``. With one
  chunk the block writes the final output directly (one launch).

Within a block the ``NW`` warps take tiles ``U`` positions apart in turn and
merge their states through shared memory at the end.

Layouts (C-contiguous):
    q           [M, H, D]                     float32, or the cache's dtype
    k_cache     [KV_SLOTS, H_kv, max_seq, D]  float32 / float16 / bfloat16
    v_cache     [KV_SLOTS, H_kv, max_seq, D]  same dtype as k_cache
    seq_lens    [M] int32, slot_table [M] int32
    out         [M, H, D] float32, lse [M, H] float32 (-inf where empty)
    part_acc    [M, H, n_split, D] float32 (split-KV scratch, unnormalised)
    part_ml     [M, H, n_split, 2] float32 (running max, running sum)
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int64

from . import checks
from .device import (
    BFLOAT16,
    SIMULATOR,
    device_empty,
    finish,
    host_ints,
    is_host_array,
    jit,
    launch_stream,
    to_device,
    to_host,
)
from .warp import online_softmax_merge, warp_sum

WARP = 32
N_SMS = 132  # H200 / H100 SXM; only a sizing hint for the split heuristic

CACHE_DTYPES = tuple(d for d in (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
                     if d is not None)

# default tuning (H200, B 32 / H 32 / H_kv 8 / D 128; bench/NOTES.md): 4 warps per
# block; 4 positions per warp step, 8 once a block's chunk is long enough to use them
WARPS = 4
UNROLL = None  # None: 8 when the chunk is >= LONG_CHUNK positions, else 4
LONG_CHUNK = 384
MIN_CHUNK = 256  # fewest positions a split-KV block is given
TARGET_BLOCKS = 16 * N_SMS  # one full wave at 16 blocks of 128 threads per SM


def dtype_kind(dt):
    """'f32', 'f16' or 'bf16' for a cache dtype."""
    dt = np.dtype(dt)
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bf16"
    raise checks.DTypeError(f"k_cache: expected float32, float16 or bfloat16, got {dt}")


# ---------------------------------------------------------------------------
# vector row loads
# ---------------------------------------------------------------------------

def _vector_loader(kind, n):
    """``load(arr, flat) -> UniTuple(float32, n)``: elements ``flat .. flat+n-1``
    of a C-contiguous array, read with one vector load (``n * itemsize`` bytes,
    aligned to that size) and converted to float32.

    fp32: ``ld.global.v{n}.f32``; fp16 and bf16: ``n/2`` 32-bit words, each
    split into two halves (bf16 -> f32 is a 16-bit shift; fp16 uses cvt).
    """
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, arr, flat):
        sig = types.UniTuple(types.float32, n)(arr, flat)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            i8p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
            idx = args[1]
            if idx.type.width < 64:
                idx = builder.sext(idx, ir.IntType(64))
            itemsize = 4 if kind == "f32" else 2
            ptr = builder.gep(i8p, [builder.mul(idx, ir.Constant(ir.IntType(64), itemsize))])
            f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
            elems = []
            if kind == "f32":
                vt = ir.VectorType(f32, n)
                vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4 * n)
                elems = [builder.extract_element(vec, ir.Constant(i32, i)) for i in range(n)]
            else:
                vt = ir.VectorType(i32, n // 2)
                vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=2 * n)
                for i in range(n // 2):
                    word = builder.extract_element(vec, ir.Constant(i32, i))
                    if kind == "bf16":
                        lo = builder.bitcast(builder.shl(word, ir.Constant(i32, 16)), f32)
                        hi = builder.bitcast(
                            builder.and_(word, ir.Constant(i32, 0xFFFF0000)), f32)
                    else:
                        lo16 = builder.trunc(word, i16)
                        hi16 = builder.trunc(builder.lshr(word, ir.Constant(i32, 16)), i16)
                        lo = builder.fpext(builder.bitcast(lo16, ir.HalfType()), f32)
                        hi = builder.fpext(builder.bitcast(hi16, ir.HalfType()), f32)
                    elems += [lo, hi]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    return load


def _sim_loader(n):
    """Simulator stand-in for the vector load: ``n`` scalar reads of a 4-D array."""

    def load(arr, flat):
        d_len, s_len, k_len = arr.shape[3], arr.shape[2], arr.shape[1]
        d = flat % d_len
        rest = flat // d_len
        pos = rest % s_len
        rest //= s_len
        g = rest % k_len
        slot = rest // k_len
        return tuple(float32(arr[slot, g, pos, d + i]) for i in range(n))

    return load


@functools.lru_cache(maxsize=None)
def load_row_vec(kind, n):
    """The vector loader for dtype ``kind`` and width ``n`` (see ``_vector_loader``)."""
    if SIMULATOR:
        return _sim_loader(n)
    return _vector_loader(kind, n)


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------

def row_layout(head_dim, kind):
    """``(VEC, CH)``: elements per vector load and vector loads per lane per row.

    The vector path needs ``D % (32*VEC) == 0`` (no predication); other head
    sizes use scalar loads (``VEC=1``, ``CH=ceil(D/32)``, predicated).
    """
    for vec in (4, 2):
        if head_dim % (WARP * vec) == 0:
            return vec, head_dim // (WARP * vec)
    return 1, (head_dim + WARP - 1) // WARP


def heads_per_block(group, per_lane):
    """Query heads of a kv group one block serves: the largest divisor of the
    group size that keeps ``heads * per_lane <= 32`` fp32 registers for q and acc."""
    best = 1
    for gb in range(1, group + 1):
        if group % gb == 0 and gb * per_lane <= 32:
            best = gb
    return best


@functools.lru_cache(maxsize=None)
def fast_decode_kernel(kind, vec, chunks, heads, warps=WARPS, unroll=4):
    """The split-KV, group-shared decode kernel.

    kind: 'f32' / 'f16' / 'bf16' (cache dtype), vec / chunks: ``row_layout``,
    heads: query heads per block (GB), warps: warps per block (NW),
    unroll: positions per warp step (U).

    Grid ``(n_split, H_kv * (H // H_kv) // GB, M)``, block ``32*NW`` threads.
    Arguments: q [M, H, D], k_cache / v_cache [KV_SLOTS, H_kv, max_seq, D],
    seq_lens [M] int32, slot_table [M] int32, scale float32, chunk int32
    (positions per split), out [M, H, D] f32, lse [M, H] f32,
    part_acc [M, H, n_split, D] f32, part_ml [M, H, n_split, 2] f32 (written
    when ``n_split > 1``, else out / lse are).
    """
    VEC, CH, GB, NW, U = vec, chunks, heads, warps, unroll
    E = CH * VEC  # elements of a row per lane
    ROW = CH * WARP * VEC  # row length in the lane layout (>= D)
    VECTOR = VEC > 1
    # local / shared array sizes must be plain closure constants
    N_HEAD_REG = GB * E
    N_ROW_REG = U * E
    N_SCORE = GB * U
    N_SH_ACC = NW * GB * ROW
    N_SH_ML = NW * GB * 2
    load = load_row_vec(kind, VEC) if VECTOR else None
    NEG_INF = -math.inf

    def kernel(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk,
               out, lse, part_acc, part_ml):
        split = cuda.blockIdx.x
        head_block = cuda.blockIdx.y
        seq = cuda.blockIdx.z
        n_split = cuda.gridDim.x
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        n_heads = q.shape[1]
        head_dim = q.shape[2]
        n_kv = k_cache.shape[1]
        max_seq = k_cache.shape[2]

        # -- which kv group, query heads, slot and chunk this block reads --
        group = n_heads // n_kv
        blocks_per_group = group // GB
        kv_head = head_block // blocks_per_group
        head0 = kv_head * group + (head_block % blocks_per_group) * GB
        slot = slot_table[seq]
        length = seq_lens[seq]
        start = split * chunk
        end = min(length, start + chunk)

        # -- q of GB heads (pre-scaled) and the per-head running state --
        q_reg = cuda.local.array(N_HEAD_REG, float32)
        acc = cuda.local.array(N_HEAD_REG, float32)
        m_run = cuda.local.array(GB, float32)
        l_run = cuda.local.array(GB, float32)
        for h in range(GB):
            for c in range(CH):
                for v in range(VEC):
                    d = c * WARP * VEC + lane * VEC + v
                    i = h * E + c * VEC + v
                    acc[i] = float32(0.0)
                    q_reg[i] = float32(0.0)
                    if d < head_dim:
                        q_reg[i] = float32(q[seq, head0 + h, d]) * scale
            m_run[h] = float32(NEG_INF)
            l_run[h] = float32(0.0)

        k_reg = cuda.local.array(N_ROW_REG, float32)
        v_reg = cuda.local.array(N_ROW_REG, float32)
        score = cuda.local.array(N_SCORE, float32)
        row0 = (int64(slot) * n_kv + kv_head) * max_seq

        tile = start + warp * U
        while tile < end:
            # -- load U rows of K and V (all loads issued before any use) --
            for u in range(U):
                pos = min(tile + u, end - 1)  # past the end: re-read the last row
                if VECTOR:
                    base = (row0 + pos) * head_dim + lane * VEC
                    for c in range(CH):
                        kt = load(k_cache, base + c * WARP * VEC)
                        vt = load(v_cache, base + c * WARP * VEC)
                        for v in range(VEC):
                            k_reg[u * E + c * VEC + v] = kt[v]
                            v_reg[u * E + c * VEC + v] = vt[v]
                else:
                    for c in range(CH):
                        d = c * WARP + lane
                        k_reg[u * E + c] = float32(0.0)
                        v_reg[u * E + c] = float32(0.0)
                        if d < head_dim:
                            k_reg[u * E + c] = float32(k_cache[slot, kv_head, pos, d])
                            v_reg[u * E + c] = float32(v_cache[slot, kv_head, pos, d])

            # -- scores: U positions x GB heads, each reduced over the warp --
            for h in range(GB):
                for u in range(U):
                    part = float32(0.0)
                    for e in range(E):
                        part += q_reg[h * E + e] * k_reg[u * E + e]
                    s = warp_sum(part)
                    score[h * U + u] = s if tile + u < end else float32(NEG_INF)

            # -- tile softmax, merged into the running state; P.V --
            for h in range(GB):
                m_tile = score[h * U]
                for u in range(1, U):
                    m_tile = max(m_tile, score[h * U + u])
                l_tile = float32(0.0)
                for u in range(U):
                    p = math.exp(score[h * U + u] - m_tile)
                    score[h * U + u] = p
                    l_tile += p
                m_new, l_new, alpha, beta = online_softmax_merge(
                    m_run[h], l_run[h], m_tile, l_tile)
                m_run[h] = m_new
                l_run[h] = l_new
                for e in range(E):
                    pv = float32(0.0)
                    for u in range(U):
                        pv += score[h * U + u] * v_reg[u * E + e]
                    acc[h * E + e] = acc[h * E + e] * alpha + pv * beta
            tile += NW * U

        # -- merge the NW warps' states through shared memory --
        sh_acc = cuda.shared.array(N_SH_ACC, float32)
        sh_ml = cuda.shared.array(N_SH_ML, float32)
        for h in range(GB):
            for c in range(CH):
                for v in range(VEC):
                    sh_acc[(warp * GB + h) * ROW + c * WARP * VEC + lane * VEC + v] = \
                        acc[h * E + c * VEC + v]
            if lane == 0:
                sh_ml[(warp * GB + h) * 2] = m_run[h]
                sh_ml[(warp * GB + h) * 2 + 1] = l_run[h]
        cuda.syncthreads()  # every warp's partial state is in shared memory

        for idx in range(cuda.threadIdx.x, GB * ROW, NW * WARP):
            h = idx // ROW
            d = idx % ROW
            if d < head_dim:
                m_all = float32(NEG_INF)
                l_all = float32(0.0)
                a_all = float32(0.0)
                for w in range(NW):
                    m_all, l_all, alpha, beta = online_softmax_merge(
                        m_all, l_all, sh_ml[(w * GB + h) * 2], sh_ml[(w * GB + h) * 2 + 1])
                    a_all = a_all * alpha + sh_acc[(w * GB + h) * ROW + d] * beta
                head = head0 + h
                if n_split == 1:
                    # -- one chunk: normalise; an empty sequence gives zeros, -inf --
                    inv = float32(1.0) / l_all if l_all > float32(0.0) else float32(0.0)
                    out[seq, head, d] = a_all * inv
                    if d == 0:
                        lse[seq, head] = (m_all + math.log(l_all) if l_all > float32(0.0)
                                          else float32(NEG_INF))
                else:
                    part_acc[seq, head, split, d] = a_all
                    if d == 0:
                        part_ml[seq, head, split, 0] = m_all
                        part_ml[seq, head, split, 1] = l_all

    kernel.__name__ = kernel.__qualname__ = f"decode_fast_{kind}_v{VEC}c{CH}g{GB}w{NW}u{U}"
    return jit(kernel, fastmath=True)


COMBINE_BATCH = 8  # partials loaded together before they are merged


@functools.lru_cache(maxsize=None)
def combine_kernel():
    """Merge split-KV partials: grid ``(H, M)``, block 128 threads over D.

    part_acc [M, H, n_split, D] f32, part_ml [M, H, n_split, 2] f32 (max, sum);
    out [M, H, D] f32, lse [M, H] f32. Empty partials (m=-inf, l=0) drop out;
    all empty gives zeros and -inf. Partials are loaded ``COMBINE_BATCH`` at a
    time (independent loads in flight) and then merged in order with
    ``online_softmax_merge``: a loop of one dependent load per split was
    load-latency bound (52 us for 128 splits on the H200, bench/NOTES.md).
    """
    NB = COMBINE_BATCH

    def kernel(part_acc, part_ml, out, lse):
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        n_split = part_acc.shape[2]
        head_dim = part_acc.shape[3]
        m_buf = cuda.local.array(NB, float32)
        l_buf = cuda.local.array(NB, float32)
        a_buf = cuda.local.array(NB, float32)
        for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
            m_all = float32(-math.inf)
            l_all = float32(0.0)
            a_all = float32(0.0)
            for s0 in range(0, n_split, NB):
                # -- load NB partials (an empty state past the last split) --
                for j in range(NB):
                    m_buf[j] = float32(-math.inf)
                    l_buf[j] = float32(0.0)
                    a_buf[j] = float32(0.0)
                    if s0 + j < n_split:
                        m_buf[j] = part_ml[seq, head, s0 + j, 0]
                        l_buf[j] = part_ml[seq, head, s0 + j, 1]
                        a_buf[j] = part_acc[seq, head, s0 + j, d]
                # -- merge them in split order --
                for j in range(NB):
                    m_all, l_all, alpha, beta = online_softmax_merge(
                        m_all, l_all, m_buf[j], l_buf[j])
                    a_all = a_all * alpha + a_buf[j] * beta
            inv = float32(1.0) / l_all if l_all > float32(0.0) else float32(0.0)
            out[seq, head, d] = a_all * inv
            if d == 0:
                lse[seq, head] = (m_all + math.log(l_all) if l_all > float32(0.0)
                                  else float32(-math.inf))

    kernel.__name__ = kernel.__qualname__ = "decode_fast_combine"
    return jit(kernel, fastmath=True)


# ---------------------------------------------------------------------------
# launch planning and launcher
# ---------------------------------------------------------------------------

def plan(m_count, n_heads, n_kv, head_dim, max_len, kind, *, n_split=None,
         warps=WARPS, unroll=UNROLL):
    """Launch plan: dict with kernel, grid, block, chunk, n_split.

    ``n_split`` (default: heuristic) cuts each sequence into chunks so that
    ``blocks = M * head_blocks * n_split`` reaches about ``TARGET_BLOCKS``,
    never giving a block fewer than ``MIN_CHUNK`` positions.
    """
    vec, chunks = row_layout(head_dim, kind)
    group = n_heads // n_kv
    gb = heads_per_block(group, vec * chunks)
    head_blocks = n_kv * (group // gb)
    if n_split is None:
        pairs = max(1, m_count * head_blocks)
        want = max(1, -(-TARGET_BLOCKS // pairs))
        most = max(1, -(-max(max_len, 1) // MIN_CHUNK))
        n_split = int(min(want, most))
    n_split = max(1, int(n_split))
    chunk = -(-max(max_len, 1) // n_split)
    if unroll is None:
        unroll = 8 if chunk >= LONG_CHUNK else 4
    step = warps * unroll
    chunk = -(-chunk // step) * step  # whole warp steps
    return {
        "kernel": fast_decode_kernel(kind, vec, chunks, gb, warps, unroll),
        "grid": (n_split, head_blocks, m_count),
        "block": warps * WARP,
        "chunk": int(chunk),
        "n_split": n_split,
        "heads_per_block": gb,
        "vec": vec,
        "unroll": unroll,
    }


def check_fast(q, k_cache, v_cache, seq_lens, slot_table):
    """Validate a call; returns (M, H, H_kv, max_seq, D, kind, lens, slots)."""
    n_slots, n_kv, max_seq, head_dim = checks.check_array(
        "k_cache", k_cache,
        (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", None)),
        dtypes=CACHE_DTYPES)
    kind = dtype_kind(checks._dtype(k_cache))
    checks.check_head_dim("k_cache", head_dim)
    checks.check_array(
        "v_cache", v_cache,
        (("KV_SLOTS", n_slots), ("H_kv", n_kv), ("max_seq", max_seq), ("D", head_dim)),
        dtypes=CACHE_DTYPES)
    checks.check_same_dtype([("k_cache", k_cache), ("v_cache", v_cache)])
    q_dtypes = (np.dtype(np.float32),) + (
        () if kind == "f32" else (checks._dtype(k_cache),))
    m_count, n_heads, _ = checks.check_array(
        "q", q, (("M", None), ("H", None), ("D", head_dim)), dtypes=q_dtypes)
    checks.check_heads(n_heads, n_kv)
    if n_slots < m_count:
        raise checks.ShapeError(f"k_cache: expected KV_SLOTS >= M={m_count} slots, got {n_slots}")
    lens = checks.check_lengths("seq_lens", host_ints(seq_lens), max_seq, count=m_count)
    slots = checks.check_slot_table(
        None if slot_table is None else host_ints(slot_table), m_count, n_slots)
    return m_count, n_heads, n_kv, max_seq, head_dim, kind, lens, slots


def _output(name, given, shape, stream):
    if given is None:
        return device_empty(shape, np.float32, stream)
    checks.check_array(name, given, tuple((f"d{i}", s) for i, s in enumerate(shape)),
                       dtypes=(np.float32,))
    return to_device(given, stream)


def launch(pl, d_q, d_k, d_v, d_lens, d_slots, scale, d_out, d_lse, d_part_acc, d_part_ml,
           stream):
    """Enqueue a planned decode (one or two launches) on ``stream`` (a numba
    stream, 0, or a cuda.core stream / graph builder). Buffers must be device arrays."""
    pl["kernel"][pl["grid"], pl["block"], stream](
        d_q, d_k, d_v, d_lens, d_slots, np.float32(scale), np.int32(pl["chunk"]),
        d_out, d_lse, d_part_acc, d_part_ml)
    if pl["n_split"] > 1:
        m_count, n_heads = d_out.shape[0], d_out.shape[1]
        combine_kernel()[(n_heads, m_count), 128, stream](d_part_acc, d_part_ml, d_out, d_lse)


def scratch(m_count, n_heads, head_dim, n_split, stream=None):
    """Split-KV scratch buffers (a 1-split placeholder when unused)."""
    ns = max(1, n_split)
    return (device_empty((m_count, n_heads, ns, head_dim), np.float32, stream),
            device_empty((m_count, n_heads, ns, 2), np.float32, stream))


def batched_decode_attention_fast(q, k_cache, v_cache, seq_lens, slot_table=None, *,
                                  scale=None, out=None, lse=None, stream=None,
                                  return_lse=False, n_split=None):
    """Fast decode attention for M sequences over a pooled KV cache.

    q:          [M, H, D] float32 (or the cache's dtype)
    k_cache:    [KV_SLOTS, H_kv, max_seq, D] float32, float16 or bfloat16
                (numpy bf16 arrays are ``ml_dtypes.bfloat16``), KV_SLOTS >= M
    v_cache:    [KV_SLOTS, H_kv, max_seq, D] same dtype as k_cache
    seq_lens:   [M] int: positions 0..seq_lens[m]-1 of the slot are attended;
                0 gives zeros (LSE -inf)
    slot_table: [M] int, the cache slot of sequence m (default ``arange(M)``);
                slots not in the table, and positions past a length, are never read
    scale:      default 1/sqrt(D)
    out, lse:   optional output buffers [M, H, D] and [M, H] float32
    stream:     numba stream; None synchronises before returning
    n_split:    KV chunks per sequence (default: sized to fill the GPU)
    Returns out [M, H, D] float32 (and lse [M, H] with ``return_lse``): numpy
    when q is numpy, else device arrays. Accumulation is fp32 for every dtype.
    """
    m_count, n_heads, n_kv, _, head_dim, kind, lens, slots = check_fast(
        q, k_cache, v_cache, seq_lens, slot_table)
    scale = checks.check_scale(scale, head_dim)
    if n_split is not None:
        checks.check_range("n_split", int(n_split), 1, 1 << 16, what="split count")
    host = is_host_array(q)
    if m_count == 0:
        o, s = np.zeros((0, n_heads, head_dim), np.float32), np.zeros((0, n_heads), np.float32)
        return (o, s) if return_lse else o
    pl = plan(m_count, n_heads, n_kv, head_dim, int(lens.max()), kind, n_split=n_split)
    st = launch_stream(stream)
    d_q, d_k = to_device(q, stream), to_device(k_cache, stream)
    d_v = to_device(v_cache, stream)
    d_lens, d_slots = to_device(lens, stream), to_device(slots, stream)
    d_out = _output("out", out, (m_count, n_heads, head_dim), stream)
    d_lse = _output("lse", lse, (m_count, n_heads), stream)
    d_pa, d_pm = scratch(m_count, n_heads, head_dim, pl["n_split"], stream)
    launch(pl, d_q, d_k, d_v, d_lens, d_slots, scale, d_out, d_lse, d_pa, d_pm, st)
    result = (d_out, d_lse)
    if host:
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    return result if return_lse else result[0]
