"""MLA kernels in absorbed form, and their launchers.

Kernels (Numba CUDA, ``attention.core.device.jit``; every planted defect is a
switch of the same source, chosen by the ``defect=`` argument of the
``*_kernel`` factories, for the falsification suite only):

``absorb_q``      ``q_lat[t,h,:] = W_UK[h]^T q_nope[t,h,:]``. Grid ``(t_q, nh)``,
                  threads stride over the ``r`` outputs, each an fp32 sum over
                  ``d_nope`` kept as four interleaved partial sums (see
                  "Accumulation" below). ``W_UK`` is read in either layout:
                  "mla" ``[nh, d_nope, r]`` (coalesced) or "checkpoint"
                  ``[nh, r, d_nope]`` (``attn_k_b``). Defect ``w_uk_transposed``
                  reads the ``[d_nope, r]`` plane of each head as ``[r, d_nope]``.
``attn_absorbed`` tiled online softmax over latent rows ``[c_kv | k_pe]`` of
                  width ``W = r + d_rope``. Grid ``(Q, ceil(nh / HG))``, one warp
                  per head, ``HG`` heads per block sharing every latent tile:
                  the block stages ``TILE`` rows in shared memory (row stride
                  ``W + 1``, so lane ``s`` reading row ``s`` is bank-conflict
                  free), lane ``s`` forms the score of row ``s`` (the dot of the
                  pre-scaled query with the whole row), ``warp_max`` /
                  ``warp_sum`` give the tile's softmax state, which
                  ``online_softmax_merge`` folds into the running one, and each
                  lane accumulates its latent columns ``lane + 32 c``. Query
                  ``q`` reads cache slot ``kv_slot[q]`` and attends positions
                  ``< kv_len[q] - q_tail[q]`` (``q_tail`` = queries after it in
                  its chunk), which is prefill (``t_q = t_kv``), chunked prefill
                  and decode (``q_tail = 0``) in one rule. Defects:
                  ``causal_offset_off_by_one`` (attends one position past the
                  causal bound: a future token), ``stuck_rescale`` (the running
                  state is never rescaled, ``alpha = 1``), ``k_pe_ignored``
                  (the rotary half of the score is dropped). Paged caches
                  (``page_size`` > 0, compile-time; ``mla.paged``): rows are
                  looked up through a page table where a tile is staged, one
                  look-up a tile inside a page; defect ``page_off_by_one``
                  (``PAGE_DEFECTS``) reads the neighbouring page. The
                  contiguous kernel (``page_size=0``) is built unchanged.
                  Multi-token decode (``s_q`` > 1, compile-time; ``s_q=1``
                  builds the kernel above unchanged): the ``s_q * nh``
                  (query, head) rows of a sequence are the warps of its
                  blocks, each with its own causal end, the tiles staged
                  once a block for all of them; defect
                  ``mla_causal_off_by_one`` (``MULTI_DEFECTS``) lets query
                  i see one row past its end.
``decompress_v``  ``out[t,h,:] = W_UV[h] o_lat[t,h,:]``; grid ``(t_q, nh)``,
                  threads over ``d_v``, four partial sums over ``r``.
``append_latent`` writes rows ``[lo, lo + n)`` of one cache plane as
                  ``[c_kv | k_pe]``, element for element (bit-exact), and sets
                  the plane's device length to ``lo + n``. Defect
                  ``append_one_row_late`` writes row ``i`` at ``lo + i + 1``.
``rope_interleaved`` in place: pair ``(2i, 2i+1)`` of every vector at row
                  ``p`` rotates by ``positions[p] * base^(-2i/d_rope)`` (angle
                  and sin/cos in float64). ``d_rope = 0`` launches nothing.
                  Defect ``rope_pairs_swapped`` rotates the half-split pairs
                  ``(i, i + d_rope/2)`` (the NeoX layout) instead.

W_UK layouts: the kernels' native layout is ``[nh, d_nope, r]`` (``mla``
layout, as in the oracles); checkpoints store ``attn_k_b`` as ``[nh, r,
d_nope]``, element ``(h, l, p) = W_UK[h, p, l]``. ``w_uk_from_checkpoint`` /
``w_uk_to_checkpoint`` convert on the host (a transpose of the last two axes);
``absorb_q(..., w_uk_layout="checkpoint")`` reads the checkpoint layout
directly and gives bit-identical results (same products, same order).

Accumulation: the long fp32 dot products (``d_nope`` in absorb_q, ``r +
d_rope`` per score, ``r`` in decompress_v) run as four interleaved partial sums
(term ``i`` into sum ``i % 4``, combined pairwise at the end). One plain
running sum over 512-576 terms had 4-6x the error of numpy's float32 baseline
in the 1024-step decode-growth run; in a numpy emulation of the kernels' order
of additions, four partial sums cut the error about 3x.

Launchers follow the project conventions: numpy arrays are copied (outputs
returned as numpy), device arrays are used in place (outputs returned as device
arrays); ``stream=None`` synchronises before returning. Every argument is
validated before anything is allocated, copied or launched.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64

from attention.core import checks
from attention.core.device import (
    SIMULATOR,
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
from attention.core.warp import FULL_MASK, online_softmax_merge, warp_max, warp_sum

WARP = 32
ABSORB_DEFECTS = ("w_uk_transposed",)
ATTN_DEFECTS = ("causal_offset_off_by_one", "stuck_rescale", "k_pe_ignored")
APPEND_DEFECTS = ("append_one_row_late",)
# the paged row addressing's (``page_size`` > 0 only; not in KERNEL_DEFECTS: the
# contiguous entry points cannot take it): rows read from page (entry + 1) % num_pages
PAGE_DEFECTS = ("page_off_by_one",)
# multi-token decode's (``s_q`` > 1 only; not in KERNEL_DEFECTS: a single query per
# sequence cannot show it): query i of s_q attends one position past its causal end
MULTI_DEFECTS = ("mla_causal_off_by_one",)
ROPE_DEFECTS = ("rope_pairs_swapped",)
KERNEL_DEFECTS = ABSORB_DEFECTS + ATTN_DEFECTS + APPEND_DEFECTS + ROPE_DEFECTS
W_UK_LAYOUTS = ("mla", "checkpoint")
CACHE_DTYPES = (np.float32, np.float16)
SHARED_BYTES = 48 * 1024  # static shared memory per block
MAX_HEADS_PER_BLOCK = 4
TILES = (32, 16, 8)


def _check_defect(defect, allowed):
    if defect not in (None,) + allowed:
        raise ValueError(f"defect: expected one of {allowed} or None, got {defect!r}")


def _threads(n, cap=256):
    """A block size: ``n`` rounded up to a warp multiple, within [32, cap].

    Under the simulator every CUDA thread is a Python thread (about 0.1-0.3 ms
    to start), so the element-wise kernels use one warp there; their threads
    stride over the work, so the result does not depend on the block size."""
    if SIMULATOR:
        return WARP
    return int(min(cap, max(WARP, (n + WARP - 1) // WARP * WARP)))


def _placeholder(stream):
    """A [1, 1, 1] float32 device array standing in for a zero-width operand
    (``d_rope = 0``): never read, but a launch argument needs a buffer."""
    return to_device(np.zeros((1, 1, 1), np.float32), stream)


# ---------------------------------------------------------------------------
# W_UK layout conversion
# ---------------------------------------------------------------------------


def w_uk_from_checkpoint(attn_k_b):
    """``attn_k_b [nh, r, d_nope]`` (checkpoint) -> ``w_uk [nh, d_nope, r]`` (host copy)."""
    checks.check_array("attn_k_b", attn_k_b, (("nh", None), ("r", None), ("d_nope", None)),
                       contiguous=False)
    return np.ascontiguousarray(np.asarray(attn_k_b).transpose(0, 2, 1))


def w_uk_to_checkpoint(w_uk):
    """``w_uk [nh, d_nope, r]`` -> ``attn_k_b [nh, r, d_nope]`` (host copy)."""
    checks.check_array("w_uk", w_uk, (("nh", None), ("d_nope", None), ("r", None)),
                       contiguous=False)
    return np.ascontiguousarray(np.asarray(w_uk).transpose(0, 2, 1))


# ---------------------------------------------------------------------------
# absorb_q
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def absorb_q_kernel(w_uk_layout="mla", defect=None):
    """``q_lat = W_UK^T q_nope`` per (query, head).

    q_nope [t_q, nh, d_nope] float32; w_uk [nh, d_nope, r] ("mla") or
    [nh, r, d_nope] ("checkpoint") float32; q_lat [t_q, nh, r] float32 (out).
    Grid (t_q, nh); any block size (threads stride over r).
    """
    _check_defect(defect, ABSORB_DEFECTS)
    if w_uk_layout not in W_UK_LAYOUTS:
        raise ValueError(f"w_uk_layout: expected one of {W_UK_LAYOUTS}, got {w_uk_layout!r}")
    CHECKPOINT = w_uk_layout == "checkpoint"
    TRANSPOSED = defect == "w_uk_transposed"

    @device_fn
    def weight(w_uk, h, p, col, rank, d_nope):
        """W_UK[h][p, col] (d_nope index p, latent column col) in either layout."""
        if TRANSPOSED:
            # the head's weight plane read with the other layout's strides
            if CHECKPOINT:
                flat = p * rank + col
                return w_uk[h, flat // d_nope, flat % d_nope]
            flat = col * d_nope + p
            return w_uk[h, flat // rank, flat % rank]
        if CHECKPOINT:
            return w_uk[h, col, p]
        return w_uk[h, p, col]

    def kernel(q_nope, w_uk, q_lat):
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        d_nope = q_nope.shape[2]
        rank = q_lat.shape[2]
        top = d_nope - d_nope % 4
        for col in range(cuda.threadIdx.x, rank, cuda.blockDim.x):
            # four interleaved partial sums (term p into sum p % 4): a long plain
            # fp32 sum loses several times the accuracy of numpy's blocked one
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            for p in range(0, top, 4):
                a0 += weight(w_uk, h, p, col, rank, d_nope) * q_nope[t, h, p]
                a1 += weight(w_uk, h, p + 1, col, rank, d_nope) * q_nope[t, h, p + 1]
                a2 += weight(w_uk, h, p + 2, col, rank, d_nope) * q_nope[t, h, p + 2]
                a3 += weight(w_uk, h, p + 3, col, rank, d_nope) * q_nope[t, h, p + 3]
            for p in range(top, d_nope):
                a0 += weight(w_uk, h, p, col, rank, d_nope) * q_nope[t, h, p]
            q_lat[t, h, col] = (a0 + a1) + (a2 + a3)

    kernel.__name__ = "mla_absorb_q_" + w_uk_layout + ("" if defect is None else "_" + defect)
    return jit(kernel, fastmath=False)


def check_w_uk(w_uk, n_head, d_nope, w_uk_layout, rank=None):
    """Validate ``w_uk`` in the given layout; returns r."""
    if w_uk_layout == "checkpoint":
        _, r, _ = checks.check_array(
            "w_uk", w_uk, (("nh", n_head), ("r", rank), ("d_nope", d_nope)), dtypes=(np.float32,))
    elif w_uk_layout == "mla":
        _, _, r = checks.check_array(
            "w_uk", w_uk, (("nh", n_head), ("d_nope", d_nope), ("r", rank)), dtypes=(np.float32,))
    else:
        raise checks.AttentionInputError(
            f"w_uk_layout: expected one of {W_UK_LAYOUTS}, got {w_uk_layout!r}")
    checks.check_range("w_uk", r, 1, 4096, what="kv_rank")
    return r


def launch_absorb_q(d_q_nope, d_w_uk, d_q_lat, st, w_uk_layout="mla", defect=None):
    """Enqueue absorb_q on device arrays (no validation)."""
    t_q, nh, rank = d_q_lat.shape
    if t_q == 0:
        return
    absorb_q_kernel(w_uk_layout, defect)[(t_q, nh), _threads(rank, 128), st](
        d_q_nope, d_w_uk, d_q_lat)


def absorb_q(q_nope, w_uk, *, w_uk_layout="mla", stream=None, defect=None):
    """Absorb W_UK into the queries.

    q_nope: [t_q, nh, d_nope] float32
    w_uk:   [nh, d_nope, r] float32 (``w_uk_layout="mla"``) or the checkpoint
            layout [nh, r, d_nope] (``"checkpoint"``, ``attn_k_b``)
    Returns q_lat [t_q, nh, r] float32.
    """
    t_q, nh, d_nope = checks.check_array(
        "q_nope", q_nope, (("t_q", None), ("nh", None), ("d_nope", None)), dtypes=(np.float32,))
    checks.check_range("q_nope", nh, 1, 1024, what="head count")
    checks.check_range("q_nope", d_nope, 1, 1024, what="d_nope")
    rank = check_w_uk(w_uk, nh, d_nope, w_uk_layout)
    st = launch_stream(stream)
    d_q_lat = device_empty((t_q, nh, rank), np.float32, stream)
    launch_absorb_q(to_device(q_nope, stream), to_device(w_uk, stream), d_q_lat, st,
                    w_uk_layout, defect)
    result = to_host(d_q_lat, stream) if is_host_array(q_nope) else d_q_lat
    finish(stream)
    return result


# ---------------------------------------------------------------------------
# decompress_v
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def decompress_v_kernel():
    """``out = W_UV o_lat`` per (query, head).

    o_lat [t_q, nh, r] float32; w_uv [nh, d_v, r] float32;
    out [t_q, nh, d_v] float32 (written). Grid (t_q, nh); threads stride over d_v.
    """

    def kernel(o_lat, w_uv, out):
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        rank = o_lat.shape[2]
        d_v = out.shape[2]
        for j in range(cuda.threadIdx.x, d_v, cuda.blockDim.x):
            # four interleaved partial sums, as in absorb_q
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            top = rank - rank % 4
            for col in range(0, top, 4):
                a0 += w_uv[h, j, col] * o_lat[t, h, col]
                a1 += w_uv[h, j, col + 1] * o_lat[t, h, col + 1]
                a2 += w_uv[h, j, col + 2] * o_lat[t, h, col + 2]
                a3 += w_uv[h, j, col + 3] * o_lat[t, h, col + 3]
            for col in range(top, rank):
                a0 += w_uv[h, j, col] * o_lat[t, h, col]
            out[t, h, j] = (a0 + a1) + (a2 + a3)

    kernel.__name__ = "mla_decompress_v"
    return jit(kernel, fastmath=False)


def launch_decompress_v(d_o_lat, d_w_uv, d_out, st):
    t_q, nh, d_v = d_out.shape
    if t_q == 0:
        return
    decompress_v_kernel()[(t_q, nh), _threads(d_v, 128), st](d_o_lat, d_w_uv, d_out)


def decompress_v(o_lat, w_uv, *, stream=None):
    """Decompress latent outputs through W_UV.

    o_lat: [t_q, nh, r] float32; w_uv: [nh, d_v, r] float32.
    Returns out [t_q, nh, d_v] float32.
    """
    t_q, nh, rank = checks.check_array(
        "o_lat", o_lat, (("t_q", None), ("nh", None), ("r", None)), dtypes=(np.float32,))
    _, d_v, _ = checks.check_array(
        "w_uv", w_uv, (("nh", nh), ("d_v", None), ("r", rank)), dtypes=(np.float32,))
    checks.check_range("w_uv", d_v, 1, 1024, what="d_v")
    st = launch_stream(stream)
    d_out = device_empty((t_q, nh, d_v), np.float32, stream)
    launch_decompress_v(to_device(o_lat, stream), to_device(w_uv, stream), d_out, st)
    result = to_host(d_out, stream) if is_host_array(o_lat) else d_out
    finish(stream)
    return result


# ---------------------------------------------------------------------------
# attn_absorbed
# ---------------------------------------------------------------------------


def shared_bytes(width, tile, heads_per_block):
    """Static shared memory of one attn_absorbed block (float32 words * 4)."""
    return 4 * (tile * (width + 1) + heads_per_block * width + heads_per_block * tile)


def plan_blocks(n_head, width, tile=None, heads_per_block=None):
    """(tile, heads_per_block) for attn_absorbed: the largest tile of
    ``TILES`` that fits the static shared memory with ``heads_per_block``
    (default ``min(nh, 4)``) warps per block."""
    hg = heads_per_block if heads_per_block is not None else min(n_head, MAX_HEADS_PER_BLOCK)
    checks.check_range("heads_per_block", int(hg), 1, 32, what="warps per block")
    if tile is not None:
        if tile not in TILES:
            raise checks.RangeError(f"tile: expected one of {TILES}, got {tile}")
        if shared_bytes(width, tile, hg) > SHARED_BYTES:
            raise checks.RangeError(
                f"tile: {tile} rows of width {width} with {hg} heads per block need "
                f"{shared_bytes(width, tile, hg)} bytes of shared memory (max {SHARED_BYTES})")
        return int(tile), int(hg)
    for t in TILES:
        if shared_bytes(width, t, hg) <= SHARED_BYTES:
            return t, int(hg)
    raise checks.RangeError(
        f"latent: rows of width {width} do not fit shared memory even as {TILES[-1]}-row tiles")


@functools.lru_cache(maxsize=None)
def attn_absorbed_kernel(kv_rank, d_rope, tile, heads_per_block, defect=None, page_size=0,
                         s_q=1):
    """Tiled online-softmax attention over latent rows ``[c_kv | k_pe]``.

    Arguments (C-contiguous):
        q_lat   [Q, nh, r] float32        absorbed queries
        q_pe    [Q, nh, d_rope] float32   rotary queries ([1, 1, 1] placeholder if d_rope = 0)
        latent  [S, max_seq, r + d_rope] float32 or float16: latent rows of S sequences
        kv_slot [Q] int32   the latent sequence query q reads
        kv_len  [Q] int32   rows 0..kv_len[q]-1 of that sequence are cached
        q_tail  [Q] int32   queries after q in its chunk: q attends rows < kv_len - q_tail
        scale   float32
        o_lat   [Q, nh, r] float32 (out)   softmax-weighted sum of c_kv rows
        lse     [Q, nh] float32 (out)      natural-log LSE of the scaled scores; -inf if empty
    Grid (Q, ceil(nh / heads_per_block)); block 32 * heads_per_block threads.

    ``page_size`` P > 0 (compile-time; 0, the default, builds the kernel
    above unchanged): ``latent`` is a paged cache ``[num_pages, P, r +
    d_rope]`` and ``kv_slot`` the page table ``[Q, max_pages]`` int32: row
    ``t`` of query q's sequence is row ``t % P`` of page ``kv_slot[q, t //
    P]``. A tile of rows inside one page takes one table look-up (always so
    when P is a multiple of ``tile``); a tile across pages looks each row up.
    Only the entries of pages holding visible rows are read. Defect
    ``page_off_by_one`` (``PAGE_DEFECTS``, paged only): rows read from page
    ``(entry + 1) % num_pages``.

    ``s_q`` > 1 (compile-time; 1, the default, builds the kernel above
    unchanged): multi-token decode. ``Q`` is then the number of sequences B
    and the ``nh`` of the arrays is ``s_q * nh_q``: q_lat [B, s_q * nh_q, r],
    q_pe [B, s_q * nh_q, d_rope], o_lat [B, s_q * nh_q, r], lse [B, s_q *
    nh_q] (the [B * s_q, nh_q, ...] arrays of the queries, viewed so), row
    ``i * nh_q + h`` being head h of query i. Every warp (one row) attends
    rows ``< kv_len - q_tail - (s_q - 1 - i)`` of the sequence; a block
    stages the tiles of its last row's bound once for all its rows (the
    cache is read once a block, whatever the queries of its rows), and each
    warp folds in only its own rows of a tile: a tile past a warp's bound
    leaves its state as it was (``alpha`` 1, ``beta`` 0), so each row gets
    the bits of a one-query decode over its prefix. Defect
    ``mla_causal_off_by_one`` (``MULTI_DEFECTS``): query i attends one row
    past its bound (never past ``kv_len``).
    """
    _check_defect(defect, ATTN_DEFECTS + (PAGE_DEFECTS if page_size else ())
                  + (MULTI_DEFECTS if int(s_q) > 1 else ()))
    if int(page_size) < 0:
        raise ValueError(f"page_size: expected 0 (contiguous) or >= 1, got {page_size}")
    if int(s_q) < 1:
        raise ValueError(f"s_q: expected queries a sequence >= 1, got {s_q}")
    S_Q = int(s_q)
    MULTI = S_Q > 1
    LEAK_Q = 1 if defect == "mla_causal_off_by_one" else 0
    PAGED = int(page_size) > 0
    P = max(int(page_size), 1)
    PAGE_SHIFT = defect == "page_off_by_one"
    TILE_IN_PAGE = P % tile == 0  # tiles start at multiples of tile
    R = kv_rank
    DR = d_rope
    W = kv_rank + d_rope
    W4 = W - W % 4
    WP = W + 1  # padded row stride: lane s reading row s hits bank (s + d) % 32
    TILE = tile
    HG = heads_per_block
    CR = (kv_rank + WARP - 1) // WARP
    LEAK = 1 if defect == "causal_offset_off_by_one" else 0
    STUCK = defect == "stuck_rescale"
    NO_PE = defect == "k_pe_ignored"

    @device_fn
    def page_of(latent, pages, j):
        """Paged only: the page holding rows j P .. j P + P - 1 (``pages``: the
        sequence's row of the page table)."""
        page = pages[j]
        if PAGE_SHIFT:  # the neighbouring page, kept in bounds
            page = (page + 1) % latent.shape[0]
        return page

    @device_fn
    def stage_paged(tile_rows, latent, pages, t0, n_valid, tid, n_threads):
        """Paged only: rows t0 .. t0 + n_valid - 1 into ``tile_rows`` (all
        warps, coalesced), one table look-up when they lie in one page."""
        if TILE_IN_PAGE or t0 // P == (t0 + n_valid - 1) // P:
            page = page_of(latent, pages, t0 // P)
            off = t0 % P
            for idx in range(tid, n_valid * W, n_threads):
                s = idx // W
                d = idx - s * W
                tile_rows[s, d] = float32(latent[page, off + s, d])
        else:
            for idx in range(tid, n_valid * W, n_threads):
                s = idx // W
                d = idx - s * W
                t = t0 + s
                tile_rows[s, d] = float32(latent[page_of(latent, pages, t // P), t % P, d])

    def kernel(q_lat, q_pe, latent, kv_slot, kv_len, q_tail, scale, o_lat, lse):
        q = cuda.blockIdx.x
        head0 = cuda.blockIdx.y * HG
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        n_threads = cuda.blockDim.x
        n_heads = q_lat.shape[1]
        head = head0 + warp

        tile_rows = cuda.shared.array((TILE, WP), float32)
        q_rows = cuda.shared.array((HG, W), float32)
        p_rows = cuda.shared.array((HG, TILE), float32)

        # -- which rows this block's query attends (the same for all its heads) --
        slot = kv_slot[q]  # paged: the query's row of the page table
        length = kv_len[q]
        visible = min(length, length - q_tail[q] + LEAK)
        if MULTI:
            # rows are (query i, head) pairs, row = i * nh_q + h: query i sees
            # s_q - 1 - i rows fewer; the tiles run to the block's last live row's bound
            nh_q = n_heads // S_Q
            i_w = min(head, n_heads - 1) // nh_q
            vis_w = min(visible, max(visible - (S_Q - 1 - i_w) + LEAK_Q, 0))
            i_last = (min(head0 + HG, n_heads) - 1) // nh_q
            visible = min(visible, max(visible - (S_Q - 1 - i_last) + LEAK_Q, 0))

        # -- stage the block's queries [q_lat | q_pe], pre-scaled --
        for idx in range(tid, HG * W, n_threads):
            w = idx // W
            d = idx - w * W
            h = head0 + w
            val = float32(0.0)
            if h < n_heads:
                if d < R:
                    val = q_lat[q, h, d] * scale
                elif not NO_PE:
                    val = q_pe[q, h, d - R] * scale
            q_rows[w, d] = val

        acc = cuda.local.array(CR, float32)
        for c in range(CR):
            acc[c] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        cuda.syncthreads()  # q_rows complete before any lane reads them

        for t0 in range(0, visible, TILE):
            n_valid = min(TILE, visible - t0)
            # -- stage latent rows t0 .. t0+n_valid-1 (all warps, coalesced) --
            if PAGED:
                stage_paged(tile_rows, latent, slot, t0, n_valid, tid, n_threads)
            else:
                for idx in range(tid, n_valid * W, n_threads):
                    s = idx // W
                    d = idx - s * W
                    tile_rows[s, d] = float32(latent[slot, t0 + s, d])
            cuda.syncthreads()  # the tile is complete
            if MULTI:
                # this warp's rows of the tile (none when <= 0: the state is kept)
                n_valid = min(TILE, vis_w - t0)

            # -- score of row t0 + lane against this warp's head --
            score = float32(-math.inf)
            if lane < n_valid:
                # four interleaved partial sums over the row (W4 = W rounded
                # down to a multiple of 4), as in absorb_q
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                for d in range(0, W4, 4):
                    a0 += q_rows[warp, d] * tile_rows[lane, d]
                    a1 += q_rows[warp, d + 1] * tile_rows[lane, d + 1]
                    a2 += q_rows[warp, d + 2] * tile_rows[lane, d + 2]
                    a3 += q_rows[warp, d + 3] * tile_rows[lane, d + 3]
                for d in range(W4, W):
                    a0 += q_rows[warp, d] * tile_rows[lane, d]
                score = (a0 + a1) + (a2 + a3)

            # -- the tile's softmax state, folded into the running one --
            m_tile = warp_max(score)
            p = math.exp(score - m_tile) if lane < n_valid else float32(0.0)
            l_tile = warp_sum(p)
            if lane < TILE:
                p_rows[warp, lane] = p
            if STUCK:
                m = max(m, m_tile)  # the old max is gone before the rescale reads it
                alpha = float32(1.0)
                beta = math.exp(m_tile - m)
                l = l * alpha + l_tile * beta
            else:
                m, l, alpha, beta = online_softmax_merge(m, l, m_tile, l_tile)
            cuda.syncwarp(FULL_MASK)  # p_rows of this warp visible to all its lanes

            # -- rescale, add this tile's weighted latent columns --
            for c in range(CR):
                col = lane + c * WARP
                if col < R:
                    part = float32(0.0)
                    for s in range(n_valid):
                        part += p_rows[warp, s] * tile_rows[s, col]
                    acc[c] = acc[c] * alpha + beta * part
            cuda.syncthreads()  # every warp is done with the tile before it is restaged

        # -- epilogue: normalise; nothing visible gives zeros and -inf --
        if head < n_heads:
            inv = float32(1.0) / l if l > float32(0.0) else float32(0.0)
            for c in range(CR):
                col = lane + c * WARP
                if col < R:
                    o_lat[q, head, col] = acc[c] * inv
            if lane == 0:
                lse[q, head] = m + math.log(l) if l > float32(0.0) else float32(-math.inf)

    kernel.__name__ = f"mla_attn_absorbed_r{R}_p{DR}_t{TILE}_g{HG}" + (
        f"_paged{P}" if PAGED else "") + (f"_sq{S_Q}" if MULTI else "") + (
        "" if defect is None else "_" + defect)
    # no fastmath: its no-infinities assumption would license folding away the
    # -inf masking and empty-sequence paths; the exps are 1 per TILE*W FMAs anyway
    return jit(kernel, fastmath=False)


def launch_attn_absorbed(d_q_lat, d_q_pe, d_latent, d_slot, d_len, d_tail, scale,
                         d_o_lat, d_lse, st, *, d_rope, tile, heads_per_block, defect=None,
                         page_size=0, s_q=1):
    """Enqueue attn_absorbed on device arrays (no validation). ``page_size``
    > 0: ``d_latent`` is a paged cache [num_pages, page_size, r + d_rope] and
    ``d_slot`` the page table [Q, max_pages] int32 (``attn_absorbed_kernel``).
    ``s_q`` > 1: d_q_lat / d_q_pe / d_o_lat [B * s_q, nh, .] and d_lse [B *
    s_q, nh] hold s_q queries a sequence (query-major within a sequence);
    d_slot, d_len, d_tail are per sequence [B]; one launch over the B
    sequences, the s_q * nh rows of each sharing its blocks' tiles."""
    n_q, nh, rank = (int(x) for x in d_q_lat.shape)
    if n_q == 0:
        return
    if s_q > 1:
        n_b, rows = n_q // s_q, s_q * nh
        d_q_lat = d_q_lat.reshape((n_b, rows, rank))
        if d_rope:
            d_q_pe = d_q_pe.reshape((n_b, rows, d_rope))
        d_o_lat = d_o_lat.reshape((n_b, rows, rank))
        d_lse = d_lse.reshape((n_b, rows))
        n_q, nh = n_b, rows
        kernel = attn_absorbed_kernel(rank, d_rope, tile, heads_per_block, defect,
                                      int(page_size), int(s_q))
    elif page_size:
        kernel = attn_absorbed_kernel(rank, d_rope, tile, heads_per_block, defect,
                                      int(page_size))
    else:
        kernel = attn_absorbed_kernel(rank, d_rope, tile, heads_per_block, defect)
    grid = (n_q, (nh + heads_per_block - 1) // heads_per_block)
    kernel[grid, WARP * heads_per_block, st](
        d_q_lat, d_q_pe, d_latent, d_slot, d_len, d_tail, np.float32(scale), d_o_lat, d_lse)


def check_queries(q_lat, q_pe):
    """Validate q_lat [Q, nh, r] and q_pe [Q, nh, d_rope]; returns (Q, nh, r, d_rope)."""
    n_q, nh, rank = checks.check_array(
        "q_lat", q_lat, (("Q", None), ("nh", None), ("r", None)), dtypes=(np.float32,))
    checks.check_range("q_lat", nh, 1, 1024, what="head count")
    checks.check_range("q_lat", rank, 1, 4096, what="kv_rank")
    _, _, d_rope = checks.check_array(
        "q_pe", q_pe, (("Q", n_q), ("nh", nh), ("d_rope", None)), dtypes=(np.float32,))
    if d_rope % 2:
        raise checks.RangeError(f"q_pe: expected an even d_rope, got {d_rope}")
    return n_q, nh, rank, d_rope


def _q_pe_or_placeholder(q_pe, d_rope, stream):
    return to_device(q_pe, stream) if d_rope else _placeholder(stream)


def attn_absorbed(q_lat, q_pe, latent, t_kv, scale, *, stream=None, return_lse=False,
                  tile=None, heads_per_block=None, defect=None):
    """Absorbed attention of one sequence's last ``t_q`` positions.

    q_lat:  [t_q, nh, r] float32 (``absorb_q`` output)
    q_pe:   [t_q, nh, d_rope] float32 (rotated)
    latent: [max_seq, r + d_rope] float32 or float16; rows 0..t_kv-1 are read
    t_kv:   int, t_q <= t_kv <= max_seq; query i attends rows 0..t_kv - t_q + i
    scale:  float (MLA's default is 1/sqrt(d_nope + d_rope): pass it)
    Returns o_lat [t_q, nh, r] float32 (and lse [t_q, nh] with ``return_lse``).
    """
    t_q, nh, rank, d_rope = check_queries(q_lat, q_pe)
    max_seq, _ = checks.check_array(
        "latent", latent, (("max_seq", None), ("r+d_rope", rank + d_rope)), dtypes=CACHE_DTYPES)
    if not isinstance(t_kv, (int, np.integer)):
        raise checks.DTypeError(f"t_kv: expected an int, got {type(t_kv).__name__}")
    checks.check_range("t_kv", int(t_kv), t_q, max_seq, what="length (t_q <= t_kv <= max_seq)")
    scale = checks.check_scale(scale, 1)
    tile, hg = plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    lens = np.full(t_q, int(t_kv), np.int32)
    tails = (t_q - 1 - np.arange(t_q)).astype(np.int32)
    d_latent = to_device(latent, stream)
    d_latent = d_latent.reshape((1,) + tuple(d_latent.shape))
    return _attn(q_lat, q_pe, d_latent, np.zeros(t_q, np.int32), lens, tails, scale,
                 stream, return_lse, tile, hg, d_rope, defect)


def attn_absorbed_batched(q_lat, q_pe, latent, lengths, scale, *, stream=None,
                          return_lse=False, tile=None, heads_per_block=None, defect=None):
    """Absorbed decode attention: one query per sequence over its own latent rows.

    q_lat:   [B, nh, r] float32;  q_pe: [B, nh, d_rope] float32
    latent:  [B, max_seq, r + d_rope] float32 or float16
    lengths: [B] ints in [0, max_seq]; 0 gives zeros and LSE -inf
    Returns o_lat [B, nh, r] float32 (and lse [B, nh]).
    """
    n_b, nh, rank, d_rope = check_queries(q_lat, q_pe)
    _, max_seq, _ = checks.check_array(
        "latent", latent, (("B", n_b), ("max_seq", None), ("r+d_rope", rank + d_rope)),
        dtypes=CACHE_DTYPES)
    lens = checks.check_lengths("lengths", host_ints(lengths), max_seq, count=n_b)
    scale = checks.check_scale(scale, 1)
    tile, hg = plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    return _attn(q_lat, q_pe, to_device(latent, stream), np.arange(n_b, dtype=np.int32), lens,
                 np.zeros(n_b, np.int32), scale, stream, return_lse, tile, hg, d_rope, defect)


def _attn(q_lat, q_pe, d_latent, slots, lens, tails, scale, stream, return_lse, tile, hg,
          d_rope, defect):
    n_q, nh, rank = (int(s) for s in q_lat.shape)
    st = launch_stream(stream)
    d_o_lat = device_empty((n_q, nh, rank), np.float32, stream)
    d_lse = device_empty((n_q, nh), np.float32, stream)
    launch_attn_absorbed(to_device(q_lat, stream), _q_pe_or_placeholder(q_pe, d_rope, stream),
                         d_latent, to_device(slots, stream), to_device(lens, stream),
                         to_device(tails, stream), scale, d_o_lat, d_lse, st, d_rope=d_rope,
                         tile=tile, heads_per_block=hg, defect=defect)
    result = (d_o_lat, d_lse)
    if is_host_array(q_lat):
        result = (to_host(d_o_lat, stream), to_host(d_lse, stream))
    finish(stream)
    return result if return_lse else result[0]


# ---------------------------------------------------------------------------
# append_latent
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def append_latent_kernel(defect=None):
    """Write rows ``[lo, lo + n)`` of cache plane ``plane`` as ``[c_kv | k_pe]``.

    cache   [P, max_seq, r + d_rope] float32 or float16 (written in place)
    plane   int32, lo int32
    c_kv    [n, r], k_pe [n, d_rope] (a [1, 1] placeholder when d_rope = 0),
            the cache's dtype (copied element for element: bit-exact)
    lengths [P] int32: lengths[plane] = lo + n (the device copy of the length)
    Grid (n,); threads stride over the row.
    """
    _check_defect(defect, APPEND_DEFECTS)
    SHIFT = 1 if defect == "append_one_row_late" else 0

    def kernel(cache, plane, lo, c_kv, k_pe, lengths):
        i = cuda.blockIdx.x
        rank = c_kv.shape[1]
        width = cache.shape[2]
        row = lo + i + SHIFT
        if row < cache.shape[1]:
            for d in range(cuda.threadIdx.x, width, cuda.blockDim.x):
                if d < rank:
                    cache[plane, row, d] = c_kv[i, d]
                else:
                    cache[plane, row, d] = k_pe[i, d - rank]
        if i == 0 and cuda.threadIdx.x == 0:
            lengths[plane] = lo + c_kv.shape[0]

    kernel.__name__ = "mla_append_latent" + ("" if defect is None else "_" + defect)
    return jit(kernel)


def check_append(cache, c_kv, k_pe, lo, plane=0):
    """Validate an append; returns (planes, max_seq, r, d_rope, n, lo, plane)."""
    if len(getattr(cache, "shape", ())) == 2:
        dims = (("max_seq", None), ("r+d_rope", None))
    else:
        dims = (("P", None), ("max_seq", None), ("r+d_rope", None))
    shape = checks.check_array("cache", cache, dims, dtypes=CACHE_DTYPES)
    n_planes = 1 if len(shape) == 2 else shape[0]
    max_seq, width = shape[-2:]
    cdt = checks._dtype(cache)
    n, rank = checks.check_array("c_kv", c_kv, (("n", None), ("r", None)), dtypes=(cdt,))
    if rank < 1 or rank > width:
        raise checks.ShapeError(f"c_kv: expected 1 <= r <= r+d_rope={width}, got r={rank}")
    checks.check_array("k_pe", k_pe, (("n", n), ("d_rope", width - rank)), dtypes=(cdt,))
    for name, value in (("lo", lo), ("plane", plane)):
        if not isinstance(value, (int, np.integer)):
            raise checks.DTypeError(f"{name}: expected an int, got {type(value).__name__}")
    checks.check_range("plane", int(plane), 0, n_planes - 1, what="cache plane")
    checks.check_range("lo", int(lo), 0, max_seq, what="first row")
    if int(lo) + n > max_seq:
        raise checks.RangeError(
            f"cache: rows [{int(lo)}, {int(lo) + n}) would overflow max_seq={max_seq}")
    return n_planes, max_seq, rank, width - rank, n, int(lo), int(plane)


def launch_append_latent(d_cache, plane, lo, d_c_kv, d_k_pe, d_lengths, st, defect=None):
    n = d_c_kv.shape[0]
    if n == 0:
        return
    append_latent_kernel(defect)[n, _threads(d_cache.shape[2], 128), st](
        d_cache, np.int32(plane), np.int32(lo), d_c_kv, d_k_pe, d_lengths)


def append_latent(cache, c_kv, k_pe, lo, *, plane=0, lengths=None, stream=None, defect=None):
    """Write rows ``[lo, lo + n)`` of a latent cache as ``[c_kv | k_pe]`` (bit-exact).

    cache:   [max_seq, r + d_rope] or [P, max_seq, r + d_rope], float32 or float16;
             a numpy cache is updated in place (copied back)
    c_kv:    [n, r], k_pe: [n, d_rope], the cache's dtype
    lo:      int, first row; lo + n <= max_seq (else RangeError, nothing written)
    plane:   int, which plane of a [P, ...] cache
    lengths: optional device int32 [P]: lengths[plane] is set to lo + n
    Returns the cache.
    """
    n_planes, max_seq, rank, d_rope, n, lo, plane = check_append(cache, c_kv, k_pe, lo, plane)
    if lengths is not None:
        checks.check_array("lengths", lengths, (("P", n_planes),), dtypes=(np.int32,))
    if n == 0:
        return cache
    st = launch_stream(stream)
    d_cache = to_device(cache, stream)
    pooled = d_cache if len(d_cache.shape) == 3 else d_cache.reshape((1,) + tuple(d_cache.shape))
    d_k_pe = to_device(k_pe, stream) if d_rope else to_device(np.zeros((1, 1), cache.dtype),
                                                              stream)
    d_lengths = (to_device(lengths, stream) if lengths is not None
                 else device_empty(n_planes, np.int32, stream))
    launch_append_latent(pooled, plane, lo, to_device(c_kv, stream), d_k_pe, d_lengths, st,
                         defect)
    if is_host_array(cache):
        d_cache.copy_to_host(cache, stream=st)
    if lengths is not None and is_host_array(lengths):
        d_lengths.copy_to_host(lengths, stream=st)
    finish(stream)
    return cache


# ---------------------------------------------------------------------------
# rope_interleaved
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def rope_kernel(defect=None):
    """Rotate ``x`` in place, pairs (2i, 2i+1) of row p by positions[p] * base^(-2i/d).

    x         [n_pos, n_vec, d_rope] float32 (in place), d_rope even and > 0
    positions [n_pos] int32
    base      float64
    Grid (n_pos,); threads stride over the n_vec * d_rope / 2 pairs.
    """
    _check_defect(defect, ROPE_DEFECTS)
    SWAPPED = defect == "rope_pairs_swapped"

    def kernel(x, positions, base):
        row = cuda.blockIdx.x
        n_vec = x.shape[1]
        d_rope = x.shape[2]
        half = d_rope // 2
        pos = float64(positions[row])
        for k in range(cuda.threadIdx.x, n_vec * half, cuda.blockDim.x):
            v = k // half
            i = k - v * half
            theta = math.pow(base, -float64(2 * i) / float64(d_rope))
            angle = pos * theta
            cos = math.cos(angle)
            sin = math.sin(angle)
            if SWAPPED:
                a = i
                b = i + half
            else:
                a = 2 * i
                b = 2 * i + 1
            x0 = float64(x[row, v, a])
            x1 = float64(x[row, v, b])
            x[row, v, a] = float32(x0 * cos - x1 * sin)
            x[row, v, b] = float32(x0 * sin + x1 * cos)

    kernel.__name__ = "mla_rope_interleaved" + ("" if defect is None else "_" + defect)
    return jit(kernel, fastmath=False)


def rope_interleaved(x, positions, *, base=10000.0, stream=None, defect=None):
    """Interleaved RoPE in place.

    x:         [n_pos, d_rope] or [n_pos, n_vec, d_rope] float32 (numpy: updated in
               place via a copy back; device: in place)
    positions: [n_pos] ints >= 0
    base:      finite > 0
    d_rope = 0 (or n_pos = 0) leaves ``x`` untouched and launches nothing.
    Returns x.
    """
    if len(getattr(x, "shape", ())) == 2:
        n_pos, d_rope = checks.check_array("x", x, (("n_pos", None), ("d_rope", None)),
                                           dtypes=(np.float32,))
        n_vec = 1
    else:
        n_pos, n_vec, d_rope = checks.check_array(
            "x", x, (("n_pos", None), ("n_vec", None), ("d_rope", None)), dtypes=(np.float32,))
    if d_rope % 2:
        raise checks.RangeError(f"x: expected an even d_rope, got {d_rope}")
    pos = host_ints(positions)
    if pos.ndim != 1 or pos.shape[0] != n_pos:
        raise checks.ShapeError(f"positions: expected shape [n_pos={n_pos}], got {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise checks.DTypeError(f"positions: expected integers, got {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() > 2**31 - 1):
        raise checks.RangeError(f"positions: expected positions >= 0, got {int(pos.min())}")
    base = float(base)
    if not np.isfinite(base) or base <= 0:
        raise checks.RangeError(f"base: expected a finite positive number, got {base}")
    if d_rope == 0 or n_pos == 0 or n_vec == 0:
        return x
    kernel = rope_kernel(defect)  # before any copy: an unknown defect raises here
    st = launch_stream(stream)
    d_x = to_device(x, stream)
    view = d_x.reshape((n_pos, n_vec, d_rope))
    kernel[n_pos, _threads(n_vec * d_rope // 2, 128), st](
        view, to_device(pos.astype(np.int32), stream), np.float64(base))
    if is_host_array(x):
        d_x.copy_to_host(x, stream=st)
    finish(stream)
    return x
