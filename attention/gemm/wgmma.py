"""Hopper warp-group MMA (``wgmma.mma_async``, sm_90a) over 128-byte-swizzled
16-bit tiles in shared memory, fp32 accumulation.

A warp group (4 consecutive warps, 128 threads) multiplies ``D[64, N] = A[64, K]
B[K, N]`` with A and ``B^T`` read from shared memory through 64-bit matrix
descriptors (``descriptor``): no ``ldmatrix``, no operand registers, and a
warp group reads each operand once an instruction where four warps of
``mma.sync`` read A four times. ``bench.wgmma_probe`` established on the H200
what this module relies on (``reports/gpu/runs/d3bcec1-h200-mla-direct``):

* the 128-byte swizzle of K-major operands is the layout of ``attention.gemm.mma16``'s
  tiles at 8 chunks a row (row ``r`` 128 bytes at ``128 r``, chunk ``c`` at ``c ^
  (r % 8)``): a 64-column block of a ``[rows, W]`` 16-bit tile stored as column
  blocks of ``[rows, 64]`` is one swizzled operand, 8-row atoms 1024 bytes apart
  (the descriptor's stride), a k step of 16 inside it 32 bytes on; the swizzle is
  of the address bits, so a block must start 1024-byte aligned;
* the accumulators: thread ``t`` (warp ``w = t // 32`` of the group, lane ``l``)
  holds register ``i`` of ``N / 2`` at row ``16 w + l // 4 + 8 ((i % 4) // 2)``,
  column ``8 (i // 4) + 2 (l % 4) + i % 2``: warp ``w`` holds rows ``16 w ..``
  exactly as an ``mma.sync.m16n8k16`` C fragment per 8-column n tile;
* throughput: m64n64k16 to m64n256k16 at 940-953 TFLOP/s against 626 for
  ``mma.sync.m16n8k16``.

``tile_product(kind, n, blocks, a_block, b_block)``: a device function
``(smem, da, db) -> N / 2 floats`` (``smem`` the shared array the addresses
point into: it types the call on a GPU, the simulator reads it) issuing ``4
blocks`` wgmma ``m64nNk16`` in one asm statement (fence, the instructions,
commit, wait): column block ``j``'s k
step ``s`` reads A at ``da``'s address plus ``j a_block + 32 s`` bytes and B at
``db``'s plus ``j b_block + 32 s``, the first with the accumulators zeroed.
The k steps are summed in that order, one k step of 16 products at a time.
``fence_async()``: ``fence.proxy.async.shared::cta``, after a thread's shared
stores (``st.shared``, landed ``cp.async``) that a later wgmma reads.
``descriptor(lbo=16)``: the device form ``(addr) -> uint64`` of a
128-byte-swizzle descriptor (SBO 1024) of a shared byte address.

``tile_accumulate(kind, n, steps, trans_b=1)``: a device function ``(smem, da,
db, acc)`` adding ``A[64, 16 steps] B[16 steps, N]`` onto ``acc`` (a local
array of ``N / 2`` floats in the accumulator layout) in ``steps`` wgmma, A
K-major as above, B **MN-major** (``trans_b``: N contiguous, V as a latent tile
stores it): rows of 128 bytes (64 columns) swizzled as above, 8-row groups SBO
(1024) bytes apart along K, 64-column atoms LBO bytes apart along N (the
descriptor's ``lbo``: a tile's column-block stride); a k step of 16 rows is
``MN_STEP`` (2,048) bytes on. That reading of the two offsets for a swizzled
MN-major operand is the one of the PTX ISA's canonical layouts; the kernels'
GPU tests (the mma.sync form's bits) are its check.

On the simulator (shared base address 0) ``tile_product`` is an emulation
from the same descriptors: each thread forms its ``N / 2`` accumulators from
the operands' 16-bit values at their swizzled addresses (a value's logical byte
address ``L`` is stored at ``L ^ (((L >> 7) & 7) << 4)``, the swizzle being of
the address bits), one k step at a time by ``attention.gemm.mma16.k_step_sum``,
the rule mma.sync's emulation uses: so a kernel's data movement through the
descriptors is checked in CI, and on the simulator the wgmma and mma.sync forms
of a product give the same bits. On the H100 the GPU's wgmma gave its mma.sync's
bits too (the MLA kernel at both levels, f16 and bf16:
``reports/gpu/runs/52cbfaa-h100-mla-wgmma``), so it sums a k step as mma.sync does.
"""

from __future__ import annotations

import functools

from numba import cuda  # a module global: the simulator swaps it in device functions

from attention.core.device import SIMULATOR

SWIZZLE_128B = 1  # the descriptor's mode field (bits 62-63)
SBO = 1024  # bytes between 8-row atoms of a 128-byte-swizzled K-major operand
LBO = 16  # unused by a swizzled K-major operand whose K fits one swizzle row
MN_STEP = 16 * 128  # bytes a k step of 16 rows moves along an MN-major operand
KINDS = ("f16", "bf16")


