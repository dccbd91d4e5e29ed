"""16-bit tensor-core building blocks: ``mma.m16n8k16`` with f16 or bf16 operands
and fp32 accumulation, ``ldmatrix`` from a swizzled shared-memory tile, and
fp32 -> 16-bit packing.

A warp multiplies ``D[16 x 8] = A[16 x 16] B[16 x 8] + C`` (``mma``). Each lane
holds (``g = lane // 4``, ``t = lane % 4``; a word is two 16-bit elements, the
lower column in the low half):

    A (row major)  a0: A[g][2t, 2t+1]    a1: A[g+8][2t, 2t+1]
                   a2: A[g][2t+8, 2t+9]  a3: A[g+8][2t+8, 2t+9]
    B (columns)    b0: B[2t, 2t+1][g]    b1: B[2t+8, 2t+9][g]
    C, D (fp32)    c0: C[g][2t]  c1: C[g][2t+1]  c2: C[g+8][2t]  c3: C[g+8][2t+1]

``ldmatrix_x4(tile, row0, col0, lane)`` loads four 8 x 8 matrices of a tile
(rows ``row0 .. row0+15``, columns ``col0 .. col0+15``: matrix j is rows
``row0 + 8 (j % 2)``, columns ``col0 + 8 (j // 2)``), which is the A fragment
of that 16 x 16 block; ``ldmatrix_x2(tile, row0, col0, lane)`` loads rows
``row0 .. row0+7``, columns ``col0 .. col0+15`` as the B fragment of a matrix
stored as ``B^T`` (K rows of a score GEMM: a row a key, D along it);
``ldmatrix_x2_trans`` loads rows ``row0 .. row0+15`` (k), columns ``col0 ..
col0+7`` (n) transposed, the B fragment of a matrix stored K-major (V rows in
P.V). Every thread passes its lane; lane ``i`` supplies the address of row
``i % 8`` of matrix ``i // 8``, as the instruction wants.

Tiles (``Tile``): a shared uint32 array holding a ``rows x cols`` 16-bit
matrix, rows of ``cols / 8`` 16-byte chunks, chunk ``c`` of row ``r`` stored at
chunk ``c ^ ((r // max(1, 8 // C)) % C)`` (``C`` chunks a row, a power of two
<= 8; ``swizzle``): the
8 rows an ldmatrix phase reads fall on distinct 16-byte bank groups.
``tile_store(tile, cols, r, c, word)`` / ``tile_word`` address a word (two
elements, ``c`` even) through the swizzle.

``pack(lo, hi)`` rounds two float32 to one f16x2 / bf16x2 word (``cvt.rn``:
to nearest even), as P is rounded before P.V.

On the simulator ``mma`` is one warp collective (each lane gathers its rows of
A and columns of B) followed by the H200's k step (``k_step_sum``, the rule
``validation.mma_accum_probe`` fitted to every output the H200 gave it: each
product aligned by its operands' exponent sum, C by its own, every term
truncated 2 bits below fp32's last place at the largest of those exponents, the
sum truncated to fp32); the products of 16-bit operands are exact. ``ldmatrix``
reads the shared words the addressed rows hold, ``pack`` rounds through numpy.

``kind``: "f16" or "bf16" (``ops(kind)`` returns ``(mma, pack)`` for it).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types, uint32

from attention.core import checks
from attention.core.device import BFLOAT16, SIMULATOR, as_device_view, device_fn, ptx_statement
from attention.core.simwarp import gather

WARP = 32
KINDS = ("f16", "bf16")


def kind_of(dt, name):
    """"f16" / "bf16" for a 16-bit dtype; else a DTypeError naming ``name``."""
    dt = np.dtype(dt)
    if dt == np.float16:
        return "f16"
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bf16"
    raise checks.DTypeError(f"{name}: expected dtype float16 or bfloat16, got {dt}")


def as_words(x, flat=False):
    """A 16-bit device array (numba, ``__cuda_array_interface__``, DLPack, torch
    bfloat16 included) as uint32 words, two elements a word (the last axis
    halved; ``flat``: 1-D), no copy."""
    if type(x).__module__.startswith("torch"):
        import torch

        x = x.view(torch.int32)
    d = as_device_view(x).view(np.uint32)
    return d.reshape(int(np.prod(d.shape))) if flat else d


def swizzle(row, chunk, chunks):
    """Stored chunk of 16-byte chunk ``chunk`` of row ``row`` (``chunks`` a row,
    a power of two <= 8)."""
    return chunk ^ ((row // max(1, 8 // chunks)) % chunks)


def _tile_index(row, col, cols):
    # word index of elements (row, col), (row, col + 1) (col even) in a swizzled tile
    chunks = cols // 8
    per = 8 // chunks if chunks < 8 else 1
    stored = (col // 8) ^ ((row // per) % chunks)
    return row * (cols // 2) + stored * 4 + (col % 8) // 2


tile_index = device_fn(_tile_index)


def tile_word(tile, cols, row, col):
    """The word holding elements ``(row, col)``, ``(row, col + 1)`` (``col`` even)."""
    return tile[tile_index(row, col, cols)]


tile_word = device_fn(tile_word)


def tile_store(tile, cols, row, col, word):
    tile[tile_index(row, col, cols)] = word


tile_store = device_fn(tile_store)


def tile_index_host(row, col, cols):
    """numpy / host form of the swizzled word index (tests, host packing)."""
    return _tile_index(row, col, cols)


# ---------------------------------------------------------------------------
# GPU: inline PTX
# ---------------------------------------------------------------------------

def _gpu_ops(kind):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)
    ptx_t = "f16" if kind == "f16" else "bf16"

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_t}.{ptx_t}.f32 "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
            r = builder.call(ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"),
                             list(args))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(r, i) for i in range(4)])

        return sig, codegen

    cvt = "cvt.rn.f16x2.f32" if kind == "f16" else "cvt.rn.bf16x2.f32"

    @intrinsic
    def pack(typingctx, lo, hi):
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(i32, [f32, f32])
            # cvt.rn.*x2.f32 d, a, b puts a in the upper half, b in the lower
            return builder.call(ir.InlineAsm(fnty, f"{cvt} $0, $1, $2;", "=r,f,f"),
                                [args[1], args[0]])

        return sig, codegen

    return mma, pack


@functools.lru_cache(maxsize=None)
def _gpu_ldmatrix():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)
    i8p = ir.IntType(8).as_pointer()
    to_shared = ("{ .reg .u64 sa64; .reg .u32 sa32; cvta.to.shared.u64 sa64, $%d; "
                 "cvt.u32.u64 sa32, sa64; %s }")

    def make(count, trans):
        outs = ", ".join(f"${i}" for i in range(count))
        op = f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if trans else ''}.shared.b16"

        @intrinsic
        def ld(typingctx, tile, word):
            sig = types.UniTuple(types.uint32, count)(tile, word)

            def codegen(context, builder, sig, args):
                ary = context.make_array(sig.args[0])(context, builder, args[0])
                idx = args[1]
                idx = builder.sext(idx, i64) if idx.type.width < 64 else idx
                ptr = builder.gep(builder.bitcast(ary.data, i8p),
                                  [builder.mul(idx, ir.Constant(i64, 4))])
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * count), [i8p])
                text = to_shared % (count, f"{op} {{{outs}}}, [sa32];")
                cons = ",".join(["=r"] * count) + ",l,~{memory}"
                r = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), [ptr])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(r, i) for i in range(count)])

            return sig, codegen

        return ld

    return make(4, False), make(2, False), make(2, True)


# ---------------------------------------------------------------------------
# simulator stand-ins
# ---------------------------------------------------------------------------

def _np16(kind):
    if kind == "f16":
        return np.float16
    import ml_dtypes

    return ml_dtypes.bfloat16


def _halves(word, kind):
    """float values of the two 16-bit elements of a uint32 word (sim)."""
    w = np.uint32(int(word) & 0xFFFFFFFF)
    lo = np.uint16(int(w) & 0xFFFF)
    hi = np.uint16(int(w) >> 16)
    if kind == "f16":
        return float(lo.view(np.float16)), float(hi.view(np.float16))
    return (float(np.uint32(int(lo) << 16).view(np.float32)),
            float(np.uint32(int(hi) << 16).view(np.float32)))


def _exponent(x):
    # floor(log2 |x|) of a nonzero float (Python float)
    return math.frexp(x)[1] - 1


def k_step_sum(c, a_vals, b_vals):
    """One ``mma.m16n8k16`` output as the H200 forms it (host / simulator):
    ``c`` (float32 value) plus the products ``a_vals[k] * b_vals[k]`` (16-bit
    values as floats). Each product is aligned by ``e(a) + e(b)`` (``e`` =
    floor(log2 |x|); the product itself may reach one bit above), C by
    ``e(c)``; with ``top`` the largest, every term is truncated toward zero to
    a multiple of ``2^(top - 25)`` and the kept terms are added exactly, the
    sum truncated to float32. Zeros take no part in ``top``; subnormal
    operands use their own exponent (not probed on the hardware). Non-finite
    terms give the exact sum's IEEE result."""
    from attention.gemm.tgemm import round_rz

    c = float(c)
    prods = [float(x) * float(y) for x, y in zip(a_vals, b_vals)]
    if not math.isfinite(c) or not all(math.isfinite(p) for p in prods):
        return round_rz(c + sum(prods))  # inf / NaN as IEEE sums give them
    leads = [_exponent(float(x)) + _exponent(float(y))
             for x, y, p in zip(a_vals, b_vals, prods) if p != 0.0]
    if c != 0.0:
        leads.append(_exponent(c))
    if not leads:  # every term zero
        return round_rz(c + math.fsum(prods))
    grid = math.ldexp(1.0, max(leads) - 25)
    kept = math.trunc(c / grid) + sum(math.trunc(p / grid) for p in prods)
    return round_rz(kept * grid)


