"""The per-head and batched prefill paths: readable references, not the product.

They compute what ``attention.prefill.kernels.prefill_attention`` (the fused
kernel, the product path) computes,

    out[t, h*D:(h+1)*D] = softmax(scale * q_h[t] . k_g[:n_t]^T) @ v_g[:n_t]
    lse[h, t]           = log-sum-exp (natural log) of row t's scaled scores

with query head ``h`` on kv head ``g = h * H_kv // H`` (GQA) and
``n_t = t + 1`` when causal, ``T`` otherwise, as a chain of small kernels over
materialised scores. Same layouts (C-contiguous float32 ``q [T, H*D]``,
``k, v [T, H_kv*D]``, ``out [T, H*D]``, ``lse [H, T]``), same argument checks,
T == 0 handling, host/device array rules and stream contract (they share
``attention.prefill.kernels.run_prefill``).

Methods (``method=``):

* ``"batched"`` (default): every head in each launch: interleaved ->
  ``[H, T, D]`` (``prefill_layout.gather_heads``), batched transpose of K
  (``prefill_layout.batched_transpose``), batched GEMM
  (``tiled_gemm.batched_gemm``; the kv head of batch ``z`` is
  ``z * H_kv // H``), batched scale (``tiled_gemm.batched_scale``), batched
  softmax (``prefill_softmax.row_softmax``, one warp per row), batched GEMM,
  back to interleaved (``prefill_layout.scatter_heads``). Materialises
  ``[H, T, T]`` scores. 9 launches.
* ``"per_head"``: the same steps one head at a time; the ``[T, T]`` scores of
  one head are materialised. ``6 H + 3 H_kv`` launches (K and V are gathered
  and transposed once per kv head).

Intermediate buffers are allocated on each call. They are kept as references
whose every step can be read and checked on its own, and as carriers of the
planted defects (``defect=``, the same two as the fused kernel's,
``attention.prefill.kernels.PREFILL_DEFECTS``, planted in the row softmax):

    "softmax_not_normalised"  the softmax skips the division by the row sum
    "causal_off_by_one"       a causal row sees one key too many (0 .. t+1)

Their speed against the fused path is in ``attention/reference/README.md``.

Debug switch: ``ATTN_PREFILL_DEBUG=1`` logs (logger
``attention.reference.prefill_paths``, INFO) for head 0: the means of Q/K/V,
the scaled score statistics, the largest deviation of a materialised softmax
row sum from 1 and the output statistics (``attention.prefill.debug``).
"""

from __future__ import annotations

import logging

import numpy as np

from attention.core import checks
from attention.core.device import device_empty
from attention.prefill.debug import host_copy, stats, trace_inputs, trace_probabilities
from attention.prefill.kernels import PREFILL_DEFECTS, run_prefill
from attention.reference.prefill_layout import batched_transpose, gather_heads, scatter_heads
from attention.reference.prefill_softmax import row_softmax
from attention.reference.tiled_gemm import batched_gemm, batched_scale

METHODS = ("batched", "per_head")
DEFECTS = PREFILL_DEFECTS  # ("softmax_not_normalised", "causal_off_by_one")

log = logging.getLogger("attention.reference.prefill_paths")


def _run_per_head(d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st, defect, dbg):
    """One head at a time; dims ``(T, H, H_kv, D)``; every launch on stream ``st``.

    Scratch: q/k/v/out heads [1, T, D], K^T [1, D, T], scores [1, T, T].
    """
    t_len, n_heads, n_kv, head_dim = dims
    q_head = device_empty((1, t_len, head_dim), np.float32, st)
    k_head = device_empty((1, t_len, head_dim), np.float32, st)
    v_head = device_empty((1, t_len, head_dim), np.float32, st)
    k_t = device_empty((1, head_dim, t_len), np.float32, st)
    scores = device_empty((1, t_len, t_len), np.float32, st)
    o_head = device_empty((1, t_len, head_dim), np.float32, st)
    loaded = -1
    for h in range(n_heads):
        g = h * n_kv // n_heads  # the kv head of query head h (GQA)
        gather_heads(d_q, h, q_head, st)
        if g != loaded:  # consecutive query heads share a kv head under GQA
            gather_heads(d_k, g, k_head, st)
            gather_heads(d_v, g, v_head, st)
            batched_transpose(k_head, k_t, st)
            loaded = g
        if dbg and h == 0:
            trace_inputs(dbg, "per_head", host_copy(q_head, st), host_copy(k_head, st),
                         host_copy(v_head, st), dims)
        batched_gemm(q_head, k_t, scores, st)
        batched_scale(scores, scale, st)
        if dbg and h == 0:
            dbg.info("per_head head 0: scaled scores %s", stats(host_copy(scores, st)[0]))
        row_softmax(scores, causal, d_lse[h:h + 1], st, defect)
        if dbg and h == 0:
            trace_probabilities(dbg, "per_head", host_copy(scores, st)[0], causal)
        batched_gemm(scores, v_head, o_head, st)
        scatter_heads(o_head, h, d_out, st)
        if dbg and h == 0:
            dbg.info("per_head head 0: output %s", stats(host_copy(o_head, st)[0]))


