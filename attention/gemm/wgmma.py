"""Hopper warp-group MMA (``wgmma.mma_async``, sm_90a) over 128-byte-swizzled,
K-major 16-bit tiles in shared memory, fp32 accumulation.

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
``descriptor(addr)``: the device form of a 128-byte-swizzle descriptor (LBO
16, SBO 1024) of a shared byte address.

On the simulator (shared base address 0) ``tile_product`` is an emulation
from the same descriptors: each thread forms its ``N / 2`` accumulators from
the operands' 16-bit values at their swizzled addresses (a value's logical byte
address ``L`` is stored at ``L ^ (((L >> 7) & 7) << 4)``, the swizzle being of
the address bits), one k step at a time by ``attention.gemm.mma16.k_step_sum``,
the rule mma.sync's emulation uses: so a kernel's data movement through the
descriptors is checked in CI, and on the simulator the wgmma and mma.sync forms
of a product give the same bits. Whether the GPU's wgmma rounds a k step as its
mma.sync does is a question for the GPU.
"""

from __future__ import annotations

import functools

from numba import cuda  # a module global: the simulator swaps it in device functions

from attention.core.device import SIMULATOR

SWIZZLE_128B = 1  # the descriptor's mode field (bits 62-63)
SBO = 1024  # bytes between 8-row atoms of a 128-byte-swizzled K-major operand
LBO = 16  # unused by a swizzled K-major operand whose K fits one swizzle row
KINDS = ("f16", "bf16")


def _sim_product(kind, n, blocks, a_block, b_block):
    """The simulator's ``tile_product`` (module docstring)."""
    from numba import float32

    from attention.core.device import device_fn
    from attention.gemm.mma16 import _halves, k_step_sum

    regs = n // 2

    def value(smem, addr):
        phys = addr ^ (((addr >> 7) & 7) << 4)
        return _halves(smem[phys // 4], kind)[(phys >> 1) & 1]

    def product(smem, da, db):
        t = cuda.threadIdx.x % 128
        w, lane = t // 32, t % 32
        a0, b0 = (int(da) & 0x3FFF) << 4, (int(db) & 0x3FFF) << 4
        out = []
        for i in range(regs):
            row = 16 * w + lane // 4 + 8 * ((i % 4) // 2)
            col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
            acc = 0.0
            for j in range(blocks):
                for s in range(4):
                    ra = a0 + j * a_block + 32 * s + (row // 8) * SBO + (row % 8) * 128
                    rb = b0 + j * b_block + 32 * s + (col // 8) * SBO + (col % 8) * 128
                    acc = k_step_sum(acc, [value(smem, ra + 2 * k) for k in range(16)],
                                     [value(smem, rb + 2 * k) for k in range(16)])
            out.append(float32(acc))
        return tuple(out)

    return device_fn(product)


def descriptor_host(addr):
    """The 64-bit descriptor of shared byte address ``addr`` (host form, for tests)."""
    return (((addr & 0x3FFFF) >> 4) | ((LBO >> 4) << 16) | ((SBO >> 4) << 32)
            | (SWIZZLE_128B << 62))


@functools.lru_cache(maxsize=None)
def _ops():
    from numba import uint64

    from attention.core.device import device_fn

    def descriptor(addr):
        return (uint64((addr & 0x3FFFF) >> 4) | (uint64(LBO >> 4) << uint64(16))
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


def descriptor():
    """Device ``descriptor(addr) -> uint64`` (module docstring)."""
    return _ops()[0]


def fence_async():
    """Device ``fence_async()`` (module docstring)."""
    return _ops()[1]


def tile_text(kind, n, blocks, a_block, b_block):
    """The PTX of ``tile_product`` (a string; ``$0 .. $(n/2 - 1)`` the
    accumulators, ``$(n/2)`` / ``$(n/2 + 1)`` the two base descriptors)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"n: expected a multiple of 8 in [8, 256], got {n}")
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    # p0 false (the first instruction ignores the accumulators), p1 true
    lines = ["{", ".reg .b64 wa, wb;", ".reg .pred p0, p1;", "setp.ne.b32 p0, 0, 0;",
             "setp.eq.b32 p1, 0, 0;", "wgmma.fence.sync.aligned;"]
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
    first = True
    for j in range(blocks):
        for s in range(4):
            # the address field is bits 0-13 of the descriptor, in 16-byte units: the
            # offsets are added there (shared addresses stay below 2^18 bytes)
            lines.append(f"add.s64 wa, ${regs}, {(j * a_block + 32 * s) >> 4};")
            lines.append(f"add.s64 wb, ${regs + 1}, {(j * b_block + 32 * s) >> 4};")
            lines.append(f"{op} {{{outs}}}, wa, wb, {'p0' if first else 'p1'}, 1, 1, 0, 0;")
            first = False
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return "\n".join(lines)


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
