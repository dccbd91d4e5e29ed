"""Layout kernels of the prefill reference paths: interleaved rows <-> head-major,
and transposes (``attention.reference.prefill_paths``; the fused product kernel
reads the interleaved rows directly and needs none of these).

Prefill tensors arrive interleaved, one token per row with the heads side by
side: ``x[t, h*D + d]``. The per-head and batched attention paths work on
head-major copies ``[heads, T, D]``, and the score GEMM reads K transposed.

Kernels (all element-for-element copies, bit-exact):

* ``gather_heads``   ``src [T, n_src*D]`` -> ``dst [n, T, D]``: heads
  ``head0 .. head0+n-1`` of the rows (``n = dst.shape[0]``). The per-head path
  uses ``n = 1``, the batched path all heads at once.
* ``scatter_heads``  ``src [n, T, D]`` -> ``dst [T, n_dst*D]``: the inverse,
  writing heads ``head0 .. head0+n-1`` of ``dst`` and nothing else.
* ``batched_transpose``  ``src [B, R, C]`` -> ``dst [B, C, R]`` through a
  32 x 33 shared-memory tile (the padding column keeps the column reads free of
  bank conflicts); grid ``(ceil(C/32), ceil(R/32), B)``, block ``(32, 8)``.

The copies are grid-stride loops, so any grid covers any size: on a GPU the
launcher sizes the grid to the data, on the simulator (one Python thread per
CUDA thread) it launches a single warp.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from attention.core.device import SIMULATOR, jit

TILE = 32  # transpose tile edge
TILE_STRIDE = TILE + 1  # padded row: a column of the tile spans all 32 banks
TILE_ROWS = 8  # rows of threads per transpose block (each moves TILE/TILE_ROWS elements)
# threads per block of the grid-stride copies: the simulator runs one Python
# thread per CUDA thread, so it gets a single warp
COPY_THREADS = 32 if SIMULATOR else 256


def _gather_heads(src, head0, dst):
    """dst[j, t, d] = src[t, (head0 + j) * D + d].

    src:   [T, n_src*D] float32, interleaved rows
    head0: int32, first head copied
    dst:   [n, T, D] float32, head-major (n heads, head0 + n <= n_src)
    """
    n, t_len, head_dim = dst.shape
    total = n * t_len * head_dim
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        d = i % head_dim
        t = (i // head_dim) % t_len
        j = i // (head_dim * t_len)
        dst[j, t, d] = src[t, (head0 + j) * head_dim + d]


def _scatter_heads(src, head0, dst):
    """dst[t, (head0 + j) * D + d] = src[j, t, d].

    src:   [n, T, D] float32, head-major
    head0: int32, first head written
    dst:   [T, n_dst*D] float32, interleaved rows (other heads untouched)
    """
    n, t_len, head_dim = src.shape
    total = n * t_len * head_dim
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        # index so that consecutive threads write consecutive columns of a row
        d = i % head_dim
        j = (i // head_dim) % n
        t = i // (head_dim * n)
        dst[t, (head0 + j) * head_dim + d] = src[j, t, d]


def _batched_transpose(src, dst):
    """dst[b, c, r] = src[b, r, c] through a shared-memory tile.

    src: [B, R, C] float32
    dst: [B, C, R] float32
    Grid ``(ceil(C/32), ceil(R/32), B)``, block ``(32, 8)``.
    """
    tile = cuda.shared.array((TILE, TILE_STRIDE), float32)
    b = cuda.blockIdx.z
    rows = src.shape[1]
    cols = src.shape[2]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    # -- load: coalesced along C --
    c = cuda.blockIdx.x * TILE + tx
    for k in range(0, TILE, TILE_ROWS):
        r = cuda.blockIdx.y * TILE + ty + k
        if r < rows and c < cols:
            tile[ty + k, tx] = src[b, r, c]
    cuda.syncthreads()  # the tile is complete before any thread reads a column of it
    # -- store: coalesced along R --
    r = cuda.blockIdx.y * TILE + tx
    for k in range(0, TILE, TILE_ROWS):
        c = cuda.blockIdx.x * TILE + ty + k
        if r < rows and c < cols:
            dst[b, c, r] = tile[tx, ty + k]


gather_heads_kernel = jit(_gather_heads)
scatter_heads_kernel = jit(_scatter_heads)
batched_transpose_kernel = jit(_batched_transpose)


def copy_grid(total):
    """Blocks for a grid-stride copy of ``total`` elements."""
    if SIMULATOR:
        return 1
    return max(1, min((total + COPY_THREADS - 1) // COPY_THREADS, 65535))


def gather_heads(src, head0, dst, stream):
    """Launch ``gather_heads_kernel`` (see the module docstring)."""
    total = int(np.prod(dst.shape))
    gather_heads_kernel[copy_grid(total), COPY_THREADS, stream](src, np.int32(head0), dst)


def scatter_heads(src, head0, dst, stream):
    """Launch ``scatter_heads_kernel`` (see the module docstring)."""
    total = int(np.prod(src.shape))
    scatter_heads_kernel[copy_grid(total), COPY_THREADS, stream](src, np.int32(head0), dst)


def batched_transpose(src, dst, stream):
    """Launch ``batched_transpose_kernel``: ``src [B, R, C]`` -> ``dst [B, C, R]``."""
    b, rows, cols = (int(s) for s in src.shape)
    grid = ((cols + TILE - 1) // TILE, (rows + TILE - 1) // TILE, b)
    batched_transpose_kernel[grid, (TILE, TILE_ROWS), stream](src, dst)
