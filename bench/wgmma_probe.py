"""What Hopper's warp-group MMA (``wgmma``) gives a Numba kernel: a probe, not a
product kernel (printed, no report).

    python3 -m bench.wgmma_probe [--iters 2048] [--n 64,128,256]
    python3 -m bench.wgmma_probe --case I      # check I of cases() alone
    python3 -m bench.wgmma_probe --throughput  # the throughput rows alone

The parent runs each check, and the throughput rows, in a child process of its
own: a kernel fault is sticky in a CUDA context, so in one process the first bad
check would fail every later one (what the first GPU run, 2e6b0d9 on an H100,
printed: an illegal address in the first check, m64n8k16, then nothing else).

The 16-bit tensor-core kernels (``attention.gemm.mma16``: MLA decode, prefill) issue
``mma.sync.m16n8k16``, one warp at a time, with every operand first loaded from
shared memory into registers by ``ldmatrix``. Hopper's ``wgmma.mma_async`` lets a
warp group (128 threads) multiply a 64-row A by an N-column B (N up to 256) that it
reads straight from shared memory through 64-bit matrix descriptors: per tile the
shared-memory traffic that bounds the 128-head MLA decode falls about fourfold
(notes/bench.md, the shared-memory byte model). ``wgmma`` exists only on the
architecture-specific target ``sm_90a``; numba-cuda 0.30.4 links a kernel for
``sm_90a`` on a compute-capability-9.0 device (``CUDACodeLibrary._ensure_cc``), so
inline PTX can issue it. This probe asks two questions on the GPU:

1. **Layout** (``check``): one warp group computes ``D[64, N] = A[64, 16] @ B[16, N]``
   with fp16 or bf16 operands and fp32 accumulation, and writes each thread's ``N /
   2`` accumulator registers out raw; the host places them with the accumulator
   layout below and compares with numpy. Three operand forms (``LAYOUT_CASES``), which
   cover both products of an attention tile: A and B both K-major in shared memory (S = Q
   K^T: A ``[64, 16]``, B as ``B^T [N, 16]``); A from registers in the mma.sync A
   layout (``a_fragment``: P, straight from the S accumulators) with B K-major, and
   with B MN-major (``mn_layout``, the ``trans-b`` flag: V as the cache stores it,
   N contiguous). No swizzle. One K step of 16 (N 8, 64, 256) and four (K 64, each
   step's descriptors 256 bytes on: ``LAYOUT_SHAPES``). The operands are multiples
   of 1/4 in [-1, 1], so every product and sum is exact in fp32: the comparison is
   ``==``. Both readings of the descriptor's two byte offsets run (128 bytes between
   core matrices along K and ``16 K`` along M / N, and the two swapped): one of them
   can be right, so the other is the check's control. Then the 128-byte swizzle
   (``SWIZZLE_CASES``, K-major, K 64: rows of 128 bytes, chunk ``c`` of row ``r`` at
   ``c ^ (r % 8)``, the layout a kernel staging whole cache rows with ``cp.async``
   would use), against the same bytes read with no swizzle as the control.
2. **Throughput** (``throughput``): every block one warp group issuing four
   ``wgmma.m64nNk16`` a step on the same shared tiles (no memory traffic), against
   a loop of ``mma.sync.m16n8k16`` from registers (eight independent accumulators a
   warp, the instruction ``attention.gemm.mma16`` uses), and torch's bf16 matmul on
   8192^3 (``bench.gpu.torch_matmul_peak``) when torch is importable. TFLOP/s counts
   2 x 64 x N x 16 flops a wgmma and 2 x 16 x 8 x 16 an mma.sync.

Layout conventions (PTX ISA, "Matrix Descriptor Format" and the wgmma fragments):

* A core matrix is 8 rows x 16 bytes (8 16-bit values of K), its rows 16 bytes
  apart: 128 contiguous bytes. ``core_layout`` stores element ``(r, k)`` of an
  operand with ``kt`` values of K at 16-bit index ``(r // 8) * 8 kt + (k // 8) * 64
  + (r % 8) * 8 + k % 8``: the core matrices of a row group side by side (128 bytes
  apart along K), row groups ``16 kt`` bytes apart; ``mn_layout`` is its MN-major
  counterpart.
* A descriptor: bits 0-13 the shared address >> 4, bits 16-29 ``LBO`` >> 4, bits
  32-45 ``SBO`` >> 4, bits 62-63 the swizzle mode (0: none).
* Accumulators: thread ``t`` of the warp group (warp ``w = t // 32``, lane ``l``)
  holds register ``i`` of ``N / 2`` at row ``16 w + l // 4 + 8 ((i % 4) // 2)``,
  column ``8 (i // 4) + 2 (l % 4) + i % 2`` (``accumulator_index``).
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

M, K = 64, 16  # a wgmma's rows and its K step (16-bit operands)
A_ELEMS = M * K
WG = 128  # threads of a warp group
CORE_BYTES = 128  # one core matrix: 8 rows x 16 bytes
LBO, SBO = 128, 256  # bytes between core matrices along K, and along M / N, at K 16
SWIZZLE_128B = 1  # the descriptor's mode field (bits 62-63) for the 128-byte swizzle
SWIZZLE_SBO = 1024  # bytes between 8-row atoms of a 128-byte-swizzled operand
STEPS = 4  # wgmma a throughput step
MMA_CHAINS = 8  # independent mma.sync accumulators a warp
# the layout checks: (A from registers, B MN-major, what) - S = Q K^T takes both operands
# K-major from shared memory; O = P V takes P from registers and V MN-major
LAYOUT_CASES = ((False, 0, "A smem, B K-major"), (True, 0, "A registers, B K-major"),
                (True, 1, "A registers, B MN-major"))
# the 128-byte swizzle (the layout a kernel staging whole rows with cp.async would use),
# K-major at K 64: (A from registers, kind, N)
SWIZZLE_CASES = ((False, "f16", 64), (False, "bf16", 256), (True, "f16", 64))
# (kind, N, K) of each form's checks: one K step at N 8, 64 and 256, then four K steps
LAYOUT_SHAPES = (("f16", 8, 16), ("f16", 64, 16), ("f16", 256, 16), ("bf16", 64, 16),
                 ("f16", 64, 64), ("bf16", 256, 64))


def _core_matrices(x, mn_major):
    """``x [mn, kt]`` -> flat: element ``(i, k)`` at ``(i // 8) * 8 kt + (k // 8) * 64``
    plus, inside its core matrix, ``(i % 8) * 8 + k % 8`` (K-major: rows along M / N)
    or ``(k % 8) * 8 + i % 8`` (MN-major: rows along K)."""
    mn, kt = x.shape
    i, k = np.meshgrid(np.arange(mn), np.arange(kt), indexing="ij")
    inner = (k % 8) * 8 + i % 8 if mn_major else (i % 8) * 8 + k % 8
    out = np.empty(mn * kt, x.dtype)
    out[(i // 8) * 8 * kt + (k // 8) * 64 + inner] = x
    return out


def core_layout(x):
    """``x [rows, kt]`` (rows a multiple of 8, kt of 16) -> flat ``[rows * kt]`` in
    no-swizzle K-major core matrices: element ``(r, k)`` at 16-bit index ``(r // 8) *
    8 kt + (k // 8) * 64 + (r % 8) * 8 + k % 8``: a row group's core matrices side by
    side along K (128 bytes apart), row groups ``16 kt`` bytes apart (``offsets``)."""
    if x.shape[1] % K or x.shape[0] % 8:
        raise ValueError(f"x: expected [8 r, 16 k], got {x.shape}")
    return _core_matrices(x, False)


def mn_layout(x):
    """``x [kt, cols]`` (B with N contiguous; kt a multiple of 16, cols of 8) -> flat
    ``[kt * cols]`` in MN-major core matrices: element ``(k, c)`` at 16-bit index
    ``(c // 8) * 8 kt + (k // 8) * 64 + (k % 8) * 8 + c % 8`` (a core matrix's rows run
    along K, each 8 values of N; the byte offsets of ``core_layout``: 128 along K,
    ``16 kt`` along N)."""
    if x.shape[0] % K or x.shape[1] % 8:
        raise ValueError(f"x: expected [16 k, 8 c], got {x.shape}")
    return _core_matrices(x.T, True)


def swizzle128_layout(x):
    """``x [rows, 64]`` (rows a multiple of 8) -> flat ``[rows * 64]`` in the 128-byte
    swizzle of K-major operands: row ``r`` is 128 contiguous bytes at ``128 r``, its
    16-byte chunk ``c`` (values ``8 c .. 8 c + 7`` of K) stored at chunk ``c ^ (r %
    8)``; 8 rows make a 1024-byte atom (the descriptor's stride, ``SWIZZLE_SBO``)."""
    from attention.gemm.mma16 import swizzle

    rows, kt = x.shape
    if kt != 64 or rows % 8:
        raise ValueError(f"x: expected [8 r, 64], got {x.shape}")
    r, k = np.meshgrid(np.arange(rows), np.arange(kt), indexing="ij")
    out = np.empty(rows * kt, x.dtype)
    # the swizzle of mma16's tiles at 8 chunks a row is this one
    out[r * 64 + swizzle(r, k // 8, 8) * 8 + k % 8] = x
    return out


def offsets(kt):
    """The two byte offsets of the layouts above, (along K, along M / N): (128, 16 kt)."""
    return CORE_BYTES, 16 * kt


def a_fragment(words):
    """A's 16-bit ``words [64, kt]`` -> ``[kt / 16, 128, 4]`` uint32: for each K step of
    16, each thread's A registers of a register-A wgmma, warp ``w`` holding rows ``16 w
    ..`` in the m16n8k16 A layout (lane ``l``: register 0 row ``l // 4``, K ``2 (l %
    4)`` and the next in its upper half; 1: row + 8; 2: K + 8; 3: both)."""
    t = np.arange(WG)
    w, lane = t // 32, t % 32
    steps = words.shape[1] // K
    out = np.empty((steps, WG, 4), np.uint32)
    for s in range(steps):
        for j in range(4):
            row = 16 * w + lane // 4 + 8 * (j % 2)
            col = K * s + 2 * (lane % 4) + 8 * (j // 2)
            out[s, :, j] = (words[row, col].astype(np.uint32)
                            | (words[row, col + 1].astype(np.uint32) << 16))
    return out


def accumulator_index(n):
    """(row, column) ``[WG, n / 2]`` of every thread's accumulator registers of a
    ``wgmma.m64n<n>k16`` with fp32 accumulation."""
    t = np.arange(WG)[:, None]
    i = np.arange(n // 2)[None, :]
    w, lane = t // 32, t % 32
    row = 16 * w + lane // 4 + 8 * ((i % 4) // 2)
    col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
    return row, col


def descriptor(addr, lbo, sbo, mode=0):
    """The 64-bit matrix descriptor (host form, for tests and docs); ``mode`` the
    swizzle (0 none, ``SWIZZLE_128B``)."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (mode << 62)


@functools.lru_cache(maxsize=None)
def _intrinsics(n, kind, steps, trans_b=0):
    """(``first(da, db)``: D = A B, ``acc(da, db, d)``: ``steps`` wgmma D += A B,
    ``first_ra(a0, a1, a2, a3, db)``: D = A B with A from registers, the m16n8k16
    A fragment a warp, ``acc_ra(a0, a1, a2, a3, db, d)``: one D += A B so), each
    returning the ``n / 2`` fp32 registers, and ``fence()``
    (generic-proxy shared stores made visible to the wgmma's async proxy).
    ``trans_b`` 1: B's descriptor describes an MN-major tile (N contiguous)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    regs = n // 2
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    ptx_t = "f16" if kind == "f16" else "bf16"
    outs = ", ".join(f"${i}" for i in range(regs))
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_t}.{ptx_t} {{{outs}}}, "
    mma = op + f"${regs}, ${regs + 1}, p, 1, 1, 0, {trans_b};\n"
    mma_ra = (op + f"{{${regs}, ${regs + 1}, ${regs + 2}, ${regs + 3}}}, ${regs + 4}, "
              f"p, 1, 1, {trans_b};\n")
    ret = types.UniTuple(types.float32, regs)
    struct = ir.LiteralStructType([f32] * regs)

    def body(scale_d, text):
        return ("{\n.reg .pred p;\n" f"setp.ne.b32 p, {scale_d}, 0;\n"
                "wgmma.fence.sync.aligned;\n" + text
                + "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n}")

    def call(context, builder, in_types, in_cons, text, operands, d=None):
        # the asm ``text`` on ``operands`` (with ``d``, the accumulator tuple tied to
        # the outputs): the outputs as a ``ret`` tuple
        ins = [] if d is None else [builder.extract_value(d, i) for i in range(regs)]
        tied = "" if d is None else "," + ",".join(str(i) for i in range(regs))
        fnty = ir.FunctionType(struct, in_types + [f32] * len(ins))
        cons = ",".join(["=f"] * regs) + "," + in_cons + tied + ",~{memory}"
        r = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                         list(operands) + ins)
        return context.make_tuple(builder, ret, [builder.extract_value(r, i)
                                                 for i in range(regs)])

    u32 = types.uint32

    @intrinsic
    def first(typingctx, da, db):
        def codegen(context, builder, sig, args):
            return call(context, builder, [i64, i64], "l,l", body(0, mma), args)

        return ret(types.uint64, types.uint64), codegen

    @intrinsic
    def acc(typingctx, da, db, d):
        def codegen(context, builder, sig, args):
            return call(context, builder, [i64, i64], "l,l", body(1, mma * steps), args[:2],
                        args[2])

        return ret(types.uint64, types.uint64, ret), codegen

    @intrinsic
    def first_ra(typingctx, a0, a1, a2, a3, db):
        def codegen(context, builder, sig, args):
            return call(context, builder, [i32] * 4 + [i64], "r,r,r,r,l", body(0, mma_ra),
                        args)

        return ret(u32, u32, u32, u32, types.uint64), codegen

    @intrinsic
    def acc_ra(typingctx, a0, a1, a2, a3, db, d):
        def codegen(context, builder, sig, args):
            return call(context, builder, [i32] * 4 + [i64], "r,r,r,r,l", body(1, mma_ra),
                        args[:5], args[5])

        return ret(u32, u32, u32, u32, types.uint64, ret), codegen

    from attention.gemm.wgmma import fence_async

    return first, acc, first_ra, acc_ra, fence_async()


@functools.lru_cache(maxsize=None)
def _smem():
    """(``shared_base(smem)``: a shared array's 32-bit shared-space address,
    ``desc(addr, lbo, sbo)``: the device form of ``descriptor``)."""
    from numba import cuda, uint64

    from attention.gemm.mma16 import smem_ops

    @cuda.jit(device=True, inline="always")
    def desc(addr, lbo, sbo, mode):
        return (uint64((addr & 0x3FFFF) >> 4) | uint64(lbo >> 4) << 16
                | uint64(sbo >> 4) << 32 | uint64(mode) << 62)

    return smem_ops()[0], desc


@functools.lru_cache(maxsize=None)
def check_kernel(n, kind, lbo, sbo, a_regs=False, trans_b=0, kt=K, mode=0):
    """One warp group: ``raw[t, i]`` = register ``i`` of thread ``t`` of ``A @ B``, A
    ``[64, kt]``, B ``[kt, n]``, in ``kt / 16`` wgmma (each K step's descriptors
    start 256 bytes, two core matrices along K, after the last one's; with ``mode``
    ``SWIZZLE_128B`` the operands are in ``swizzle128_layout`` and a K step is 32
    bytes, inside the swizzled row).
    ``a_core [64 * kt]``: A's 16-bit words in ``core_layout``; with ``a_regs`` A
    comes from registers instead, ``a_frag [kt / 16, 128, 4]`` uint32 (``a_fragment``).
    ``b_core [n * kt]``: B's words in ``core_layout`` of ``B^T`` (K-major), or with
    ``trans_b`` in ``mn_layout`` of B (MN-major). ``lbo`` / ``sbo``: the byte
    offsets both descriptors carry."""
    from numba import cuda, uint16, uint64

    first, acc, first_ra, acc_ra, fence = _intrinsics(n, kind, 1, trans_b)
    shared_base, desc = _smem()
    regs = n // 2
    a_elems, b_elems, steps = M * kt, n * kt, kt // K
    # B's shared tile padded to 16 rows with zeros. The first GPU run (2e6b0d9) faulted
    # with an illegal address in m64n8k16, B being the last 256 bytes of the block's
    # shared memory; a wgmma reading an N-8 operand as if it had 16 rows is the lead
    # (not confirmed), and the padding costs nothing
    b_alloc = max(n, 16) * kt
    # the descriptors' address field, a K step on
    step = uint64((2 * K if mode else 2 * CORE_BYTES) >> 4)

    @cuda.jit
    def kernel(a_core, a_frag, b_core, raw):
        # 1024: a swizzle atom's alignment (the swizzle is of the address bits)
        sa = cuda.shared.array(a_elems, uint16, alignment=1024)
        sb = cuda.shared.array(b_alloc, uint16, alignment=1024)
        t = cuda.threadIdx.x
        for i in range(t, a_elems, WG):
            sa[i] = a_core[i]
        for i in range(t, b_alloc, WG):
            sb[i] = b_core[i] if i < b_elems else uint16(0)
        fence()
        cuda.syncthreads()
        da = desc(shared_base(sa), lbo, sbo, mode)
        db = desc(shared_base(sb), lbo, sbo, mode)
        if a_regs:
            d = first_ra(a_frag[0, t, 0], a_frag[0, t, 1], a_frag[0, t, 2], a_frag[0, t, 3],
                         db)
            for s in range(1, steps):
                d = acc_ra(a_frag[s, t, 0], a_frag[s, t, 1], a_frag[s, t, 2], a_frag[s, t, 3],
                           db + uint64(s) * step, d)
        else:
            d = first(da, db)
            for s in range(1, steps):
                d = acc(da + uint64(s) * step, db + uint64(s) * step, d)
        for i in range(regs):
            raw[t, i] = d[i]

    return kernel


@functools.lru_cache(maxsize=None)
def throughput_kernel(n, kind):
    """Blocks of one warp group, each ``iters`` steps of ``STEPS`` wgmma on its own
    shared tiles; ``sink[block * 128 + t]`` keeps the accumulators live."""
    from numba import cuda, float32, uint16

    first, acc, _, _, fence = _intrinsics(n, kind, STEPS)
    shared_base, desc = _smem()
    regs = n // 2
    b_elems = n * K

    @cuda.jit
    def kernel(sink, iters):
        sa = cuda.shared.array(A_ELEMS, uint16, alignment=128)
        sb = cuda.shared.array(b_elems, uint16, alignment=128)
        t = cuda.threadIdx.x
        for i in range(t, A_ELEMS, WG):
            sa[i] = uint16(0x3000 + i % 7)  # small normal values in fp16 and bf16 alike
        for i in range(t, b_elems, WG):
            sb[i] = uint16(0x3000 + i % 5)
        fence()
        cuda.syncthreads()
        da = desc(shared_base(sa), LBO, SBO, 0)
        db = desc(shared_base(sb), LBO, SBO, 0)
        d = first(da, db)
        for _ in range(iters):
            d = acc(da, db, d)
        s = float32(0.0)
        for i in range(regs):
            s += d[i]
        sink[cuda.blockIdx.x * WG + t] = s

    return kernel


@functools.lru_cache(maxsize=None)
def mma_sync_kernel(kind):
    """Warps of ``mma.sync.m16n8k16`` from registers: ``MMA_CHAINS`` independent
    accumulators, ``iters`` rounds."""
    from numba import cuda, float32, uint32

    from attention.gemm.mma16 import ops

    mma, _ = ops(kind)

    @cuda.jit
    def kernel(sink, iters):
        t = cuda.threadIdx.x
        a = uint32(0x30003000 + t % 3)
        b = uint32(0x30003000 + t % 5)
        c = cuda.local.array((MMA_CHAINS, 4), float32)
        for j in range(MMA_CHAINS):
            for r in range(4):
                c[j, r] = float32(0.0)
        for _ in range(iters):
            for j in range(MMA_CHAINS):
                c[j, 0], c[j, 1], c[j, 2], c[j, 3] = mma(a, a, a, a, b, b,
                                                         c[j, 0], c[j, 1], c[j, 2], c[j, 3])
        s = float32(0.0)
        for j in range(MMA_CHAINS):
            for r in range(4):
                s += c[j, r]
        sink[cuda.blockIdx.x * cuda.blockDim.x + t] = s

    return kernel


def _operands(n, kind, seed, kt=K):
    """A [64, kt], B [kt, n] as multiples of 1/4 in [-1, 1] (exact in 16 bits, and so
    is every fp32 sum of their products), and their 16-bit words."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (M, kt)) / 4.0
    b = rng.integers(-4, 5, (kt, n)) / 4.0

    def words(x):
        if kind == "f16":
            return x.astype(np.float16).view(np.uint16)
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact

    return a, b, words(a), words(b)


def check(n=64, kind="f16", seed=0, a_regs=False, trans_b=0, kt=K, swizzle=False,
          reading=None):
    """Run ``check_kernel`` two ways and compare with numpy's A @ B; returns ``{label:
    (exact, max_abs_err)}``. No swizzle: both readings of the byte offsets
    (``offsets(kt)`` as (LBO, SBO), and swapped). ``swizzle`` (K-major B, K 64):
    the operands in ``swizzle128_layout`` read with the 128-byte swizzle, and the same
    bytes read with none (the control). ``reading``: run only that one of the two
    (0 or 1, in the order above)."""
    from numba import cuda

    a, b, aw, bw = _operands(n, kind, seed, kt)
    want = a @ b
    rows, cols = accumulator_index(n)
    if swizzle:
        if trans_b or kt != 64:
            raise ValueError("swizzle: the K-major B at K 64 only")
        a_core, b_core = swizzle128_layout(aw), swizzle128_layout(bw.T.copy())
        runs = {f"128-byte swizzle, SBO {SWIZZLE_SBO}": (16, SWIZZLE_SBO, SWIZZLE_128B),
                "no swizzle on the same bytes": (*offsets(kt), 0)}
    else:
        a_core = core_layout(aw)
        b_core = mn_layout(bw) if trans_b else core_layout(bw.T.copy())
        along_k, along_mn = offsets(kt)
        runs = {f"LBO {lb} / SBO {sb}": (lb, sb, 0)
                for lb, sb in ((along_k, along_mn), (along_mn, along_k))}
    if reading is not None:
        runs = dict([list(runs.items())[reading]])
    a_core, b_core = cuda.to_device(a_core), cuda.to_device(b_core)
    a_frag = cuda.to_device(a_fragment(aw))
    out = {}
    for label, (lbo, sbo, mode) in runs.items():
        raw = cuda.device_array((WG, n // 2), np.float32)
        check_kernel(n, kind, lbo, sbo, a_regs, trans_b, kt, mode)[1, WG](a_core, a_frag,
                                                                          b_core, raw)
        got = np.zeros((M, n))
        got[rows, cols] = raw.copy_to_host()
        out[label] = (bool(np.array_equal(got, want)), float(np.max(np.abs(got - want))))
    return out


def throughput(timer, n, kind="f16", iters=2048, blocks_per_sm=2, sms=132):
    """TFLOP/s of ``throughput_kernel`` (and its ms)."""
    from numba import cuda

    blocks = sms * blocks_per_sm
    sink = cuda.device_array(blocks * WG, np.float32)
    kern = throughput_kernel(n, kind)
    ms = timer.time(lambda: kern[blocks, WG](sink, np.int32(iters)), reps=10, flush=False)
    flops = 2.0 * M * n * K * (1 + STEPS * iters) * blocks
    return flops / (ms * 1e-3) / 1e12, ms


def mma_sync_throughput(timer, kind="f16", iters=2048, sms=132):
    from numba import cuda

    blocks, threads = sms * 8, 256
    sink = cuda.device_array(blocks * threads, np.float32)
    kern = mma_sync_kernel(kind)
    ms = timer.time(lambda: kern[blocks, threads](sink, np.int32(iters)), reps=10, flush=False)
    flops = 2.0 * 16 * 8 * 16 * MMA_CHAINS * iters * blocks * (threads // 32)
    return flops / (ms * 1e-3) / 1e12, ms


def _verdicts(res):
    return "; ".join(f"{label}: {'exact' if ok else 'WRONG'} (max |err| {err:.3g})"
                     for label, (ok, err) in res.items())


def cases():
    """Every check the probe runs, in order: ``(name, check keywords)``: the three
    operand forms over ``LAYOUT_SHAPES``, then ``SWIZZLE_CASES``."""
    out = []
    for a_regs, trans_b, what in LAYOUT_CASES:
        for kind, n, kt in LAYOUT_SHAPES:
            out.append((f"layout {what} {kind} m64n{n}k16, K {kt}",
                        dict(n=n, kind=kind, a_regs=a_regs, trans_b=trans_b, kt=kt)))
    for a_regs, kind, n in SWIZZLE_CASES:
        out.append((f"layout A {'registers' if a_regs else 'smem'}, B K-major, swizzled "
                    f"{kind} m64n{n}k16, K 64",
                    dict(n=n, kind=kind, a_regs=a_regs, kt=64, swizzle=True)))
    return out


def _run_case(i, reading=None, as_json=False):
    """Check ``cases()[i]`` (one ``reading`` of it, or both) in this process and
    print its line (``as_json``: ``{"name", "result": {label: [exact, max_err]}}``
    or ``{"name", "error"}`` on one line, for the tests)."""
    import json

    name, kw = cases()[i]
    if reading is not None:
        name += f" (reading {reading} alone)"
    try:
        res = check(**kw, reading=reading)
    except Exception as exc:  # a probe: report the failure
        text = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"name": name, "error": text}) if as_json
              else f"{name}: error {text}")
        return 1
    print(json.dumps({"name": name, "result": res}) if as_json
          else f"{name}: {_verdicts(res)}")
    return 0


def case_in_child(i, reading=None, timeout=120.0):
    """``check`` of ``cases()[i]`` in a child process (``--case i --json``): its
    ``{label: (exact, max_err)}``; raises RuntimeError with the child's error. A
    kernel fault stays in the child's CUDA context."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "bench.wgmma_probe", "--case", str(i), "--json"]
    if reading is not None:
        cmd += ["--reading", str(reading)]
    r = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(f"case {i}: exit {r.returncode}, no result: {r.stderr[-500:]}")
    got = json.loads(lines[-1])
    if "error" in got:
        raise RuntimeError(f"{got['name']}: {got['error']}")
    return {label: (bool(ok), float(err)) for label, (ok, err) in got["result"].items()}


def case_index(**kw):
    """The index in ``cases()`` of the check with these ``check`` keywords."""
    for i, (_, ckw) in enumerate(cases()):
        if ckw == kw:
            return i
    raise KeyError(f"no probe case with {kw}")


def _run_throughput(iters, ns, sms):
    from bench.gpu import Timer

    timer = Timer()
    peak = None
    try:
        import torch

        if torch.cuda.is_available():
            from bench.gpu import torch_matmul_peak

            peak = torch_matmul_peak(torch, "bf16")[0]
            print(f"torch bf16 matmul 8192^3: {peak:.0f} TFLOP/s (backend cuBLAS)")
    except ImportError:
        print("torch not importable: no peak row")
    rows = []
    tf, ms = mma_sync_throughput(timer, iters=iters, sms=sms)
    rows.append(("mma.sync m16n8k16 f16 (8 warps a block, 8 blocks an SM)", tf, ms))
    for n in ns:
        try:
            tf, ms = throughput(timer, n, iters=iters, sms=sms)
        except Exception as exc:  # a fault is sticky: the later rows would fail too
            print(f"wgmma m64n{n}k16 f16: error {type(exc).__name__}: {exc}")
            break
        rows.append((f"wgmma m64n{n}k16 f16 (1 warp group a block, 2 blocks an SM)", tf, ms))
    for name, tf, ms in rows:
        frac = f", {tf / peak:.3f} of torch's bf16 matmul" if peak else ""
        print(f"{name}: {tf:.0f} TFLOP/s ({ms:.3f} ms){frac}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m bench.wgmma_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2048)
    parser.add_argument("--n", default="64,128,256", help="wgmma N of the throughput rows")
    parser.add_argument("--case", type=int, default=None,
                        help="run check i of cases() alone, in this process (the parent "
                             "runs each so: a kernel fault is sticky in a CUDA context, "
                             "so one bad case would fail every later one)")
    parser.add_argument("--reading", type=int, default=None, choices=(0, 1),
                        help="with --case: only that reading of the check (the parent "
                             "runs the second alone when a check's process fails, since "
                             "a fault in the first hides the second)")
    parser.add_argument("--json", action="store_true",
                        help="with --case: the result as one JSON line")
    parser.add_argument("--throughput", action="store_true",
                        help="the throughput rows alone, in this process")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a child process may take")
    args = parser.parse_args(argv)
    from numba import cuda

    if not cuda.is_available():
        print("bench.wgmma_probe: needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    dev = cuda.get_current_device()
    if dev.compute_capability != (9, 0):
        print("wgmma needs sm_90a (compute capability 9.0)", file=sys.stderr)
        return 2
    sms = dev.MULTIPROCESSOR_COUNT
    if args.case is not None:
        return _run_case(args.case, args.reading, args.json)
    if args.throughput:
        return _run_throughput(args.iters, [int(x) for x in args.n.split(",")], sms)
    print(f"device {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
          f"cc {dev.compute_capability}, SMs {sms}; each check in its own process")
    import subprocess

    base = [sys.executable, "-m", "bench.wgmma_probe"]
    children = [base + ["--case", str(i)] for i in range(len(cases()))]
    children.append(base + ["--throughput", "--iters", str(args.iters), "--n", args.n])
    status = 0
    while children:
        cmd = children.pop(0)
        sys.stdout.flush()
        try:
            r = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            code, out, err = r.returncode, r.stdout.strip(), r.stderr
        except subprocess.TimeoutExpired:
            code, out, err = 1, f"{' '.join(cmd[3:])}: no answer in {args.timeout:.0f} s", ""
        out = out or f"{' '.join(cmd[3:])}: exit {code}, no output"
        print(out)
        if code:
            status = 1
            last = [x for x in err.splitlines() if "Error" in x][-1:]
            if last and "error" not in out:
                print(f"  ({last[0].strip()})")
            if cmd[3] == "--case" and "--reading" not in cmd:
                children.insert(0, cmd + ["--reading", "1"])  # the reading the fault hid
    return status


if __name__ == "__main__":
    sys.exit(main())