def _sim_ops(kind):
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane = cuda.threadIdx.x % WARP
        g, t = lane // 4, lane % 4
        own = (a0, a1, a2, a3, b0, b1)
        regs = gather(own)  # every lane's fragment registers, one rendezvous
        rows = [[0.0] * 16, [0.0] * 16]  # A rows g, g + 8
        cols = [[0.0] * 16, [0.0] * 16]  # B columns 2t, 2t + 1
        for tp in range(4):
            src = regs.get(4 * g + tp, own)
            for r, (lo_i, hi_i) in enumerate(((0, 2), (1, 3))):
                x = _halves(src[lo_i], kind)
                y = _halves(src[hi_i], kind)
                rows[r][2 * tp], rows[r][2 * tp + 1] = x
                rows[r][2 * tp + 8], rows[r][2 * tp + 9] = y
            for h in range(2):
                src = regs.get(4 * (2 * t + h) + tp, own)
                x = _halves(src[4], kind)
                y = _halves(src[5], kind)
                cols[h][2 * tp], cols[h][2 * tp + 1] = x
                cols[h][2 * tp + 8], cols[h][2 * tp + 9] = y
        out = []
        for r, c in ((0, 0), (0, 1), (1, 0), (1, 1)):
            out.append(k_step_sum((c0, c1, c2, c3)[2 * r + c], rows[r], cols[c]))
        return tuple(out)

    def pack(lo, hi):
        dt = _np16(kind)
        lo16 = np.array([lo], np.float32).astype(dt).view(np.uint16)[0]
        hi16 = np.array([hi], np.float32).astype(dt).view(np.uint16)[0]
        return np.uint32((int(hi16) << 16) | int(lo16))

    return mma, pack