def _run_batched(d_q, d_k, d_v, d_out, d_lse, dims, scale, causal, st, defect, dbg):
    """Every head in each launch; dims ``(T, H, H_kv, D)``; launches on stream ``st``.

    Scratch: q/out heads [H, T, D], k/v heads [H_kv, T, D], K^T [H_kv, D, T],
    scores [H, T, T].
    """
    t_len, n_heads, n_kv, head_dim = dims
    q_heads = device_empty((n_heads, t_len, head_dim), np.float32, st)
    k_heads = device_empty((n_kv, t_len, head_dim), np.float32, st)
    v_heads = device_empty((n_kv, t_len, head_dim), np.float32, st)
    k_t = device_empty((n_kv, head_dim, t_len), np.float32, st)
    scores = device_empty((n_heads, t_len, t_len), np.float32, st)
    o_heads = device_empty((n_heads, t_len, head_dim), np.float32, st)
    # interleaved -> head-major, all heads per launch
    gather_heads(d_q, 0, q_heads, st)
    gather_heads(d_k, 0, k_heads, st)
    gather_heads(d_v, 0, v_heads, st)
    if dbg:
        trace_inputs(dbg, "batched", host_copy(q_heads, st)[0], host_copy(k_heads, st)[0],
                     host_copy(v_heads, st)[0], dims)
    batched_transpose(k_heads, k_t, st)
    batched_gemm(q_heads, k_t, scores, st)  # batch z reads kv head z * H_kv // H
    batched_scale(scores, scale, st)
    if dbg:
        dbg.info("batched head 0: scaled scores %s", stats(host_copy(scores, st)[0]))
    row_softmax(scores, causal, d_lse, st, defect)
    if dbg:
        trace_probabilities(dbg, "batched", host_copy(scores, st)[0], causal)
    batched_gemm(scores, v_heads, o_heads, st)
    scatter_heads(o_heads, 0, d_out, st)
    if dbg:
        dbg.info("batched head 0: output %s", stats(host_copy(o_heads, st)[0]))


_RUNNERS = {"batched": _run_batched, "per_head": _run_per_head}


def prefill_attention_reference(q, k, v, n_heads, *, n_kv_heads=None, causal=False,
                                scale=None, method="batched", stream=None, return_lse=False,
                                defect=None):
    """Multi-head (GQA) prefill attention through a reference path.

    q:          [T, H*D] float32, interleaved rows (H = n_heads)
    k, v:       [T, H_kv*D] float32, interleaved rows (H_kv = n_kv_heads,
                default H; must divide H)
    causal:     query t attends keys 0..t (else all T)
    scale:      default 1/sqrt(D)
    method:     "batched" (default) or "per_head" (module docstring); the
                fused kernel is ``attention.prefill.kernels.prefill_attention``
    stream:     numba stream; None synchronises before returning, a stream
                only enqueues
    return_lse: also return lse [H, T] (natural log)
    defect:     planted defect for the falsification suite (None in use)
    Returns out [T, H*D] (and lse [H, T]): numpy when q is numpy, else device
    arrays. T == 0 gives empty arrays. Raises ``checks.*`` errors (ValueError)
    before any copy or launch.
    """
    if method not in METHODS:
        hint = (" (the fused kernel is attention.prefill.kernels.prefill_attention)"
                if method == "fused" else "")
        raise checks.RangeError(f"method: expected one of {METHODS}, got {method!r}{hint}")
    return run_prefill(_RUNNERS[method], log, q, k, v, n_heads, n_kv_heads=n_kv_heads,
                       causal=causal, scale=scale, stream=stream, return_lse=return_lse,
                       defect=defect)
