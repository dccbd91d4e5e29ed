"""Register-tiled batched fp32 GEMM with two-level accumulation (the MLA GEMM path).

``c[z] = alpha * a[z] @ op(b[zb[z]])`` for ``z < Z``, on C-contiguous device
arrays read in place through their layouts (``launch`` turns them into element
strides, so MLA's tensors need no transposes):

    a_order "zmk": a[z, m, k]      "mzk": a[m, z, k]
    b_order "znk": b[zb, n, k]     "zkn": b[zb, k, n]   (float32 or float16;
                                   compiled in, it sets how a slice is staged)
    c_order "zmn": c[z, m, n]      "mzn": c[m, z, n]

``M`` is ``a``'s m extent. ``N`` and ``K`` are per batch: ``n_ext[z]`` and
``k_ext[z]`` (int32 [Z]); this is how one launch covers sequences of
different lengths (the score GEMM's ``N`` and the P.V GEMM's ``K`` are the
visible length of the query's sequence). Entries ``n >= n_ext[z]`` of ``c``
are not written. ``zb[z]`` (int32 [Z]) picks ``b``'s batch (the latent cache
slot of query ``z``; ``arange`` for a per-head weight).

Plan ``(edge, TM, TN)`` = (16, 8, 8) on a GPU (``PLAN``; TM = 4 when M <= 64):
block tile ``(16 TM) x (16 TN)`` with 16 x 16 threads. Thread ``(ty, tx)`` owns
rows ``16 ty .. + TM`` and columns ``4 tx + 64 g + 0..3`` (``g < TN / 4``). ``K``
is stepped in slices of ``BK = 16`` staged in shared memory, k-major with rows
padded to a multiple of 4 words and 16-byte aligned, so per ``k`` a thread
reads its ``a`` and ``b`` fragments with four 16-byte loads (a warp: two
broadcast addresses of ``a``; eight lanes of ``b`` cover the 32 banks) for
``TM * TN = 64`` FMAs. Slices are double-buffered: the next slice's global
loads go to registers before the current slice is multiplied and to the other
buffer after it, one barrier per slice. A slice wholly inside both operands
(every block of the MLA shapes but the last ``N`` or ``K`` one) is fetched
without bounds tests, each operand from one base offset and one stride; the
others test every element. A partial's first ``k`` starts it (no
zeroing). On the H200 these two took the MLA decode graph from 3.53 to 2.89 ms
(fp32, B 64, L 4096; notes/bench.md run 10), outputs unchanged bit for bit.
Flat indices are uint64 (numba adds a compare-and-select per access for
signed ones). The simulator runs the same code with plan (4, 2, 2).

Accumulation (two-level): the products of ``PART_SLICES = 4`` consecutive
slices (``PART_K = 64`` k) are summed into a fresh partial (``part``), which
is then added to the running total. A plain running sum over ``K = 576``
(scores) or ``K = L`` (the P.V product) has about twice the error of numpy's
float32 baseline; the two-level sum's error grows as ``PART_K + K / PART_K``
terms instead of ``K``. A numpy emulation of this order on random operands
(``K = 576`` signed products; ``K = 4096`` softmax weights times values),
mean error over numpy's float32 einsum: a plain fused sum 1.75x / 1.85x,
partials of 16 k 0.59x / 0.50x, of 64 k 0.71x / 0.36x. 64 balances the two
levels at ``K = 4096``.

Where the totals live: in dynamic shared memory (``shared_bytes``: 64 KB a
block at 8 x 8, past the 48 KB that need the driver's opt-in, which ``launch``
does once a kernel), each thread's ``TM * TN`` words at stride ``THREADS`` (a
warp's accesses are 32 consecutive words). A partial is added there once
(one load, add and store a word: ~200 instructions, and 128 shared-memory
wavefronts a warp, as many as the fragment loads of 1.3 slices). Done after
every slice, these accesses kept the shared-memory pipe as busy as the FMA
pipe; after every fourth, the MLA decode graph went from 2.56 to 2.31 ms
(fp32, B 64, L 4096; notes/bench.md run 16). In registers the totals and the
partial took 128 of the 255 a thread can have, so the ``BK`` k-steps of a
slice stayed a loop (written out, they spilled). With the registers freed,
the k-steps are written out (``_unrolled``): no loop counter or branch per
``k``, constant shared-memory offsets, and the next ``k``'s fragment loads
issued under this one's FMAs.

K split (``launch(..., k_split=S, k_scratch=...)``): where the grid is a
fraction of the GPU's SMs and K spans at least ``MIN_K_SPLIT`` partials
(``k_splits``: the MLA weight GEMMs at few heads, e.g. the decompress at
B 64 / 16 heads, 16 blocks of ``K`` = 512 on 132 SMs), block ``(x, y, z S + s)`` computes the
``s``-th partial alone (``PART_K`` k from ``s PART_K``) into a float32
scratch ``[Z S, M, max N]``, and ``reduce_kernel`` adds the partials in
order, from 0, and applies alpha: ``((0 + p_0) + p_1) + ...``, the running
total's own arithmetic, so the result has **the same bits** as the one-launch
GEMM (``0 + p`` is ``p`` but for the sign of a zero, which the next addition
gives back the same; ``tests/test_mla_gemm.py``). A split of more than one
partial would sum in another order, so ``S = ceil(K / PART_K)``.

Planted switches (falsification suite and precision tests only; compile-time,
``sgemm_kernel(..., defect=name)``, the kernel's name suffixed with it; without
one the kernel is the production one, PTX unchanged): ``no_partials``
(``PRECISION_MUTANTS``: the two-level sum collapsed to one running sum over
the whole K, the fused sum of about twice numpy's error above) and
``k_tail_dropped`` (``GROSS_DEFECTS``: the last K slice, up to ``BK`` k, is not
multiplied; its ``a`` staged as zeros).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint64

from attention.core.device import SIMULATOR, device_fn, ensure_dynamic_shared, fma, jit

BK = 16
PART_SLICES = 4  # slices whose products go into one partial
PART_K = BK * PART_SLICES
EDGE = 16  # threads per block edge on a GPU
A_ORDERS = ("zmk", "mzk")
B_ORDERS = ("znk", "zkn")
C_ORDERS = ("zmn", "mzn")


# the simulator runs every thread as a Python thread: it runs the same code
# with a 4 x 4-thread block and 2 x 2 micro-tiles (8 x 8 tiles of c)
GPU_PLAN = (EDGE, 8, 8)  # (edge, tm, tn)
PLAN = (4, 2, 2) if SIMULATOR else GPU_PLAN

PRECISION_MUTANTS = ("no_partials",)
GROSS_DEFECTS = ("k_tail_dropped",)
DEFECTS = PRECISION_MUTANTS + GROSS_DEFECTS
ALIGN = None if SIMULATOR else 16  # shared-slice alignment (the simulator rejects any)


def tile_shape(edge, tm, tn):
    """(rows, columns) of ``c`` one block computes."""
    return edge * tm, edge * tn


def shared_bytes(edge, tm, tn):
    """(static, dynamic) shared memory of a block: the two staged slices of
    both operands (rows padded to ``16 tm + 4`` / ``16 tn + 4`` words), and
    the running totals, ``tm * tn`` words a thread."""
    bm, bn = tile_shape(edge, tm, tn)
    return 4 * 2 * BK * (bm + 4 + bn + 4), 4 * tm * tn * edge * edge


def _unrolled(step, n, a_pitch, b_pitch):
    """A device function ``run(a_s, b_s, ao, bo, a_frag, b_frag, part)`` that
    calls ``step(a_s, b_s, ao + k a_pitch, bo + k b_pitch, ...)`` for ``k = 1 ..
    n - 1``, written out as ``n - 1`` calls (generated source, no loop)."""
    lines = ["def run(a_s, b_s, ao, bo, a_frag, b_frag, part):"]
    for k in range(1, n):
        lines.append(f"    step(a_s, b_s, ao + {k * a_pitch}, bo + {k * b_pitch}, a_frag, "
                     "b_frag, part)")
    space = {"step": step}
    exec("\n".join(lines), space)  # noqa: S102 - fixed text built above
    return device_fn(space["run"])


@functools.lru_cache(maxsize=None)
def sgemm_kernel(b_order, edge=EDGE, tm=8, tn=8, defect=None, k_split=False):
    """Build the GEMM for ``b``'s layout, ``edge x edge`` threads, ``tm x tn`` each.

    Arguments: a, b, c flat (1-D views of C-contiguous arrays), zb [Z] int32,
    n_ext [Z] int32, k_ext [Z] int32, alpha float32, m_len, and the element
    strides (a_z, a_m), (b_z, b_r), (c_z, c_m): element (z, m, k) of ``a`` is
    ``a[z a_z + m a_m + k]``, (zb, row, col) of ``b`` is ``b[zb b_z + row b_r +
    col]``, (z, m, n) of ``c`` is ``c[z c_z + m c_m + n]`` (``launch`` derives
    them from the layouts). Grid ``(ceil(max N / (edge tn)), ceil(M / (edge
    tm)), Z)``, block ``(edge, edge)``. ``defect``: one of ``DEFECTS`` compiled
    in (module docstring), or None. The last argument ``n_ks``: the K split's
    partials a batch (``k_split`` True; module docstring: grid axis z is then
    ``Z n_ks``, block z ``z n_ks + s`` computes partial ``s`` of batch ``z``
    into ``c``'s slot ``z n_ks + s`` with ``c``'s strides); 1 otherwise (unread).
    """
    if b_order not in B_ORDERS:
        raise ValueError(f"b_order: expected one of {B_ORDERS}, got {b_order!r}")
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    NO_PARTIALS = defect == "no_partials"
    KSPLIT = bool(k_split)
    K_TAIL_DROPPED = defect == "k_tail_dropped"
    if (edge * tm * BK) % (edge * edge) or (edge * tn * BK) % (edge * edge):
        raise ValueError(f"sgemm plan: {edge}x{edge} threads cannot stage {tm}x{tn} tiles")
    EDGE_ = edge
    THREADS = edge * edge
    TM, TN = tm, tn
    BM, BN = edge * tm, edge * tn
    B_ZNK = b_order == "znk"
    A_LOADS = BM * BK // THREADS  # a-slice words each thread stages
    B_LOADS = BN * BK // THREADS
    # staged slices are k-major rows padded to a multiple of 4 words, so each
    # thread's TM (TN) consecutive words are 16-byte aligned (vector loads)
    AP, BP = BM + 4, BN + 4
    A_BUF, B_BUF = BK * AP, BK * BP
    A_WORDS, B_WORDS = 2 * A_BUF, 2 * B_BUF  # two buffers each
    # a thread's TN columns are groups of G = 4 adjacent ones, GSTEP apart:
    # eight lanes' 16-byte loads then cover all 32 banks (no conflict)
    G = 4 if TN % 4 == 0 else 1
    GSTEP = EDGE_ * G
    # every flat index below is cast to uint64: numba wraps negative signed
    # indices (a compare and select per access), which here would cost as many
    # instructions as the FMAs and defeat constant address offsets

    # a slice wholly inside both operands is read without bounds tests, each
    # operand from one base offset and a stride (thread ``tid`` reads the same
    # k (znk: column) of rows THREADS // BK apart)
    DIRECT = THREADS % BK == 0 and THREADS % BN == 0
    A_ROWS_STEP = THREADS // BK
    B_STEP = THREADS // BK if B_ZNK else THREADS // BN

    @device_fn
    def fetch(a, b, z, bz, k0, row0, col0, tid, m_len, n_len, k_len, a_z, a_m, b_z, b_r,
              a_pre, b_pre, inner):
        """Slice ``k0 .. k0 + BK`` of both operands into registers (zeros outside).
        ``inner``: the block's rows and columns are all in range."""
        if DIRECT and inner and k0 + BK <= k_len:
            a_at = uint64(z * a_z + (row0 + tid // BK) * a_m + k0 + tid % BK)
            a_step = uint64(A_ROWS_STEP * a_m)
            for e in range(A_LOADS):
                a_pre[e] = float32(a[a_at + uint64(e) * a_step])
            if B_ZNK:
                b_at = uint64(bz * b_z + (col0 + tid // BK) * b_r + k0 + tid % BK)
            else:
                b_at = uint64(bz * b_z + (k0 + tid // BN) * b_r + col0 + tid % BN)
            b_step = uint64(B_STEP * b_r)
            for e in range(B_LOADS):
                b_pre[e] = float32(b[b_at + uint64(e) * b_step])
            return
        for e in range(A_LOADS):
            idx = tid + THREADS * e
            k = k0 + idx % BK
            r = row0 + idx // BK
            val = float32(0.0)
            if r < m_len and k < k_len:
                val = float32(a[uint64(z * a_z + r * a_m + k)])
            a_pre[e] = val
        for e in range(B_LOADS):
            idx = tid + THREADS * e
            if B_ZNK:
                k = k0 + idx % BK
                col = col0 + idx // BK
                at = col * b_r + k
            else:
                k = k0 + idx // BN
                col = col0 + idx % BN
                at = k * b_r + col
            val = float32(0.0)
            if col < n_len and k < k_len:
                val = float32(b[uint64(bz * b_z + at)])
            b_pre[e] = val

    @device_fn
    def frags(a_s, b_s, ao, bo, a_frag, b_frag):
        """One k of the staged slice: this thread's TM values of ``a`` from
        ``a_s[ao:]`` and TN of ``b`` from ``b_s[bo:]`` (groups of G, GSTEP apart)."""
        for i in range(TM):
            a_frag[i] = a_s[uint64(ao) + uint64(i)]
        for j in range(TN):
            b_frag[j] = b_s[uint64(bo) + uint64((j // G) * GSTEP + j % G)]

    @device_fn
    def k_step(a_s, b_s, ao, bo, a_frag, b_frag, part):
        """One k of the staged slice added into the partial, each product
        fused into it (``fma``: one rounding, the same pairing in every k)."""
        frags(a_s, b_s, ao, bo, a_frag, b_frag)
        for i in range(TM):
            for j in range(TN):
                part[i, j] = fma(a_frag[i], b_frag[j], part[i, j])

    # k = 1 .. BK-1 of a slice written out one call a k (no loop): the shared
    # loads of k + 1 can then be issued while k's FMAs run, with constant
    # offsets, and no loop counter or branch is paid per k
    slice_rest = _unrolled(k_step, BK, AP, BP)

    def kernel(a, b, c, zb, n_ext, k_ext, alpha, m_len, a_z, a_m, b_z, b_r, c_z, c_m, n_ks):
        zc = cuda.blockIdx.z  # c's slot: the batch, or (batch, partial) when split
        if KSPLIT:
            z = zc // n_ks
        else:
            z = zc
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * EDGE_ + tx
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        n_len = n_ext[z]
        k_len = k_ext[z]
        k_lo = 0
        if KSPLIT:  # this block's partial alone: k_lo .. k_lo + PART_K
            k_lo = (zc - z * n_ks) * PART_K
            k_len = min(k_len, k_lo + PART_K)
        if col0 >= n_len:
            return  # the whole block is past this batch's N (uniform exit)
        bz = zb[z]

        a_s = cuda.shared.array(A_WORDS, float32, alignment=ALIGN)
        b_s = cuda.shared.array(B_WORDS, float32, alignment=ALIGN)
        a_pre = cuda.local.array(A_LOADS, float32)
        b_pre = cuda.local.array(B_LOADS, float32)
        # the running total in dynamic shared memory (``shared_bytes``; element
        # (i, j) of thread tid at (i TN + j) THREADS + tid: a warp's accesses
        # are consecutive words, no bank conflict); the partial in registers
        acc_s = cuda.shared.array(0, float32)
        part = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        for v in range(TM * TN):
            acc_s[uint64(v * THREADS + tid)] = float32(0.0)
        a_row = ty * TM  # this thread's rows: a_row + i; columns: b_col + col_of(j)
        b_col = tx * G

        n_slices = (k_len - k_lo + BK - 1) // BK
        inner = row0 + BM <= m_len and col0 + BN <= n_len
        fetch(a, b, z, bz, k_lo, row0, col0, tid, m_len, n_len, k_len, a_z, a_m, b_z, b_r,
              a_pre, b_pre, inner)
        for s in range(n_slices):
            a_off = (s & 1) * A_BUF
            b_off = (s & 1) * B_BUF
            # -- store the fetched slice into this buffer --
            if K_TAIL_DROPPED and s + 1 == n_slices:
                for e in range(A_LOADS):
                    a_pre[e] = float32(0.0)  # the last slice's products all zero
            for e in range(A_LOADS):
                idx = tid + THREADS * e
                a_s[uint64(a_off + (idx % BK) * AP + idx // BK)] = a_pre[e]
            for e in range(B_LOADS):
                idx = tid + THREADS * e
                if B_ZNK:
                    b_s[uint64(b_off + (idx % BK) * BP + idx // BK)] = b_pre[e]
                else:
                    b_s[uint64(b_off + (idx // BN) * BP + idx % BN)] = b_pre[e]
            cuda.syncthreads()  # slice s staged (and, two slices back, fully read)
            # -- fetch slice s + 1 while this one is multiplied --
            if s + 1 < n_slices:
                fetch(a, b, z, bz, k_lo + (s + 1) * BK, row0, col0, tid, m_len, n_len, k_len,
                      a_z, a_m, b_z, b_r, a_pre, b_pre, inner)
            # -- multiply: the slice's products into the partial; the first k
            # of every PART_SLICES-th slice starts a fresh one (no zeroing) --
            frags(a_s, b_s, a_off + a_row, b_off + b_col, a_frag, b_frag)
            fresh = s % PART_SLICES == 0
            if NO_PARTIALS:
                fresh = s == 0  # one running sum over the whole K
            if fresh:
                for i in range(TM):
                    for j in range(TN):
                        part[i, j] = a_frag[i] * b_frag[j]
            else:
                for i in range(TM):
                    for j in range(TN):
                        part[i, j] = fma(a_frag[i], b_frag[j], part[i, j])
            slice_rest(a_s, b_s, a_off + a_row, b_off + b_col, a_frag, b_frag, part)
            # -- the partial into the running total, after its last slice --
            last = s % PART_SLICES == PART_SLICES - 1 or s + 1 == n_slices
            if NO_PARTIALS:
                last = s + 1 == n_slices
            if last:
                for i in range(TM):
                    for j in range(TN):
                        at = uint64((i * TN + j) * THREADS + tid)
                        acc_s[at] += part[i, j]
            # no second barrier: the next store goes to the other buffer, and
            # the barrier after it orders this slice's reads before the store
            # two slices on

        # -- epilogue: the in-range part of the micro-tile --
        for i in range(TM):
            r = row0 + a_row + i
            if r < m_len:
                for j in range(TN):
                    col = col0 + b_col + (j // G) * GSTEP + j % G
                    if col < n_len:
                        total = acc_s[uint64((i * TN + j) * THREADS + tid)]
                        c[uint64(zc * c_z + r * c_m + col)] = alpha * total

    kernel.__name__ = kernel.__qualname__ = (f"sgemm_{b_order}_{edge}e_{tm}x{tn}"
                                             + ("_ks" if KSPLIT else "")
                                             + (f"_{defect}" if defect else ""))
    # fastmath off: it would let the compiler re-associate the two-level sum
    return jit(kernel, fastmath=False)


REDUCE_THREADS = 256


@functools.lru_cache(maxsize=None)
def reduce_kernel():
    """The K split's second launch: ``c[z, m, n] = alpha * (((0 + p_0) + p_1) +
    ...)`` over the partials ``p_s = part[z n_ks + s, m, n]`` whose k range
    starts inside batch ``z``'s K (``s PART_K < k_ext[z]``), in order of
    ``s``; entries ``n >= n_ext[z]`` are not written (as the one-launch GEMM).

    Arguments: part flat (``[Z n_ks, M, max_n]`` float32), c flat, n_ext,
    k_ext (int32 [Z]), alpha, n_ks, m_len, max_n, z_n, and c's strides (c_z,
    c_m). A thread an element of ``c``, grid-stride; the threads of a warp take
    consecutive ``n`` (coalesced reads of every partial)."""

    def kernel(part, c, n_ext, k_ext, alpha, n_ks, m_len, max_n, z_n, c_z, c_m):
        total_n = z_n * m_len * max_n
        i = cuda.grid(1)
        while i < total_n:
            n = i % max_n
            zm = i // max_n
            m = zm % m_len
            z = zm // m_len
            if n < n_ext[z]:
                k_len = k_ext[z]
                total = float32(0.0)
                for s in range(n_ks):
                    if s * PART_K < k_len:
                        total += part[uint64(((z * n_ks + s) * m_len + m) * max_n + n)]
                c[uint64(z * c_z + m * c_m + n)] = alpha * total
            i += cuda.gridsize(1)

    kernel.__name__ = kernel.__qualname__ = "sgemm_k_reduce"
    return jit(kernel, fastmath=False)


def default_plan(m_len):
    """The ``(edge, tm, tn)`` ``launch`` takes for ``m_len`` rows: ``PLAN``, with
    half-height tiles when M fills no more than half of one (GPU)."""
    return PLAN if m_len > 4 * PLAN[0] or SIMULATOR else (PLAN[0], 4, PLAN[2])


# the fewest partials a K split takes. Measured on the H100 (bench.mla_probe, B 64 /
# 16 heads, notes/bench.md run 29): the decompress split 8 ways (16 -> 128 blocks)
# went from 43.8 to 19.5 us, the absorb split 2 ways (K 128, 64 -> 128 blocks) from
# 15.6 to 21.7 us: halving each block's K does not pay for the second launch and
# the partials' round trip
MIN_K_SPLIT = 4


def k_splits(m_len, max_n, k_len, n_batch, sms, plan=None):
    """The K split for a GEMM of this shape on a GPU of ``sms`` SMs: ``ceil(K /
    PART_K)`` partials a batch when the one-launch grid fills at most half the
    SMs and K spans ``MIN_K_SPLIT`` partials or more, else 1 (no split). Where
    it splits the grid grows that many times (the MLA decompress at B 64 / 16
    heads: 16 blocks -> 128) at the cost of ``Z S M N`` float32 partials
    written and read back once (4 MB there)."""
    edge, tm, tn = default_plan(m_len) if plan is None else plan
    bm, bn = tile_shape(edge, tm, tn)
    blocks = -(-int(max_n) // bn) * -(-int(m_len) // bm) * int(n_batch)
    parts = -(-int(k_len) // PART_K)
    if parts < MIN_K_SPLIT or blocks == 0 or 2 * blocks > int(sms):
        return 1
    return parts


@functools.lru_cache(maxsize=None)
def sm_count():
    """The current GPU's SM count (0 under the simulator: no K split unless a
    caller asks for one)."""
    if SIMULATOR:
        return 0
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _strides(x, order):
    """Element strides (batch, row) of a C-contiguous 3-D ``x`` read in ``order``
    ("zmk"/"zmn": x[z, m, :]; "mzk"/"mzn": x[m, z, :]; "znk"/"zkn": x[z, row, :])."""
    d0, d1, d2 = (int(n) for n in x.shape)
    return (d1 * d2, d2) if order[0] == "z" else (d2, d1 * d2)


def _flat(x):
    return x.reshape(int(np.prod(x.shape)))


def launch(a, b, c, zb, n_ext, k_ext, alpha, *, a_order, b_order, c_order, max_n, n_batch,
           stream, plan=None, ready=None, defect=None, k_split=1, k_scratch=None):
    """Enqueue the GEMM over ``n_batch`` batches (C-contiguous device arrays, no validation).

    ``max_n``: the largest ``n_ext`` (sets the grid); ``plan``: (edge, tm, tn),
    default ``PLAN``; ``ready``: an optional set the caller keeps for one
    device, recording the kernels given their dynamic shared memory (then a
    repeated launch does no device lookup; ``ensure_dynamic_shared``);
    ``defect``: a planted switch (``DEFECTS``) or None. ``k_split`` S > 1: the
    K split (module docstring; every ``k_ext`` at most ``S PART_K``), two
    launches, through ``k_scratch``, a float32 device array of at least ``Z S
    M max_n`` elements (``k_scratch_size``); the same bits as ``k_split=1``.
    """
    if a_order not in A_ORDERS or c_order not in C_ORDERS:
        raise ValueError(f"sgemm layouts: got a {a_order!r}, c {c_order!r}")
    m_len = int(a.shape[1] if a_order == "zmk" else a.shape[0])
    if plan is None:  # half-height tiles when M fills no more than half of one
        plan = default_plan(m_len)
    edge, tm, tn = plan
    bm, bn = tile_shape(edge, tm, tn)
    if n_batch == 0 or m_len == 0 or max_n <= 0:
        return
    k_split = int(k_split)
    a_z, a_m = _strides(a, a_order)
    b_z, b_r = _strides(b, b_order)
    c_z, c_m = _strides(c, c_order)
    static, dynamic = shared_bytes(edge, tm, tn)
    if k_split > 1:
        need = k_scratch_size(n_batch, k_split, m_len, max_n)
        if k_scratch is None or int(k_scratch.size) < need:
            raise ValueError(f"k_scratch: expected a float32 device array of at least "
                             f"{need} elements for k_split={k_split}")
        part = _flat(k_scratch)
        kernel = sgemm_kernel(b_order, edge, tm, tn, defect, True)
        args = (_flat(a), _flat(b), part, zb, n_ext, k_ext, float32(1.0), m_len, a_z, a_m,
                b_z, b_r, m_len * max_n, max_n, k_split)
        grid = ((max_n + bn - 1) // bn, (m_len + bm - 1) // bm, n_batch * k_split)
        ensure_dynamic_shared(kernel, args, dynamic, static, np.dtype(b.dtype).str, ready)
        kernel[grid, (edge, edge), stream, dynamic](*args)
        total = n_batch * m_len * max_n
        blocks = min(-(-total // REDUCE_THREADS), 4096)
        reduce_kernel()[blocks, REDUCE_THREADS, stream](
            part, _flat(c), n_ext, k_ext, float32(alpha), k_split, m_len, max_n, n_batch,
            c_z, c_m)
        return
    grid = ((max_n + bn - 1) // bn, (m_len + bm - 1) // bm, n_batch)
    kernel = sgemm_kernel(b_order, edge, tm, tn, defect)
    args = (_flat(a), _flat(b), _flat(c), zb, n_ext, k_ext, float32(alpha), m_len, a_z, a_m,
            b_z, b_r, c_z, c_m, 1)
    ensure_dynamic_shared(kernel, args, dynamic, static, np.dtype(b.dtype).str, ready)
    kernel[grid, (edge, edge), stream, dynamic](*args)


def k_scratch_size(n_batch, k_split, m_len, max_n):
    """Elements of the K split's float32 scratch: ``Z S M max_n``."""
    return int(n_batch) * int(k_split) * int(m_len) * int(max_n)
