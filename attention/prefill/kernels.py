"""Multi-head prefill attention: the fused online-softmax kernel (the product path).

    out[t, h*D:(h+1)*D] = softmax(scale * q_h[t] . k_g[:n_t]^T) @ v_g[:n_t]

over T tokens with interleaved rows (``x[t, h*D + d]``), where query head
``h`` reads kv head ``g = h * H_kv // H`` (GQA) and ``n_t = t + 1`` when
causal, ``T`` otherwise. It also produces ``lse[h, t]``, the natural-log
log-sum-exp of row ``t``'s scaled scores.

Layouts (C-contiguous, float32):
    q    [T, H*D]       k, v  [T, H_kv*D]       out [T, H*D]       lse [H, T]

The kernel (``fused_kernel``) never materialises scores. A block owns ``BQ``
query rows of one head (grid ``(ceil(T/BQ), H)``, ``NW`` warps, each warp
``RW`` consecutive rows). It stages its Q rows (pre-scaled) in shared memory
once, then streams K/V in tiles of ``BK`` keys through shared memory. Lane
``j`` scores key ``k0 + j`` against each of its warp's rows; the row's tile
maximum comes from ``warp_max``, and ``online_softmax_merge`` folds the tile
into the running state (running max warp-uniform, running sum kept as
per-lane partials, which the merge's linearity allows, summed by ``warp_sum``
once at the end). The tile's probabilities go through a per-warp shared
buffer to ``acc += p V``, lane ``c`` owning output columns ``c, c+32, ...``.
Causal blocks stop at their last row's diagonal and warps skip tiles none of
their rows can see.

Reference paths: the per-head and batched designs (a chain of gather,
transpose, GEMM, scale, softmax, GEMM launches over materialised ``[T, T]``
scores) live in ``attention.reference.prefill_paths``
(``prefill_attention_reference(..., method="batched" | "per_head")``); they
share this module's argument checks and planted defects, and nothing here
imports them. ``prefill_attention(method=...)`` takes ``"fused"`` (this
kernel) and ``"tf32"`` (the float32 tensor-core kernel, ``attention.prefill.tf32``);
a reference method name raises ``checks.RangeError`` naming that entry point.

``prefill_attention`` takes numpy arrays (copied; numpy results) or device
arrays (numba, ``__cuda_array_interface__``, DLPack; device results) and an
optional ``stream`` on which its launch is enqueued, so it can be timed with
events on that stream.

Debug switch: ``ATTN_PREFILL_DEBUG=1`` logs (logger ``attention.prefill.kernels``,
INFO; a stderr handler is added when logging is not configured; helpers in
``attention.prefill.debug``) for head 0: the means of Q/K/V, the score
statistics, the largest deviation of a softmax row sum from 1 (recomputed on
the host from the kernel's LSE: ``sum_j exp(s_tj - lse_t)``), and the output
statistics. It synchronises and copies, so it is for tracing, not timing.

Planted defects (``defect=``, falsification suite only; the same kernel
source with one closure constant flipped, ``validation/suite_prefill.py``;
the reference paths carry the same two):
    "softmax_not_normalised"  the fused epilogue skips the division by the
                              row sum
    "causal_off_by_one"       a causal row sees one key too many (0 .. t+1)
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
from numba import cuda, float32

from attention.core import checks
from attention.core.device import (
    device_empty,
    finish,
    is_host_array,
    jit,
    launch_stream,
    to_device,
    to_host,
)
from attention.core.warp import FULL_MASK, online_softmax_merge, warp_max, warp_sum
from attention.prefill.debug import (  # noqa: F401 - DEBUG_ENV, debug_enabled: public here too
    DEBUG_ENV,
    debug_enabled,
    debug_logger,
    host_copy,
    stats,
    trace_inputs,
    trace_probabilities,
)
from attention.prefill.frame import int_arg

WARP = 32
METHODS = ("fused", "tf32")
# the designs kept in attention.reference.prefill_paths, reachable only from there
REFERENCE_METHODS = ("batched", "per_head")
REFERENCE_ENTRY = "attention.reference.prefill_paths.prefill_attention_reference"
PREFILL_DEFECTS = ("softmax_not_normalised", "causal_off_by_one")
FUSED_WARPS = 4
SHARED_BUDGET = 48 * 1024  # static shared memory per block, bytes
MAX_ACC = 16  # accumulator registers per lane: RW rows x ceil(D/32) columns

log = logging.getLogger("attention.prefill.kernels")


# ---------------------------------------------------------------------------
# fused kernel
# ---------------------------------------------------------------------------

def fused_config(head_dim):
    """Tile sizes of the fused kernel for ``head_dim``: ``(BK, RW, k_stride)``.

    BK keys per K/V tile (one per lane; 16 when D > 128 so the tiles fit),
    RW query rows per warp (at most ``MAX_ACC // ceil(D/32)``, fewer until the
    shared memory fits ``SHARED_BUDGET``), and the K tile's row stride (odd,
    so lanes reading ``k_tile[lane, d]`` hit distinct banks).
    """
    chunks = (head_dim + WARP - 1) // WARP
    bk = WARP if head_dim <= 128 else 16
    k_stride = head_dim + 1 if head_dim % 2 == 0 else head_dim
    rw = max(1, min(8, MAX_ACC // chunks))
    while rw > 1:
        bq = FUSED_WARPS * rw
        shared = 4 * (bq * head_dim + bk * k_stride + bk * head_dim + bq * bk)
        if shared <= SHARED_BUDGET:
            break
        rw -= 1
    return bk, rw, k_stride


@functools.lru_cache(maxsize=None)
def fused_kernel(head_dim, causal, defect=None):
    """The fused prefill kernel for one head size and masking mode.

    ``defect`` selects a planted defect (module docstring); None is correct.
    Grid ``(ceil(T / BQ), H)``, block ``FUSED_WARPS * 32`` threads, where
    ``BQ = FUSED_WARPS * RW`` (``fused_rows_per_block(head_dim)``).
    """
    if defect not in (None,) + PREFILL_DEFECTS:
        raise ValueError(f"defect: expected one of {PREFILL_DEFECTS} or None, got {defect!r}")
    D = head_dim
    CH = (D + WARP - 1) // WARP
    BK, RW, KS = fused_config(D)
    NW = FUSED_WARPS
    BQ = NW * RW
    NT = NW * WARP
    CAUSAL = bool(causal)
    NORMALISE = defect != "softmax_not_normalised"
    SHIFT = 1 if defect == "causal_off_by_one" else 0

    def kernel(q, k, v, scale, out, lse):
        """Fused attention for BQ query rows of one head.

        q:     [T, H*D] float32, interleaved query rows
        k, v:  [T, H_kv*D] float32, interleaved key / value rows
        scale: float32, multiplies every score
        out:   [T, H*D] float32 out
        lse:   [H, T] float32 out, natural-log log-sum-exp per (head, row)
        """
        q_tile = cuda.shared.array((BQ, D), float32)
        k_tile = cuda.shared.array((BK, KS), float32)
        v_tile = cuda.shared.array((BK, D), float32)
        p_tile = cuda.shared.array((BQ, BK), float32)

        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        head = cuda.blockIdx.y
        t_len = q.shape[0]
        n_heads = q.shape[1] // D
        n_kv = k.shape[1] // D
        g = head * n_kv // n_heads
        q0 = cuda.blockIdx.x * BQ
        row0 = warp * RW  # this warp's first row within the block

        # -- stage this block's query rows, pre-scaled; rows past T are zeros --
        for e in range(tid, BQ * D, NT):
            r = e // D
            d = e % D
            t = q0 + r
            q_tile[r, d] = q[t, head * D + d] * scale if t < t_len else float32(0.0)

        m = cuda.local.array(RW, float32)  # running max, warp-uniform
        l = cuda.local.array(RW, float32)  # this lane's part of the running sum
        alpha = cuda.local.array(RW, float32)
        score = cuda.local.array(RW, float32)
        acc = cuda.local.array((RW, CH), float32)
        v_frag = cuda.local.array(CH, float32)
        for r in range(RW):
            m[r] = float32(-math.inf)
            l[r] = float32(0.0)
            for c in range(CH):
                acc[r, c] = float32(0.0)

        kv_end = t_len
        if CAUSAL:
            kv_end = min(t_len, q0 + BQ + SHIFT)
        warp_last_row = q0 + row0 + RW - 1

        for k0 in range(0, kv_end, BK):
            cuda.syncthreads()  # Q staged (first tile) / everyone done with the previous K, V
            # -- stage K and V rows k0 .. k0+BK-1 of kv head g; keys past T are zeros --
            for e in range(tid, BK * D, NT):
                j = e // D
                d = e % D
                key = k0 + j
                if key < t_len:
                    k_tile[j, d] = k[key, g * D + d]
                    v_tile[j, d] = v[key, g * D + d]
                else:
                    k_tile[j, d] = float32(0.0)
                    v_tile[j, d] = float32(0.0)
            cuda.syncthreads()  # the K/V tile is complete before any warp reads it

            # warp-uniform: does any live row of this warp see a key of this tile?
            if q0 + row0 < t_len and (not CAUSAL or k0 <= warp_last_row + SHIFT):
                # -- scores: lane j, key k0 + j, against each of the warp's rows --
                for r in range(RW):
                    score[r] = float32(0.0)
                if lane < BK:
                    for d in range(D):
                        kd = k_tile[lane, d]
                        for r in range(RW):
                            score[r] += q_tile[row0 + r, d] * kd

                # -- online softmax, one row at a time --
                key = k0 + lane
                for r in range(RW):
                    t = q0 + row0 + r
                    # row-uniform, so the collectives below run with the whole warp
                    if t < t_len and (not CAUSAL or k0 <= t + SHIFT):
                        visible = lane < BK and key < t_len
                        if CAUSAL and key > t + SHIFT:
                            visible = False
                        s = score[r] if visible else float32(-math.inf)
                        tile_max = warp_max(s)
                        p = math.exp(s - tile_max) if visible else float32(0.0)
                        m_new, l_new, a_r, beta = online_softmax_merge(m[r], l[r], tile_max, p)
                        m[r] = m_new
                        l[r] = l_new
                        alpha[r] = a_r
                        p = p * beta
                    else:  # a dead row, or a causal row before this tile: no change
                        alpha[r] = float32(1.0)
                        p = float32(0.0)
                    if lane < BK:
                        p_tile[row0 + r, lane] = p
                cuda.syncwarp(FULL_MASK)  # the warp's probabilities are visible to all its lanes

                # -- acc = acc * alpha + P V --
                for r in range(RW):
                    for c in range(CH):
                        acc[r, c] *= alpha[r]
                for j in range(BK):
                    for c in range(CH):
                        d = lane + c * WARP
                        v_frag[c] = v_tile[j, d] if d < D else float32(0.0)
                    for r in range(RW):
                        pj = p_tile[row0 + r, j]
                        for c in range(CH):
                            acc[r, c] += pj * v_frag[c]
                # (the next tile's first syncthreads orders these reads before P is rewritten)

        # -- epilogue: total the lane partial sums, normalise, store --
        for r in range(RW):
            t = q0 + row0 + r
            if t < t_len:  # row-uniform: warp_sum runs with the whole warp
                total = warp_sum(l[r])
                inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                if not NORMALISE:
                    inv = float32(1.0)
                for c in range(CH):
                    d = lane + c * WARP
                    if d < D:
                        out[t, head * D + d] = acc[r, c] * inv
                if lane == 0:
                    lse[head, t] = (m[r] + math.log(total) if total > float32(0.0)
                                    else float32(-math.inf))

    kernel.__name__ = (f"fused_prefill_d{D}" + ("_causal" if causal else "")
                       + ("" if defect is None else "_" + defect))
    return jit(kernel)


def fused_rows_per_block(head_dim):
    """Query rows one fused block owns (``BQ = FUSED_WARPS * RW``)."""
    return FUSED_WARPS * fused_config(head_dim)[1]


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------

def check_prefill(q, k, v, n_heads, n_kv_heads=None):
    """Validate a prefill call; returns ``(T, H, H_kv, D)``.

    Errors are ``checks.*`` (ValueError) naming the argument and the sizes.
    """
    n_heads = int_arg("n_heads", n_heads)
    n_kv = n_heads if n_kv_heads is None else int_arg("n_kv_heads", n_kv_heads)
    checks.check_heads(n_heads, n_kv, q_name="q", kv_name="n_kv_heads")
    t_len, width = checks.check_array("q", q, (("T", None), (f"H*D (H={n_heads})", None)),
                                      dtypes=(np.float32,))
    if width % n_heads or width == 0:
        raise checks.ShapeError(
            f"q: expected shape [T, H*D] whose row width is a positive multiple of "
            f"H={n_heads}, got {(t_len, width)}")
    head_dim = width // n_heads
    context = f" (T={t_len}, H={n_heads}, H_kv={n_kv}, D={head_dim})"
    try:
        checks.check_head_dim("q", head_dim)
        for name, x in (("k", k), ("v", v)):
            checks.check_array(name, x, (("T", t_len), (f"H_kv*D={n_kv}*{head_dim}",
                                                       n_kv * head_dim)),
                               dtypes=(np.float32,))
    except checks.AttentionInputError as err:
        raise type(err)(f"{err}{context}") from None
    return t_len, n_heads, n_kv, head_dim


# ---------------------------------------------------------------------------
# the fused path
# ---------------------------------------------------------------------------

def _run_fused(d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st, defect, dbg):
    """Launch the fused kernel: grid ``(ceil(T / BQ), H)`` on stream ``st``."""
    t_len, n_heads, n_kv, head_dim = dims
    kernel = fused_kernel(head_dim, bool(causal), defect)
    bq = fused_rows_per_block(head_dim)
    grid = ((t_len + bq - 1) // bq, n_heads)
    kernel[grid, FUSED_WARPS * WARP, st](d_q, d_k, d_v, np.float32(scale), d_out, d_lse)
    if dbg:
        _trace_fused(dbg, d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st)


def _trace_fused(dbg, d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st):
    """Head 0 of the fused path: scores recomputed on the host (float64) for
    up to 64 rows, and each row's ``sum_j exp(s_tj - lse_t)`` against 1."""
    t_len, n_heads, n_kv, head_dim = dims
    q = host_copy(d_q, st)[:, :head_dim].astype(np.float64)  # [T, D] head 0
    k = host_copy(d_k, st)[:, :head_dim].astype(np.float64)  # [T, D] kv head 0
    v = host_copy(d_v, st)[:, :head_dim]
    lse = host_copy(d_lse, st)[0].astype(np.float64)  # [T]
    trace_inputs(dbg, "fused", q, k, v, dims)
    rows = np.unique(np.linspace(0, t_len - 1, min(t_len, 64)).astype(int))
    scores = (q[rows] @ k.T) * scale  # [R, T]
    if causal:
        visible = np.arange(t_len)[None, :] <= rows[:, None]  # [R, T]
        dbg.info("fused head 0: scaled scores (%d sampled rows, visible keys) %s",
                 rows.size, stats(scores[visible]))
        scores = np.where(visible, scores, -np.inf)
    else:
        dbg.info("fused head 0: scaled scores (%d sampled rows) %s", rows.size, stats(scores))
    trace_probabilities(dbg, "fused (from LSE)", np.exp(scores - lse[rows, None]), causal)
    dbg.info("fused head 0: output %s", stats(host_copy(d_out, st)[:, :head_dim]))