def _sim_ldmatrix():
    def rows_of(word, count):
        # each lane's row address, gathered: addr[j][r] = row r of matrix j
        words = gather(word)
        return [[words.get(8 * j + r, word) for r in range(8)] for j in range(count)]

    def x4(tile, word):
        lane = cuda.threadIdx.x % WARP
        addr = rows_of(word, 4)
        g, t = lane // 4, lane % 4
        return tuple(np.uint32(tile[int(addr[j][g]) + t]) for j in range(4))

    def x2(tile, word):
        lane = cuda.threadIdx.x % WARP
        addr = rows_of(word, 2)
        g, t = lane // 4, lane % 4
        return tuple(np.uint32(tile[int(addr[j][g]) + t]) for j in range(2))

    def x2_trans(tile, word):
        # thread gets (row 2t, col g), (row 2t + 1, col g) of each matrix
        lane = cuda.threadIdx.x % WARP
        addr = rows_of(word, 2)
        g, t = lane // 4, lane % 4
        out = []
        for j in range(2):
            w0 = int(tile[int(addr[j][2 * t]) + g // 2])
            w1 = int(tile[int(addr[j][2 * t + 1]) + g // 2])
            shift = 16 * (g % 2)
            out.append(np.uint32(((w0 >> shift) & 0xFFFF) | (((w1 >> shift) & 0xFFFF) << 16)))
        return tuple(out)

    return x4, x2, x2_trans


if SIMULATOR:
    _ld4, _ld2, _ld2t = (device_fn(f) for f in _sim_ldmatrix())
else:
    _ld4, _ld2, _ld2t = _gpu_ldmatrix()


@functools.lru_cache(maxsize=None)
def ops(kind):
    """``(mma, pack)`` device functions for 16-bit operand ``kind`` ("f16" / "bf16")."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if SIMULATOR:
        return tuple(device_fn(f) for f in _sim_ops(kind))
    return _gpu_ops(kind)


def _row_word(cols, row, col):
    # word index of the 16-byte chunk (row, col .. col + 7) (col a multiple of 8)
    return tile_index(row, col, cols)


_row_word = device_fn(_row_word)


def ldmatrix_x4(tile, cols, row0, col0, lane):
    """A fragment (a0..a3) of the 16 x 16 block at ``(row0, col0)`` of a swizzled
    tile of ``cols`` columns."""
    j = lane // 8
    r = row0 + lane % 8 + 8 * (j % 2)
    return _ld4(tile, _row_word(cols, r, col0 + 8 * (j // 2)))


ldmatrix_x4 = device_fn(ldmatrix_x4)


def ldmatrix_x2(tile, cols, row0, col0, lane):
    """B fragment (b0, b1) of a matrix stored ``B^T`` (n rows of k): rows
    ``row0 .. row0+7`` (n), columns ``col0 .. col0+15`` (k)."""
    j = (lane // 8) % 2
    return _ld2(tile, _row_word(cols, row0 + lane % 8, col0 + 8 * j))


ldmatrix_x2 = device_fn(ldmatrix_x2)


def ldmatrix_x2_trans(tile, cols, row0, col0, lane):
    """B fragment (b0, b1) of a matrix stored k-major (k rows of n): rows
    ``row0 .. row0+15`` (k), columns ``col0 .. col0+7`` (n), transposed."""
    j = (lane // 8) % 2
    return _ld2t(tile, _row_word(cols, row0 + lane % 8 + 8 * j, col0))


ldmatrix_x2_trans = device_fn(ldmatrix_x2_trans)


# ---------------------------------------------------------------------------
# shared-space byte addresses: the kernels' forms
# ---------------------------------------------------------------------------

def _sim_x4_trans(tile, word):
    # ldmatrix x4.trans on the simulator: lane (g, t) gets elements (2t, g) and
    # (2t + 1, g) of each of the 4 matrices whose rows lanes 8j .. 8j+7 address
    lane = cuda.threadIdx.x % WARP
    g, t = lane // 4, lane % 4
    out = []
    words = gather(word)
    for j in range(4):
        a0 = int(words.get(8 * j + 2 * t, word))
        a1 = int(words.get(8 * j + 2 * t + 1, word))
        w0 = int(tile[a0 + g // 2])
        w1 = int(tile[a1 + g // 2])
        shift = 16 * (g % 2)
        out.append(np.uint32(((w0 >> shift) & 0xFFFF) | (((w1 >> shift) & 0xFFFF) << 16)))
    return out[0], out[1], out[2], out[3]


@functools.lru_cache(maxsize=None)
def smem_ops():
    """Shared-memory operations on 32-bit shared-space byte addresses:
    ``(shared_base, ld_x4, ld_x4_trans, copy, commit, wait_one, wait_all)``.

    ``shared_base(smem)``: the address of shared array ``smem``'s first byte;
    ``ld_x4(smem, addr)`` / ``ld_x4_trans(smem, addr)``: ``ldmatrix`` x4 (plain
    / transposed) of the four 8 x 8 matrices whose rows lanes ``8 j .. 8 j + 7``
    address (``ldmatrix_x4`` and the other forms above take a word index into a tile
    and compute 64-bit generic addresses; these take the shared address, so a
    fragment's address is one 32-bit add); ``copy(smem, addr, src, flat)``:
    ``cp.async.cg`` of the 16 bytes at uint32 word ``flat`` of global ``src``
    to ``addr``; ``commit()`` closes the thread's group of copies;
    ``wait_one()`` / ``wait_all()`` return once at most one / no group is in
    flight. ``smem`` is the array an address points into (the simulator
    indexes it; on a GPU it only types the call). On the simulator the base
    is 0, the loads are ``mma16``'s emulation (and the x4 form of its
    x2.trans), the copies happen at once."""
    if SIMULATOR:
        def shared_base(smem):
            return 0

        def ld_x4(smem, addr):
            return _ld4(smem, addr // 4)

        def ld_x4_trans(smem, addr):
            return x4t(smem, addr // 4)

        def copy(smem, addr, src, flat):
            for x in range(4):
                smem[addr // 4 + x] = src[flat + x]

        def nothing():
            return None

        x4t = device_fn(_sim_x4_trans)
        return (device_fn(shared_base), device_fn(ld_x4), device_fn(ld_x4_trans),
                device_fn(copy), device_fn(nothing), device_fn(nothing), device_fn(nothing))

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i8p = ir.IntType(8).as_pointer()
    i32, i64 = ir.IntType(32), ir.IntType(64)

    def u32(builder, value):
        return builder.trunc(value, i32) if value.type.width > 32 else value

    @intrinsic
    def shared_base(typingctx, smem):
        sig = types.uint32(smem)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            fnty = ir.FunctionType(i32, [i8p])
            text = "{ .reg .u64 sa64; cvta.to.shared.u64 sa64, $1; cvt.u32.u64 $0, sa64; }"
            return builder.call(ir.InlineAsm(fnty, text, "=r,l"),
                                [builder.bitcast(ary.data, i8p)])

        return sig, codegen

    def make_ld(trans):
        op = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16"

        @intrinsic
        def ld(typingctx, smem, addr):
            sig = types.UniTuple(types.uint32, 4)(smem, addr)

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                asm = ir.InlineAsm(fnty, f"{op} {{$0, $1, $2, $3}}, [$4];",
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                r = builder.call(asm, [u32(builder, args[1])])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(r, i) for i in range(4)])

            return sig, codegen

        return ld

    @intrinsic
    def copy(typingctx, smem, addr, src, flat):
        sig = types.void(smem, addr, src, flat)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[2])(context, builder, args[2])
            idx = args[3] if args[3].type.width == 64 else builder.sext(args[3], i64)
            gp = builder.gep(builder.bitcast(ary.data, i8p),
                             [builder.mul(idx, ir.Constant(i64, 4))])
            fnty = ir.FunctionType(ir.VoidType(), [i32, i8p])
            asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16;",
                               "r,l,~{memory}", side_effect=True)
            builder.call(asm, [u32(builder, args[1]), gp])
            return context.get_dummy_value()

        return sig, codegen

    return (shared_base, make_ld(False), make_ld(True), copy,
            ptx_statement("cp.async.commit_group;"), ptx_statement("cp.async.wait_group 1;"),
            ptx_statement("cp.async.wait_group 0;"))


# ---------------------------------------------------------------------------
# a one-warp tile GEMM (tests, and the shape of the kernels built on it)
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tile_gemm_kernel(kind, b_kmajor=False):
    """One warp: ``c[16, 8] = a[16, K] @ b + c`` for 16-bit ``a`` (row major) and
    ``b`` given as ``[8, K]`` (``B^T``, n rows of k) or, ``b_kmajor``, ``[K, 8]``;
    fp32 ``c``. Operands are staged into swizzled shared tiles (``Tile``), read
    with ``ldmatrix`` and multiplied 16 k at a time. K 16, 32 or 64 (a tile's
    columns are a power of two: the swizzle permutes chunks within a row).
    Arguments: a_words [16 * K / 2] uint32, b_words [8 * K / 2] uint32 (the
    operands' packed row-major words), c [16, 8] float32 (read and written)."""
    mma, _ = ops(kind)
    KMAX = 64
    N_A, N_B = 16 * KMAX // 2, 8 * KMAX // 2  # tile words (shapes must be constants)

    def kernel(a_words, b_words, c, k_ext):
        lane = cuda.threadIdx.x
        ta = cuda.shared.array(N_A, uint32)
        tb = cuda.shared.array(N_B, uint32)
        cols = k_ext
        # stage: row-major words into the swizzled tiles
        for w in range(lane, 16 * cols // 2, WARP):
            r, c2 = w // (cols // 2), (w % (cols // 2)) * 2
            tile_store(ta, cols, r, c2, a_words[w])
        if b_kmajor:
            for w in range(lane, cols * 8 // 2, WARP):
                r, c2 = w // 4, (w % 4) * 2
                tile_store(tb, 8, r, c2, b_words[w])
        else:
            for w in range(lane, 8 * cols // 2, WARP):
                r, c2 = w // (cols // 2), (w % (cols // 2)) * 2
                tile_store(tb, cols, r, c2, b_words[w])
        cuda.syncwarp()
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
        for k0 in range(0, cols, 16):
            a0, a1, a2, a3 = ldmatrix_x4(ta, cols, 0, k0, lane)
            if b_kmajor:
                b0, b1 = ldmatrix_x2_trans(tb, 8, k0, 0, lane)
            else:
                b0, b1 = ldmatrix_x2(tb, cols, 0, k0, lane)
            d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3)
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = d0, d1, d2, d3

    kernel.__name__ = f"mma16_tile_gemm_{kind}" + ("_kmajor" if b_kmajor else "")
    return cuda.jit(kernel)


def pack_rows(x, kind):
    """Host: a 16-bit matrix (numpy float16 / bfloat16, or float32 rounded to
    ``kind``) as its row-major uint32 words (two elements a word, the lower
    column in the low half)."""
    x = np.ascontiguousarray(np.asarray(x).astype(_np16(kind)))
    return x.view(np.uint16).reshape(x.shape[0], -1).view(np.uint32).reshape(-1).copy()
