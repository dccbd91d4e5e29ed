"""Batched shared-memory tiled GEMM and the batched scale, for the prefill reference
paths (``attention.reference.prefill_paths``).

``batched_gemm``: ``c[z] = a[z] @ b[z * B_b // B_a]`` for ``z < B_a``

    a: [B_a, M, K] float32
    b: [B_b, K, N] float32, ``B_b`` divides ``B_a``: several consecutive
       batches of ``a`` share one of ``b`` (GQA: query heads sharing a kv head)
    c: [B_a, M, N] float32

One block computes a 64 x 64 tile of ``c`` with 16 x 16 threads, each thread a
4 x 4 micro-tile (rows ``ty + 16*i``, columns ``tx + 16*j``), stepping over K
in slices of 16 staged in shared memory: ``a`` transposed into ``a_tile[k][m]``
and ``b`` as ``b_tile[k][n]``, so the inner loop reads one broadcast-free row
of each per k (4 + 4 shared loads for 16 FMAs). Grid
``(ceil(N/64), ceil(M/64), B_a)``. Accumulation in float32, in k order.

``batched_scale``: ``x *= scale`` over a ``[B, M, N]`` array (grid-stride).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from attention.core.device import jit
from attention.reference.prefill_layout import COPY_THREADS, copy_grid

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 16
THREADS = 16  # threads per block edge; each owns (BLOCK_M/THREADS) x (BLOCK_N/THREADS)
MICRO = BLOCK_M // THREADS


def _batched_gemm(a, b, c):
    """c[z] = a[z] @ b[z * B_b // B_a].

    a: [B_a, M, K] float32
    b: [B_b, K, N] float32
    c: [B_a, M, N] float32
    Grid ``(ceil(N/64), ceil(M/64), B_a)``, block ``(16, 16)``.
    """
    a_tile = cuda.shared.array((BLOCK_K, BLOCK_M), float32)
    b_tile = cuda.shared.array((BLOCK_K, BLOCK_N), float32)
    z = cuda.blockIdx.z
    zb = z * b.shape[0] // a.shape[0]
    m_len = a.shape[1]
    k_len = a.shape[2]
    n_len = b.shape[2]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    tid = ty * THREADS + tx
    row0 = cuda.blockIdx.y * BLOCK_M
    col0 = cuda.blockIdx.x * BLOCK_N

    acc = cuda.local.array((MICRO, MICRO), float32)
    for i in range(MICRO):
        for j in range(MICRO):
            acc[i, j] = float32(0.0)
    a_frag = cuda.local.array(MICRO, float32)
    b_frag = cuda.local.array(MICRO, float32)

    for k0 in range(0, k_len, BLOCK_K):
        # -- stage a[z, row0:+64, k0:+16] transposed and b[zb, k0:+16, col0:+64] --
        for e in range(tid, BLOCK_M * BLOCK_K, THREADS * THREADS):
            kk = e % BLOCK_K
            mm = e // BLOCK_K
            r = row0 + mm
            k = k0 + kk
            a_tile[kk, mm] = a[z, r, k] if r < m_len and k < k_len else float32(0.0)
        for e in range(tid, BLOCK_K * BLOCK_N, THREADS * THREADS):
            nn = e % BLOCK_N
            kk = e // BLOCK_N
            k = k0 + kk
            col = col0 + nn
            b_tile[kk, nn] = b[zb, k, col] if k < k_len and col < n_len else float32(0.0)
        cuda.syncthreads()  # both tiles staged before any thread multiplies
        # -- 4 x 4 micro-tile update --
        for kk in range(BLOCK_K):
            for i in range(MICRO):
                a_frag[i] = a_tile[kk, ty + THREADS * i]
                b_frag[i] = b_tile[kk, tx + THREADS * i]
            for i in range(MICRO):
                for j in range(MICRO):
                    acc[i, j] += a_frag[i] * b_frag[j]
        cuda.syncthreads()  # every thread is done with the tiles before they are refilled

    # -- epilogue: store the in-range part of the micro-tile --
    for i in range(MICRO):
        r = row0 + ty + THREADS * i
        if r < m_len:
            for j in range(MICRO):
                col = col0 + tx + THREADS * j
                if col < n_len:
                    c[z, r, col] = acc[i, j]


def _batched_scale(x, scale):
    """x *= scale, element-wise.

    x:     [B, M, N] float32 (modified in place)
    scale: float32
    """
    batches, rows, cols = x.shape
    total = batches * rows * cols
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        col = i % cols
        row = (i // cols) % rows
        z = i // (cols * rows)
        x[z, row, col] = x[z, row, col] * scale


batched_gemm_kernel = jit(_batched_gemm)
batched_scale_kernel = jit(_batched_scale)


def batched_gemm(a, b, c, stream):
    """Launch ``batched_gemm_kernel``: ``c[z] = a[z] @ b[z * B_b // B_a]``."""
    batches, m_len, _ = (int(s) for s in a.shape)
    n_len = int(b.shape[2])
    grid = ((n_len + BLOCK_N - 1) // BLOCK_N, (m_len + BLOCK_M - 1) // BLOCK_M, batches)
    batched_gemm_kernel[grid, (THREADS, THREADS), stream](a, b, c)


def batched_scale(x, scale, stream):
    """Launch ``batched_scale_kernel``: ``x *= scale`` in place."""
    total = int(np.prod(x.shape))
    batched_scale_kernel[copy_grid(total), COPY_THREADS, stream](x, np.float32(scale))