def prefill_attention(q, k, v, n_heads, *, n_kv_heads=None, causal=False, scale=None,
                      method="fused", stream=None, return_lse=False, defect=None):
    """Multi-head (GQA) prefill attention over T tokens, fused kernel.

    q:          [T, H*D] float32, interleaved rows (H = n_heads)
    k, v:       [T, H_kv*D] float32, interleaved rows (H_kv = n_kv_heads,
                default H; must divide H)
    causal:     query t attends keys 0..t (else all T)
    scale:      default 1/sqrt(D)
    method:     "fused" (this module's kernel, any D) or "tf32" (the
                tensor-core kernel on split tf32 operands,
                ``attention.prefill.tf32``: D a multiple of 8 up to 256);
                "batched" and "per_head" raise ``checks.RangeError`` naming
                ``attention.reference.prefill_paths.prefill_attention_reference``
    stream:     numba stream; None synchronises before returning, a stream
                only enqueues
    return_lse: also return lse [H, T] (natural log)
    defect:     planted defect for the falsification suite (None in use): one
                of ``PREFILL_DEFECTS`` ("fused") or of
                ``attention.prefill.tf32.SWITCHES`` ("tf32")
    Returns out [T, H*D] (and lse [H, T]): numpy when q is numpy, else device
    arrays. T == 0 gives empty arrays. Raises ``checks.*`` errors (ValueError)
    before any copy or launch.
    """
    if method == "tf32":
        from attention.prefill.tf32 import prefill_attention_tf32

        out, lse = prefill_attention_tf32(q, k, v, n_heads, n_kv_heads, causal=causal,
                                          scale=scale, stream=stream, defect=defect)
        return (out, lse) if return_lse else out
    if method in REFERENCE_METHODS:
        raise checks.RangeError(
            f"method: {method!r} is a reference path, not part of the product kernel; "
            f"call {REFERENCE_ENTRY}(..., method={method!r})")
    if method not in METHODS:
        raise checks.RangeError(f"method: expected one of {METHODS}, got {method!r} "
                                f"(reference paths: {REFERENCE_ENTRY})")
    return run_prefill(_run_fused, log, q, k, v, n_heads, n_kv_heads=n_kv_heads, causal=causal,
                       scale=scale, stream=stream, return_lse=return_lse, defect=defect)


