"""Tracing of the prefill paths (``ATTN_PREFILL_DEBUG=1``).

Shared by the fused product path (``attention.prefill.kernels``) and the
per-head / batched reference paths (``attention.reference.prefill_paths``):
each logs to its own module's logger, at INFO, for head 0: the means of
Q/K/V, the score statistics, the largest deviation of a softmax row sum from
1, and the output statistics. Every helper that reads device data
synchronises and copies, so tracing is for debugging, not timing.
"""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
from numba import cuda

from attention.core.device import is_host_array, to_device, to_host

DEBUG_ENV = "ATTN_PREFILL_DEBUG"


def debug_enabled():
    """Whether ``ATTN_PREFILL_DEBUG`` is set to something other than "" or "0"."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def debug_logger(logger):
    """``logger`` at INFO or finer; a stderr handler is added when neither it nor
    the root logger has one (logging not configured)."""
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)
    return logger


def host_copy(x, stream):
    """Host copy of ``x`` (numpy or device array) for tracing: synchronises."""
    if is_host_array(x):
        return np.asarray(x)
    arr = to_host(to_device(x), stream)
    cuda.synchronize()
    return arr


def stats(a):
    """One line of statistics of the finite values of ``a`` (any shape)."""
    a = np.asarray(a, np.float64)
    if a.size == 0:
        return "empty"
    finite = a[np.isfinite(a)]
    if finite.size == 0:
        return f"no finite values of {a.size}"
    return (f"mean={finite.mean():.6g} std={finite.std():.6g} min={finite.min():.6g} "
            f"max={finite.max():.6g} nonfinite={a.size - finite.size}")


def dims_text(dims):
    """``dims = (T, H, H_kv, D)`` as text."""
    t_len, n_heads, n_kv, head_dim = dims
    return f"T={t_len} H={n_heads} H_kv={n_kv} D={head_dim}"


def trace_inputs(dbg, method, qh, kh, vh, dims):
    """qh, kh, vh: host arrays of head 0 (any shape)."""
    dbg.info("%s %s head 0: Q mean=%.6g K mean=%.6g V mean=%.6g", method, dims_text(dims),
             float(np.mean(qh)), float(np.mean(kh)), float(np.mean(vh)))


def trace_probabilities(dbg, method, probs, causal):
    """probs [T, N] host: the deviation of each (visible) row sum from 1."""
    sums = probs.astype(np.float64).sum(axis=1)
    worst = int(np.argmax(np.abs(sums - 1.0))) if sums.size else 0
    dbg.info("%s head 0: softmax row sums: max |sum-1|=%.3g (row %d, sum %.9g)%s", method,
             float(np.abs(sums - 1.0).max()) if sums.size else 0.0, worst,
             float(sums[worst]) if sums.size else 0.0, " causal" if causal else "")
