"""Batched fp32 GEMM for few rows: ``sgemm``'s sums, split over ``k`` across threads.

``c[z] = alpha * a[z] @ op(b[z])`` for ``z < Z`` (one ``b`` a batch: the MLA
per-head weights), the layouts of ``attention.gemm.sgemm`` (``a_order`` "zmk"
/ "mzk", ``b_order`` "znk" / "zkn", ``c_order`` "zmn" / "mzn"), with one ``N``
and one ``K`` for every batch. Columns ``n >= N`` of ``c`` are not written.

Why a second kernel: MLA's absorb and decompress GEMMs have ``M`` = the
queries of a call (B s_q, 1 to 64 in decode) a head. ``sgemm``'s blocks each
own a 64 x 128 tile of ``c`` and step through all of ``K`` in 16-wide slices,
one global-memory round trip a slice, so at few heads its grid is a few dozen
blocks that wait on memory in turn (the decompress at 16 heads: 16 blocks, 32
slices each, 44-50 us at B 1 and B 64 for 4 MB of weights; notes/bench.md run
23). Here a block stages its whole ``[MT, K]`` of ``a`` and ``[NT, K]`` of
``b`` in shared memory in one pass (every load in flight at once), and the
``K`` range is cut over threads, so the grid has ``Z ceil(N / NT) ceil(M /
MT)`` blocks of short sums. It replaces ``sgemm`` only where it measured
faster (``use_skinny``: few rows and a small ``sgemm`` grid; at 64 rows a head
or 128 heads ``sgemm``'s register tiles win).

The sums are ``sgemm``'s, bit for bit: a partial over ``PART_K`` (64)
consecutive ``k``, started by its first product and continued by fused
multiply-adds in ``k`` order; the partials added in order to a total that
starts at 0; ``c = alpha * total``. Thread ``(part, n, group)`` computes
partial ``part`` of its column ``n`` for the ``MG`` rows of its group, into
shared memory; the thread of part 0 then adds the partials of its outputs in
order. So the two kernels give the same bits (``tests/test_skinny_gemm.py``),
and the validation baselines that model ``sgemm``'s order (``validation.
baselines.blocked_matmul``) model this one.

Plan (``plan``): ``NT`` = 16 columns a block (4 on the simulator), ``P =
ceil(K / PART_K)`` parts (``K <= 1024``), ``G = max(1, 16 / P)`` row groups of
``MG`` rows (``MT = G MG`` rows a block, ``MG`` up to 8): ``P NT G`` threads (256
at ``K`` 512 or 128 on a GPU). Shared memory: ``b`` as one row a column
``n`` (its ``k`` run, a spare word after each part; the pitch is 2 mod 32, so
a warp's 16 columns times 2 parts read 32 banks), ``a`` as rows laid out the
same way, and ``MG`` partials a thread.

Layouts (C-contiguous device arrays, float32; ``b`` float32 or float16):
    a  zmk [Z, M, K] or mzk [M, Z, K]
    b  znk [Z, N, K] or zkn [Z, K, N]
    c  zmn [Z, M, >= N] or mzn [M, Z, >= N]
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint64

from attention.core.device import SIMULATOR, ensure_dynamic_shared, fma, jit

from .sgemm import A_ORDERS, B_ORDERS, C_ORDERS, PART_K, _flat, _strides

NT = 4 if SIMULATOR else 16  # columns of c a block
THREADS_TARGET = 16 if SIMULATOR else 256
MAX_K = 16 * PART_K  # at most 16 parts
MAX_MG = 8  # rows of a thread
# ``use_skinny``: M at most SKINNY_ROWS and sgemm's grid under SGEMM_BLOCKS_ENOUGH
# blocks. H200, device time of one GEMM (sgemm -> skinny), fp16 latent MLA shapes
# (notes/bench.md run 26): B 1 / 16 heads: decompress (16 sgemm blocks) 50.0 ->
# 9.9 us, absorb (64 blocks) 18.9 -> 15.3 us; slower where sgemm's grid is
# larger or M is: B 1 / 128 heads decompress (128 blocks) 50.7 -> 54.7 us and
# absorb (512) 57.7 -> 76.0 us, B 64 / 16 heads (M 64) absorb 18.7 -> 35.0 us
# and decompress 44.1 -> 49.5 us.
SGEMM_BLOCKS_ENOUGH = 128
SKINNY_ROWS = 16


def plan(m_len, k_len):
    """(NT, parts, groups, MG): the block shape for ``M = m_len``, ``K = k_len``."""
    parts = -(-int(k_len) // PART_K)
    groups = max(1, (THREADS_TARGET // NT) // parts)
    mg = min(MAX_MG, max(1, -(-int(m_len) // groups)))
    return NT, parts, groups, mg


def shared_words(k_len, nt, parts, groups, mg):
    """float32 words of a block's shared memory: ``b``, ``a`` and the partials
    (rows padded as ``skinny_kernel`` lays them out)."""
    k_len = int(k_len)
    bp = k_len + parts + (2 - (k_len + parts)) % 32
    return nt * bp + groups * mg * (k_len + parts) + parts * nt * groups * mg


def use_skinny(m_len, n_len, k_len, n_batch, sgemm_tile=(64, 128)):
    """True when this kernel should replace ``sgemm`` for the shape: ``K`` fits
    (``MAX_K``), ``M <= SKINNY_ROWS`` and ``sgemm``'s grid would have fewer
    than ``SGEMM_BLOCKS_ENOUGH`` blocks (``sgemm_tile``: its ``c`` tile at this
    ``M``), where its slice-by-slice blocks leave the GPU waiting on memory
    (the measurements above)."""
    if k_len > MAX_K or k_len <= 0 or int(m_len) > SKINNY_ROWS:
        return False
    bm, bn = sgemm_tile
    blocks = -(-int(n_len) // bn) * -(-int(m_len) // bm) * int(n_batch)
    return blocks < SGEMM_BLOCKS_ENOUGH


@functools.lru_cache(maxsize=None)
def skinny_kernel(b_order, k_len, nt, parts, groups, mg):
    """The kernel for ``b_order`` and ``K = k_len`` (compiled in) and a ``plan``.

    Arguments: a, b, c flat; alpha float32; m_len, n_len; element strides (a_z,
    a_m), (b_z, b_r), (c_z, c_m) as ``sgemm_kernel``'s. Grid ``(ceil(N / nt),
    ceil(M / (groups mg)), Z)``, block ``parts nt groups`` threads.
    """
    if b_order not in B_ORDERS:
        raise ValueError(f"b_order: expected one of {B_ORDERS}, got {b_order!r}")
    K = int(k_len)
    if not 0 < K <= MAX_K:
        raise ValueError(f"k_len: expected 1 .. {MAX_K}, got {K}")
    NT_, P, GR, MG = int(nt), int(parts), int(groups), int(mg)
    if P != -(-K // PART_K):
        raise ValueError(f"parts: expected ceil({K} / {PART_K}), got {P}")
    MT = GR * MG
    THREADS = P * NT_ * GR
    # k of a row sits at k + k // PART_K (a spare word after each part). A warp's
    # lanes are 16 columns x 2 parts: with b's pitch 2 mod 32 their reads fall in
    # 32 banks, and a's two parts in two
    BP = K + P + (2 - (K + P)) % 32
    AP = K + P
    A_OFF = NT_ * BP
    PART_OFF = A_OFF + MT * AP
    B_ZNK = b_order == "znk"
    B_LOADS = -(-(NT_ * K) // THREADS)
    A_LOADS = -(-(MT * K) // THREADS)

    def kernel(a, b, c, alpha, m_len, n_len, a_z, a_m, b_z, b_r, c_z, c_m):
        z = cuda.blockIdx.z
        col0 = cuda.blockIdx.x * NT_
        row0 = cuda.blockIdx.y * MT
        tid = cuda.threadIdx.x
        sm = cuda.shared.array(0, float32)
        # -- stage b's NT columns and a's MT rows, all of K (zeros outside):
        # every load into registers first, so all are in flight at once --
        b_pre = cuda.local.array(B_LOADS, float32)
        a_pre = cuda.local.array(A_LOADS, float32)
        for e in range(B_LOADS):
            idx = tid + THREADS * e
            if B_ZNK:
                n = idx // K
                at = (col0 + n) * b_r + idx % K
            else:
                n = idx % NT_
                at = (idx // NT_) * b_r + col0 + n
            val = float32(0.0)
            if idx < NT_ * K and col0 + n < n_len:
                val = float32(b[uint64(z * b_z + at)])
            b_pre[e] = val
        for e in range(A_LOADS):
            idx = tid + THREADS * e
            val = float32(0.0)
            if idx < MT * K and row0 + idx // K < m_len:
                val = a[uint64(z * a_z + (row0 + idx // K) * a_m + idx % K)]
            a_pre[e] = val
        for e in range(B_LOADS):
            idx = tid + THREADS * e
            if idx < NT_ * K:
                if B_ZNK:
                    n = idx // K
                    k = idx % K
                else:
                    n = idx % NT_
                    k = idx // NT_
                sm[uint64(n * BP + k + k // PART_K)] = b_pre[e]
        for e in range(A_LOADS):
            idx = tid + THREADS * e
            if idx < MT * K:
                k = idx % K
                sm[uint64(A_OFF + (idx // K) * AP + k + k // PART_K)] = a_pre[e]
        cuda.syncthreads()
        # -- partial ``part`` of column n for the group's MG rows --
        n = tid % NT_
        part = (tid // NT_) % P
        grp = tid // (P * NT_)
        k0 = part * PART_K
        k1 = min(k0 + PART_K, K)
        b_at = n * BP + part  # + k: k + k // PART_K within this part
        a_at = A_OFF + grp * MG * AP + part
        acc = cuda.local.array(MG, float32)
        bv = sm[uint64(b_at + k0)]
        for i in range(MG):
            acc[i] = sm[uint64(a_at + i * AP + k0)] * bv
        for k in range(k0 + 1, k1):
            bv = sm[uint64(b_at + k)]
            for i in range(MG):
                acc[i] = fma(sm[uint64(a_at + i * AP + k)], bv, acc[i])
        for i in range(MG):
            sm[uint64(PART_OFF + (part * MT + grp * MG + i) * NT_ + n)] = acc[i]
        cuda.syncthreads()
        # -- part 0's thread: the partials in order into the total --
        if part == 0 and col0 + n < n_len:
            for i in range(MG):
                r = row0 + grp * MG + i
                if r < m_len:
                    total = float32(0.0)
                    for p in range(P):
                        total += sm[uint64(PART_OFF + (p * MT + grp * MG + i) * NT_ + n)]
                    c[uint64(z * c_z + r * c_m + col0 + n)] = alpha * total

    kernel.__name__ = kernel.__qualname__ = f"skinny_{b_order}_k{K}_{NT_}x{P}x{GR}x{MG}"
    # fastmath off: the partials' order is the contract (module docstring)
    return jit(kernel, fastmath=False)


def launch(a, b, c, alpha, *, a_order, b_order, c_order, n_len, k_len, n_batch, stream,
           ready=None):
    """Enqueue the GEMM over ``n_batch`` batches (C-contiguous device arrays, no
    validation; ``k_len <= MAX_K``). ``ready``: as ``sgemm.launch``'s."""
    if a_order not in A_ORDERS or c_order not in C_ORDERS:
        raise ValueError(f"skinny layouts: got a {a_order!r}, c {c_order!r}")
    m_len = int(a.shape[1] if a_order == "zmk" else a.shape[0])
    if n_batch == 0 or m_len == 0 or n_len <= 0:
        return
    nt, parts, groups, mg = plan(m_len, k_len)
    kernel = skinny_kernel(b_order, int(k_len), nt, parts, groups, mg)
    grid = (-(-int(n_len) // nt), -(-m_len // (groups * mg)), int(n_batch))
    a_z, a_m = _strides(a, a_order)
    b_z, b_r = _strides(b, b_order)
    c_z, c_m = _strides(c, c_order)
    args = (_flat(a), _flat(b), _flat(c), float32(alpha), m_len, int(n_len), a_z, a_m, b_z,
            b_r, c_z, c_m)
    nbytes = 4 * shared_words(int(k_len), nt, parts, groups, mg)
    ensure_dynamic_shared(kernel, args, nbytes, 0, np.dtype(b.dtype).str, ready)
    kernel[grid, parts * nt * groups, stream, nbytes](*args)


__all__ = ["launch", "plan", "shared_words", "skinny_kernel", "use_skinny"]