def _value(kind):
    from attention.gemm.mma16 import _halves

    def value(smem, addr):  # the 16-bit value at logical byte address addr (swizzled)
        phys = addr ^ (((addr >> 7) & 7) << 4)
        return _halves(smem[phys // 4], kind)[(phys >> 1) & 1]

    return value


def _acc_at(t, i):
    """(row, column) of accumulator register ``i`` of warp-group thread ``t``."""
    w, lane = t // 32, t % 32
    return 16 * w + lane // 4 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


def _k_major_row(value, smem, base, row):
    """The 16 values of a k step of row ``row`` of a K-major operand whose step
    starts at byte ``base`` (8-row atoms SBO apart, 128-byte rows)."""
    at = base + (row // 8) * SBO + (row % 8) * 128
    return [value(smem, at + 2 * k) for k in range(16)]


def _sim_product(kind, n, blocks, a_block, b_block):
    """The simulator's ``tile_product`` (module docstring)."""
    from numba import float32

    from attention.core.device import device_fn
    from attention.gemm.mma16 import k_step_sum

    regs = n // 2
    value = _value(kind)

    def product(smem, da, db):
        t = cuda.threadIdx.x % 128
        a0, b0 = (int(da) & 0x3FFF) << 4, (int(db) & 0x3FFF) << 4
        out = []
        for i in range(regs):
            row, col = _acc_at(t, i)
            acc = 0.0
            for j in range(blocks):
                for s in range(4):
                    acc = k_step_sum(
                        acc, _k_major_row(value, smem, a0 + j * a_block + 32 * s, row),
                        _k_major_row(value, smem, b0 + j * b_block + 32 * s, col))
            out.append(float32(acc))
        return tuple(out)

    return device_fn(product)


def _sim_accumulate(kind, n, steps, trans_b):
    """The simulator's ``tile_accumulate`` (module docstring): B's element (k, c)
    at ``LBO (c // 64) + SBO (k // 8) + 128 (k % 8) + 2 (c % 64)`` bytes past a
    step's address (MN-major; ``trans_b`` 0: the K-major reading, ``SBO (c //
    8) + 128 (c % 8) + 2 k``), the LBO and the address from the descriptor."""
    from numba import float32

    from attention.core.device import device_fn
    from attention.gemm.mma16 import k_step_sum

    regs = n // 2
    value = _value(kind)

    def accumulate(smem, da, db, acc):
        t = cuda.threadIdx.x % 128
        a0, b0 = (int(da) & 0x3FFF) << 4, (int(db) & 0x3FFF) << 4
        lbo = ((int(db) >> 16) & 0x3FFF) << 4
        for i in range(regs):
            row, col = _acc_at(t, i)
            x = float(acc[i])
            for s in range(steps):
                if trans_b:
                    rb = b0 + MN_STEP * s
                    bs = [value(smem, rb + (col // 64) * lbo + (k // 8) * SBO + (k % 8) * 128
                                + 2 * (col % 64)) for k in range(16)]
                else:
                    bs = _k_major_row(value, smem, b0 + 32 * s, col)
                x = k_step_sum(x, _k_major_row(value, smem, a0 + 32 * s, row), bs)
            acc[i] = float32(x)

    return device_fn(accumulate)


def descriptor_host(addr, lbo=LBO):
    """The 64-bit descriptor of shared byte address ``addr`` (host form, for tests)."""
    return (((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | ((SBO >> 4) << 32)
            | (SWIZZLE_128B << 62))


@functools.lru_cache(maxsize=None)
def _ops(lbo=LBO):
    from numba import uint64

    from attention.core.device import device_fn

    if lbo % 16 or not 0 <= lbo < 1 << 18:
        raise ValueError(f"lbo: a multiple of 16 bytes below 2^18, got {lbo}")

    def descriptor(addr):
        return (uint64((addr & 0x3FFFF) >> 4) | (uint64(lbo >> 4) << uint64(16))
                | (uint64(SBO >> 4) << uint64(32)) | (uint64(SWIZZLE_128B) << uint64(62)))

    if SIMULATOR:  # the emulation reads shared memory as it stands
        def nothing():
            return None

        return device_fn(descriptor), device_fn(nothing)

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def fence_async(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, "fence.proxy.async.shared::cta;", "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()

        return sig, codegen

    return device_fn(descriptor), fence_async


def descriptor(lbo=LBO):
    """Device ``descriptor(addr) -> uint64`` (module docstring); ``lbo``: the
    leading byte offset (an MN-major operand's bytes between 64-column atoms)."""
    return _ops(int(lbo))[0]


def fence_async():
    """Device ``fence_async()`` (module docstring)."""
    return _ops()[1]


def _framed(kind, n, preds, body):
    """The asm text around ``body(op, outs)`` (its instruction lines): the
    arguments' checks, the registers, ``preds`` (the predicate set-up lines),
    the fence before and the commit and wait after."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"n: expected a multiple of 8 in [8, 256], got {n}")
    outs = ", ".join(f"${i}" for i in range(n // 2))
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
    lines = ["{", ".reg .b64 wa, wb;", *preds, "wgmma.fence.sync.aligned;", *body(op, outs),
             "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return "\n".join(lines)


def tile_text(kind, n, blocks, a_block, b_block):
    """The PTX of ``tile_product`` (a string; ``$0 .. $(n/2 - 1)`` the
    accumulators, ``$(n/2)`` / ``$(n/2 + 1)`` the two base descriptors)."""
    regs = n // 2

    def body(op, outs):
        lines = []
        for j in range(blocks):
            for s in range(4):
                # the address field is bits 0-13 of the descriptor, in 16-byte units:
                # the offsets are added there (shared addresses stay below 2^18 bytes)
                lines.append(f"add.s64 wa, ${regs}, {(j * a_block + 32 * s) >> 4};")
                lines.append(f"add.s64 wb, ${regs + 1}, {(j * b_block + 32 * s) >> 4};")
                first = j == 0 and s == 0
                lines.append(f"{op} {{{outs}}}, wa, wb, {'p0' if first else 'p1'}, 1, 1, 0, 0;")
        return lines

    # p0 false (the first instruction ignores the accumulators), p1 true
    return _framed(kind, n, [".reg .pred p0, p1;", "setp.ne.b32 p0, 0, 0;",
                             "setp.eq.b32 p1, 0, 0;"], body)


@functools.lru_cache(maxsize=None)
def tile_product(kind, n, blocks, a_block, b_block):
    """Device ``product(smem, da, db) -> tuple of n / 2 float32`` (module docstring)."""
    tile_text(kind, n, blocks, a_block, b_block)  # the arguments' checks
    if SIMULATOR:
        return _sim_product(kind, n, blocks, a_block, b_block)
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    regs = n // 2
    text = tile_text(kind, n, blocks, a_block, b_block)
    f32, i64 = ir.FloatType(), ir.IntType(64)
    ret = types.UniTuple(types.float32, regs)
    struct = ir.LiteralStructType([f32] * regs)

    @intrinsic
    def product(typingctx, smem, da, db):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(struct, [i64, i64])
            cons = ",".join(["=f"] * regs) + ",l,l,~{memory}"
            r = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                             list(args[1:]))
            return context.make_tuple(builder, ret, [builder.extract_value(r, i)
                                                     for i in range(regs)])

        return ret(smem, types.uint64, types.uint64), codegen

    return product


def accumulate_text(kind, n, steps, trans_b=1):
    """The PTX of ``tile_accumulate`` (a string; ``$0 .. $(n/2 - 1)`` the
    accumulators, read (tied inputs ``$(n/2) ..``) and written, ``$n`` / ``$(n +
    1)`` the base descriptors of A and B)."""
    if steps < 1:
        raise ValueError(f"steps: at least 1, got {steps}")

    def body(op, outs):
        lines = []
        for s in range(steps):
            lines.append(f"add.s64 wa, ${n}, {(32 * s) >> 4};")
            lines.append(f"add.s64 wb, ${n + 1}, "
                         f"{(MN_STEP * s if trans_b else 32 * s) >> 4};")
            lines.append(f"{op} {{{outs}}}, wa, wb, p1, 1, 1, 0, {int(bool(trans_b))};")
        return lines

    return _framed(kind, n, [".reg .pred p1;", "setp.eq.b32 p1, 0, 0;"], body)


@functools.lru_cache(maxsize=None)
def tile_accumulate(kind, n, steps, trans_b=1):
    """Device ``accumulate(smem, da, db, acc)``: ``acc`` (a local float32 array
    of ``n / 2``, the accumulator layout) += ``A[64, 16 steps] B[16 steps, n]``
    in ``steps`` wgmma ``m64nNk16`` (module docstring): A K-major at ``da``'s
    address plus ``32 s`` bytes a k step ``s``, B MN-major (``trans_b`` 1: n
    contiguous, 64-column atoms the descriptor's LBO apart, 8-row groups SBO
    apart) at ``db``'s plus ``MN_STEP s`` (``trans_b`` 0: B K-major, ``32 s``).
    The k steps are summed in order, each onto the accumulators as they stand."""
    accumulate_text(kind, n, steps, trans_b)  # the arguments' checks
    if SIMULATOR:
        return _sim_accumulate(kind, n, steps, trans_b)
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    regs = n // 2
    text = accumulate_text(kind, n, steps, trans_b)
    f32, i64 = ir.FloatType(), ir.IntType(64)
    struct = ir.LiteralStructType([f32] * regs)
    cons = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["l", "l", "~{memory}"])

    @intrinsic
    def accumulate(typingctx, smem, da, db, acc):
        if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[3])(context, builder, args[3])
            ptrs = [builder.gep(ary.data, [ir.Constant(i64, i)]) for i in range(regs)]
            fnty = ir.FunctionType(struct, [f32] * regs + [i64, i64])
            r = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                             [builder.load(q) for q in ptrs] + list(args[1:3]))
            for i, q in enumerate(ptrs):
                builder.store(builder.extract_value(r, i), q)
            return context.get_dummy_value()

        return types.void(smem, types.uint64, types.uint64, acc), codegen

    return accumulate
