"""Roundings that planted precision mutants apply inside kernels (one place for all).

A precision mutant is a compile-time switch of a production kernel that makes
it lose precision the way a subtly wrong kernel would: the softmax weights P
rounded to fp16 before P.V, q rounded to bf16, the running max held in fp16,
an exponential with a larger error. These helpers are that rounding, shared by
every kernel that carries such a mutant (``attention.decode.fast``,
``attention.gemm.tgemm``, ``attention.gemm.sgemm``, ``mla.attn_gemm``). A kernel built
without a mutant never calls them, so its PTX does not change.

Each helper takes and returns a float32 scalar, inlined on the GPU (an LLVM
intrinsic doing the bit operations), plain numpy on the simulator:

* ``round_fp16(x)``: to the nearest float16 (ties to even), back to float32;
* ``round_bf16(x)``: to the nearest bfloat16 (ties to even), back to float32;
* ``chop_exp(x)``: ``exp(x)`` with the last ``CHOP_BITS`` mantissa bits
  cleared (truncated toward zero: a relative error up to ``2**-(23 -
  CHOP_BITS)``, always low, as a short polynomial with a biased error).

NaN and infinities are not rounded specially (the mutants run on finite data;
an infinity stays infinite, a NaN stays a NaN in all three).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, types

from attention.core.device import SIMULATOR

CHOP_BITS = 7  # chop_exp keeps 16 of float32's 23 mantissa bits (rel. error < 2**-16)
MUTANT_ROUNDINGS = ("round_fp16", "round_bf16", "chop_exp")


def _sim_helpers():
    import ml_dtypes

    def round_fp16(x):
        return np.float32(np.float16(np.float32(x)))

    def round_bf16(x):
        return np.float32(ml_dtypes.bfloat16(np.float32(x)))

    mask = np.uint32((0xFFFFFFFF << CHOP_BITS) & 0xFFFFFFFF)

    def chop_exp(x):
        with np.errstate(over="ignore"):
            e = np.float32(np.exp(np.float32(x)))
        return (np.array(e, np.float32).view(np.uint32) & mask).view(np.float32)[()]

    return round_fp16, round_bf16, chop_exp


def _gpu_helpers():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    @intrinsic
    def _fp16(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), f32)

        return sig, codegen

    @intrinsic
    def _bf16(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            bits = builder.bitcast(args[0], i32)
            odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            bits = builder.add(bits, builder.add(ir.Constant(i32, 0x7FFF), odd))
            bits = builder.and_(bits, ir.Constant(i32, 0xFFFF0000 - (1 << 32)))
            return builder.bitcast(bits, f32)

        return sig, codegen

    @intrinsic
    def _chop(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            bits = builder.bitcast(args[0], i32)
            mask = ((0xFFFFFFFF << CHOP_BITS) & 0xFFFFFFFF) - (1 << 32)
            return builder.bitcast(builder.and_(bits, ir.Constant(i32, mask)), f32)

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def round_fp16(x):
        return _fp16(float32(x))

    @cuda.jit(device=True, inline="always")
    def round_bf16(x):
        return _bf16(float32(x))

    @cuda.jit(device=True, inline="always")
    def chop_exp(x):
        return _chop(math.exp(float32(x)))

    return round_fp16, round_bf16, chop_exp


round_fp16, round_bf16, chop_exp = _sim_helpers() if SIMULATOR else _gpu_helpers()