def run_prefill(runner, logger, q, k, v, n_heads, *, n_kv_heads=None, causal=False, scale=None,
                stream=None, return_lse=False, defect=None):
    """The frame every prefill path shares: checks, copies, result.

    Validates the arguments (``check_prefill``, ``checks.check_scale``,
    ``defect`` in ``PREFILL_DEFECTS``) before any copy or launch, returns empty
    results for T == 0, else copies the inputs to the device, allocates
    ``out [T, H*D]`` and ``lse [H, T]`` and calls
    ``runner(d_q, d_k, d_v, d_out, d_lse, (T, H, H_kv, D), scale, causal,
    stream, defect, dbg)``, ``dbg`` being ``logger`` when ``ATTN_PREFILL_DEBUG``
    is set, else None. Arguments and result as ``prefill_attention``'s.
    """
    if defect not in (None,) + PREFILL_DEFECTS:
        raise ValueError(f"defect: expected one of {PREFILL_DEFECTS} or None, got {defect!r}")
    dims = check_prefill(q, k, v, n_heads, n_kv_heads)
    t_len, n_heads, n_kv, head_dim = dims
    scale = checks.check_scale(scale, head_dim)
    host = is_host_array(q)

    if t_len == 0:
        if host:
            out = np.zeros((0, n_heads * head_dim), np.float32)
            lse = np.zeros((n_heads, 0), np.float32)
        else:
            out = device_empty((0, n_heads * head_dim), np.float32, stream)
            lse = device_empty((n_heads, 0), np.float32, stream)
        return (out, lse) if return_lse else out

    dbg = debug_logger(logger) if debug_enabled() else None
    st = launch_stream(stream)
    d_q, d_k, d_v = to_device(q, stream), to_device(k, stream), to_device(v, stream)
    d_out = device_empty((t_len, n_heads * head_dim), np.float32, stream)
    d_lse = device_empty((n_heads, t_len), np.float32, stream)
    runner(d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st, defect, dbg)
    result = (d_out, d_lse)
    if host:
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    return result if return_lse else result[0]
