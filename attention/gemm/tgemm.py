"""Batched GEMM on tensor cores with fp32 inputs split in two tf32 halves (the
MLA attention GEMMs' fast path).

``c[z] = alpha * a[z] @ op(b[zb[z]])`` for ``z < Z``, the contract of
``attention.gemm.sgemm.launch`` (per-batch ``n_ext`` / ``k_ext``, a batch table
``zb``, entries ``n >= n_ext[z]`` of ``c`` not written) for ``a_order
"zmk"`` (a[z, m, k]), ``b_order`` "znk" (b[zb, n, k]) or "zkn" (b[zb, k, n]),
``c_order`` "zmn" or "mzn"; ``b`` float32 or float16. ``usable`` says whether
a call qualifies (layouts, 16-byte aligned rows); ``sgemm`` serves the others.
``a_order`` "mzk" (a[m, z, k], the MLA weight GEMMs' queries: rows ``nh K``
apart) is the same kernel with other strides; those GEMMs have 64 rows at B 64,
so they take a plan of one warp row (``WEIGHT_PLANS``, ``weight_plan``).

Arithmetic. Tensor cores multiply tf32 (10-bit mantissa) operands exactly and
add in fp32. Each fp32 operand is split as ``x = hi + lo``, ``hi = tf32(x)``,
``lo = tf32(x - hi)`` (``split``: round to nearest on the bit pattern), and a
product is taken as ``al bh + ah bl + ah bh`` (three ``mma.m16n8k8``, the
small terms first; ``al bl``, below 2^-22 of the product, is dropped). An
fp16 operand is exact in tf32 (``bl = 0``), so an fp16 ``b`` takes two. The
sum is two-level as in ``sgemm``: each warp's tiles collect ``PART_STEPS``
k8 steps (16 k, half a slice) in a fresh partial that is then added to the
register totals, inside the k8 loop (a ``PART_STEPS`` of whole slices adds it
at slice ends instead). The short partial matters more here than in
``sgemm``: the mma's own fp32 sum truncates, so every mma adds an error of up
to one unit in the last place of the partial it adds to, always towards zero
(``bench.tgemm_emu`` models it). In the MLA growth run at 128 heads (1024
steps) 64-k partials failed the sweep's rule at 61 steps (error up to 6.8x the
numpy float32 baseline's), 32-k ones at 2 (median 1.24x); 16-k ones pass
(worst err/bound 0.72, median 0.86x) for 5 % more time than 32-k ones at the
benchmark's shape with an fp32 cache, 8 % with fp16 (notes/bench.md runs 19-20).
Against a float64 oracle on random operands the error is about 1.3 to 1.6x
numpy float32's at K 576 / 4096 (``sgemm``: 0.54x), 2 to 3.6x at K below 100
(run 17, 64-k partials).
Non-finite inputs: an inf operand splits into ``inf + NaN``, so its products
are NaN where fp32 FMAs give inf (the MLA GEMMs never read a row past a
sequence's length, where hostile caches hold NaN).

Plan (GPU): block tile 128 x 128, 8 warps as 2 x 4, each warp 64 x 32 (4 x 4
tiles of 16 x 8). ``K`` is stepped in slices of ``BK = 32`` staged by
``cp.async`` (16-byte copies, zero fill past an operand's edge) through a
ring of ``STAGES = 4`` slices: slice ``s + 3`` is in flight while ``s`` is
multiplied, one barrier a slice. Slices keep the operands' own layouts, rows
padded so a warp's fragment loads hit 32 distinct banks:

    a  [BM][BK + 4] words            a0 = A[m0 + g][k0 + t]: bank 4 g + t
    b znk [BN][BK + 4] words, or [BN][BK + 8] halves (fp16)
    b zkn [BK][BN + 8] words, or [BK][BN + 16] halves: b0 bank 8 t + g

(lane = 4 g + t). The tiles' three mmas are issued term by term over all 16
tiles, so 16 independent mmas separate two dependent ones.

The simulator runs the same kernel with one warp of one 16 x 8 tile and 8-k
slices; there ``mma`` is a warp collective built from shuffles (each lane
gathers its rows of ``a`` and columns of ``b``) whose sum truncates as the
hardware's does (``round_rz``), ``cp_async16`` a copy.
``launch(..., plan=GPU_PLAN)`` runs the GPU's plan there too (one block of 256
threads takes 40 to 60 s a 32-k slice).

Planted switches (falsification suite and precision tests only; compile-time,
``tgemm_kernel(..., defect=name)``, the kernel's name suffixed with it; without
one the kernel is the production one, PTX unchanged):

    tf32_single      one mma a product, ``ah bh`` (the hi halves only): a plain
                     tf32 GEMM, about 2^-11 relative error a product
    no_partials      no short partials: every mma adds into one long sum over
                     the whole K (the truncating fp32 adds grow with K)
    ring_stale       the last K slice (when not the first) multiplied from the
                     ring entry of the slice before it (stale data)
    k_slice_dropped  the last K slice not multiplied (gross)

The first three are ``PRECISION_MUTANTS`` (a precision loss that a wrong
kernel could show), the last is in ``GROSS_DEFECTS``.

Paged ``b`` (``tgemm_kernel(..., page_size=P)``, ``launch(..., page_size=P)``;
the MLA latent cache of ``mla.paged``): ``b`` is ``[num_pages, P, row]`` and
``zb`` the page table ``[Z, max_pages]``; the copies of a slice look each of
b's rows up (one look-up when the slice's rows lie in one page). Only the
addresses change: the same copies, mmas and sums, so the results are those of
a contiguous ``b`` holding the same rows, bit for bit. ``page_size=0`` (the
default) builds the kernel above with its PTX unchanged. Its planted switch
``page_off_by_one`` (``PAGED_DEFECTS``, paged kernels only): rows read from
page ``(entry + 1) % num_pages``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types, uint32, uint64

from attention.gemm import sgemm
from attention.core.device import SIMULATOR, device_fn, ensure_dynamic_shared, jit, ptx_statement
from attention.core.simwarp import gather

B_DTYPES = ("float32", "float16")
WARP = 32
PART_STEPS = 2  # k8 steps (16 k) whose products go into one partial

# (warps_m, warps_n, tiles_m, tiles_n, bk, stages)
GPU_PLAN = (2, 4, 4, 4, 32, 4)
PLAN = (1, 1, 1, 1, 8, 2) if SIMULATOR else GPU_PLAN
# the MLA weight GEMMs (M = the queries, 64 at B 64): 64-row tiles, 4 warps along
# N, each 64 x 32 or 64 x 16 (``weight_plan``); the simulator's one plan
WEIGHT_PLANS = (PLAN,) if SIMULATOR else ((1, 4, 4, 4, 32, 4), (1, 4, 4, 2, 32, 4))
A_ORDERS = ("zmk", "mzk")

PRECISION_MUTANTS = ("tf32_single", "no_partials", "ring_stale")
GROSS_DEFECTS = ("k_slice_dropped",)
DEFECTS = PRECISION_MUTANTS + GROSS_DEFECTS
# planted in the paged row addressing only (``page_size`` > 0); not in DEFECTS
PAGED_DEFECTS = ("page_off_by_one",)


# ---------------------------------------------------------------------------
# intrinsics (GPU: inline PTX; simulator: Python stand-ins)
# ---------------------------------------------------------------------------

def _gpu_intrinsics():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    i8p = ir.IntType(8).as_pointer()

    def rnd(builder, v):
        # v rounded to tf32 on its bit pattern: add half an ulp, clear 13 bits
        bits = builder.add(builder.bitcast(v, i32), ir.Constant(i32, 0x1000))
        return builder.bitcast(builder.and_(bits, ir.Constant(i32, 0xFFFFE000 - (1 << 32))), f32)

    @intrinsic
    def split(typingctx, x):
        """(hi, lo) tf32 halves of float32 ``x``: ``hi`` = x rounded to 10
        mantissa bits (add half an ulp to the bit pattern, clear 13 bits: to
        nearest, ties away; finite x), ``lo`` = (x - hi) rounded the same way."""
        sig = types.UniTuple(types.float32, 2)(types.float32)

        def codegen(context, builder, sig, args):
            hi = rnd(builder, args[0])
            lo = rnd(builder, builder.fsub(args[0], hi))
            return context.make_tuple(builder, sig.return_type, [hi, lo])

        return sig, codegen

    @intrinsic
    def split3(typingctx, x):
        """(hi, mid, lo) with ``x == hi + mid + lo`` exactly for finite x: ``hi``,
        ``mid`` as ``split``'s halves, ``lo = (x - hi) - mid`` (both subtractions
        exact, no fast-math flags; at most 3 significant bits, so a tf32 value)."""
        sig = types.UniTuple(types.float32, 3)(types.float32)

        def codegen(context, builder, sig, args):
            hi = rnd(builder, args[0])
            rest = builder.fsub(args[0], hi)
            mid = rnd(builder, rest)
            lo = builder.fsub(rest, mid)
            return context.make_tuple(builder, sig.return_type, [hi, mid, lo])

        return sig, codegen

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.m16n8k8`` (tf32 in, fp32 accumulate): this lane's four
        words of ``d = a b + c`` (PTX fragment layouts; a, b hold tf32 values)."""
        sig = types.UniTuple(types.float32, 4)(*([types.float32] * 10))

        def codegen(context, builder, sig, args):
            ins = [builder.bitcast(v, i32) for v in args[:6]] + list(args[6:])
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            text = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                    "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
            r = builder.call(ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"), ins)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(r, i) for i in range(4)])

        return sig, codegen

    def pointer(context, builder, aty, aval, idx, itemsize):
        ary = context.make_array(aty)(context, builder, aval)
        idx = builder.zext(idx, i64) if idx.type.width < 64 else idx
        return builder.gep(builder.bitcast(ary.data, i8p),
                           [builder.mul(idx, ir.Constant(i64, itemsize))])

    @intrinsic
    def cp_async16(typingctx, sm, word, arr, flat, nbytes):
        """Start copying 16 bytes at element ``flat`` of global ``arr`` to word
        ``word`` of shared ``sm`` (``cp.async.cg``): the first ``nbytes`` read,
        the rest zero. Both addresses 16-byte aligned."""
        sig = types.void(sm, word, arr, flat, nbytes)

        def codegen(context, builder, sig, args):
            sp = pointer(context, builder, sig.args[0], args[0], args[1], 4)
            itemsize = 2 if sig.args[2].dtype == types.float16 else 4
            gp = pointer(context, builder, sig.args[2], args[2], args[3], itemsize)
            nb = args[4]
            nb = builder.trunc(nb, i32) if nb.type.width > 32 else nb
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p, i32])
            text = ("{ .reg .u64 sa64; .reg .u32 sa32; cvta.to.shared.u64 sa64, $0; "
                    "cvt.u32.u64 sa32, sa64; cp.async.cg.shared.global [sa32], [$1], 16, $2; }")
            builder.call(ir.InlineAsm(fnty, text, "l,l,r,~{memory}", side_effect=True),
                         [sp, gp, nb])
            return context.get_dummy_value()

        return sig, codegen

    return split, split3, mma, cp_async16


def round_rz(x):
    """A float ``x`` to float32, truncated towards zero (the simulator's model of
    the mma's own fp32 sum; ``validation.baselines`` ``tcP`` sums the same)."""
    f = np.float32(x)
    if abs(float(f)) > abs(x):
        f = np.nextafter(f, np.float32(0.0))
    return f


def _sim_intrinsics():
    def rnd(v):
        bits = (int(np.float32(v).view(np.uint32)) + 0x1000) & 0xFFFFE000
        return np.uint32(bits).view(np.float32)

    def split(x):
        hi = rnd(x)
        return hi, rnd(np.float32(np.float32(x) - hi))

    def split3(x):
        hi = rnd(x)
        rest = np.float32(np.float32(x) - hi)
        mid = rnd(rest)
        return hi, mid, np.float32(rest - mid)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # lane 4 g + t holds a[g][t], a[g+8][t], a[g][t+4], a[g+8][t+4], b[t][g],
        # b[t+4][g]; its outputs are d[g][2t], d[g][2t+1], d[g+8][2t], d[g+8][2t+1]
        lane = cuda.threadIdx.x % WARP
        g, t = lane // 4, lane % 4
        own = (a0, a1, a2, a3, b0, b1)
        regs = gather(own)  # every lane's fragment registers, one rendezvous
        rows = [[0.0] * 8, [0.0] * 8]  # a rows g, g + 8
        cols = [[0.0] * 8, [0.0] * 8]  # b columns 2t, 2t + 1
        for tp in range(4):
            src = regs.get(4 * g + tp, own)
            rows[0][tp], rows[1][tp], rows[0][tp + 4], rows[1][tp + 4] = src[:4]
            for h in range(2):
                src = regs.get(4 * (2 * t + h) + tp, own)
                cols[h][tp], cols[h][tp + 4] = src[4], src[5]
        out = []
        for r, c in ((0, 0), (0, 1), (1, 0), (1, 1)):
            acc = (c0, c1, c2, c3)[2 * r + c]
            exact = float(acc) + sum(float(rows[r][k]) * float(cols[c][k]) for k in range(8))
            out.append(round_rz(exact))  # the tensor core's fp32 sum truncates
        return tuple(out)

    def cp_async16(sm, word, arr, flat, nbytes):
        itemsize = arr.dtype.itemsize
        dst = sm.view(arr.dtype)
        at, valid = int(word) * 4 // itemsize, int(nbytes) // itemsize
        for i in range(16 // itemsize):
            dst[at + i] = arr[int(flat) + i] if i < valid else 0

    return split, split3, mma, cp_async16


def _nothing():
    return None


if SIMULATOR:  # copies complete at once: nothing to commit or wait for
    split, split3, mma, cp_async16 = (device_fn(f) for f in _sim_intrinsics())
    commit = device_fn(_nothing)
else:
    split, split3, mma, cp_async16 = _gpu_intrinsics()
    commit = ptx_statement("cp.async.commit_group;")


@functools.lru_cache(maxsize=None)
def _wait(stages):
    """``cp.async.wait_group stages - 2``: this thread's copies of all but the
    newest ``stages - 2`` slices have landed (nothing on the simulator)."""
    return commit if SIMULATOR else ptx_statement(f"cp.async.wait_group {stages - 2};")


@functools.lru_cache(maxsize=None)
def tile_mma_kernel():
    """One warp, one ``mma.m16n8k8``: ``d[16, 8] = a[16, 8] @ b[8, 8] + c`` with
    ``a`` and ``b`` float32 arrays holding tf32 values (the mma reads a
    register's top 19 bits; give it values whose low 13 bits are zero), ``c``
    float32, written in place (the accumulation probe,
    ``validation.mma_accum_probe``)."""
    def kernel(a, b, c):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = mma(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g],
                             b[t + 4, g], c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t],
                             c[g + 8, 2 * t + 1])
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = d0, d1, d2, d3

    kernel.__name__ = "tgemm_tile_mma"
    return cuda.jit(kernel)


# ---------------------------------------------------------------------------
# plan and shared-memory layout
# ---------------------------------------------------------------------------

def tile_shape(plan=PLAN):
    """(rows, columns) of ``c`` one block computes."""
    warps_m, warps_n, tiles_m, tiles_n = plan[:4]
    return 16 * tiles_m * warps_m, 8 * tiles_n * warps_n


def layout(b_order, b16, plan=PLAN):
    """(a pitch in words, b pitch in elements, a words, b words) of one slice."""
    bm, bn = tile_shape(plan)
    bk = plan[4]
    ap = bk + 4
    if b_order == "znk":
        bp = bk + (8 if b16 else 4)
        b_elems = bn * bp
    else:
        bp = bn + (16 if b16 else 8)
        b_elems = bk * bp
    return ap, bp, bm * ap, b_elems // 2 if b16 else b_elems


def shared_bytes(b_order, b16, plan=PLAN):
    """Dynamic shared memory of a block: ``stages`` slices of both operands."""
    _, _, a_words, b_words = layout(b_order, b16, plan)
    return 4 * plan[5] * (a_words + b_words)


# ---------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tgemm_kernel(b_order, b16, plan=PLAN, defect=None, page_size=0, page_defect=None):
    """Build the GEMM for ``b``'s layout and element type (``b16``: float16).

    Arguments and strides as ``sgemm.sgemm_kernel`` (a, b, c flat; zb, n_ext,
    k_ext int32 [Z]; alpha; m_len; (a_z, a_m), (b_z, b_r), (c_z, c_m)). Grid
    ``(ceil(max N / BN), ceil(M / BM), Z)``, block ``32 warps_m warps_n``
    threads, ``shared_bytes`` of dynamic shared memory. ``defect``: one of
    ``DEFECTS`` compiled in (module docstring), or None.

    ``page_size`` P > 0 (compile-time; 0, the default, builds the kernel
    above unchanged): ``b`` is a paged cache ``[num_pages, P, row]`` (flat,
    ``b_z = P b_r`` the page stride) and ``zb`` the page table ``[Z,
    max_pages]`` int32: b's row ``t`` (the n index for "znk", the k index for
    "zkn") of batch z is row ``t % P`` of page ``zb[z, t // P]``. A staged
    tile of rows inside one page takes one table look-up; one across pages
    looks each row up. Only entries of rows below ``n_ext[z]`` ("znk") /
    ``k_ext[z]`` ("zkn") are read. ``page_defect`` "page_off_by_one"
    (``PAGED_DEFECTS``; paged only): every row read from page ``(entry + 1) %
    num_pages``.
    """
    if b_order not in sgemm.B_ORDERS:
        raise ValueError(f"b_order: expected one of {sgemm.B_ORDERS}, got {b_order!r}")
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if int(page_size) < 0:
        raise ValueError(f"page_size: expected 0 (contiguous) or a page size >= 1, got "
                         f"{page_size}")
    if page_defect is not None and (page_defect not in PAGED_DEFECTS or not page_size):
        raise ValueError(f"page_defect: expected one of {PAGED_DEFECTS} (paged kernels) or "
                         f"None, got {page_defect!r}")
    PAGED = int(page_size) > 0
    P = max(int(page_size), 1)
    PAGE_SHIFT = page_defect == "page_off_by_one"
    TF32_SINGLE = defect == "tf32_single"
    NO_PARTIALS = defect == "no_partials"
    RING_STALE = defect == "ring_stale"
    K_SLICE_DROPPED = defect == "k_slice_dropped"
    WARPS_M, WARPS_N, MT, NT, BK, STAGES = plan
    THREADS = WARP * WARPS_M * WARPS_N
    BM, BN = tile_shape(plan)
    WM, WN = 16 * MT, 8 * NT
    KS = BK // 8  # k8 steps a slice
    if BK % 8 or (PART_STEPS % KS and KS % PART_STEPS) or STAGES < 2:
        raise ValueError(f"tgemm plan {plan}: BK a multiple of 8 that divides or is a "
                         f"multiple of {8 * PART_STEPS} (the partial), two stages or more")
    # a partial of whole slices is added at a slice's end; a shorter one inside
    # the k8 loop, every PART_STEPS steps (FADDs on the hot loop: notes/bench.md run 19)
    IN_SLICE = PART_STEPS < KS
    PART_SLICES = max(PART_STEPS // KS, 1)
    # no_partials: one partial over the whole K, added to the totals at the end
    FLUSH_IN_SLICE = IN_SLICE and not NO_PARTIALS
    FLUSH_AT_SLICE_END = not IN_SLICE and not NO_PARTIALS
    B_ZNK = b_order == "znk"
    SPLIT_B = not b16
    AP, BP, A_WORDS, B_WORDS = layout(b_order, b16, plan)
    STAGE = A_WORDS + B_WORDS
    BE = 8 if b16 else 4  # b elements in a 16-byte copy
    B_HALF = 2 if b16 else 1  # b elements a shared word
    A_CPR = BK // 4  # copies a staged row of a
    B_CPR = BK // BE if B_ZNK else BN // BE  # ... of b
    A_CH, B_CH = BM * A_CPR, (BN if B_ZNK else BK) * B_CPR
    if THREADS % A_CPR or THREADS % B_CPR:
        raise ValueError(f"tgemm plan {plan}: a staged row must split evenly over threads")
    A_PER, B_PER = -(-A_CH // THREADS), -(-B_CH // THREADS)
    A_ROWS, B_ROWS = THREADS // A_CPR, THREADS // B_CPR  # rows apart of one thread's copies
    wait = _wait(STAGES)
    # paged b: the rows of b one staged tile holds (BN for "znk", BK for "zkn")
    # lie in one page whenever the page size is a multiple of their count
    B_TILE_ROWS = BN if B_ZNK else BK
    TILE_IN_PAGE = P % B_TILE_ROWS == 0

    @device_fn
    def row_at(b, bz, t, b_z, b_r):
        """Paged only: flat offset (int64) of row ``t`` of the batch whose
        page-table row is ``bz``: row ``t % P`` of page ``bz[t // P]``."""
        page = bz[t // P]
        if PAGE_SHIFT:  # the neighbouring page, kept in bounds
            page = (page + 1) % (b.shape[0] // b_z)
        return page * b_z + (t % P) * b_r

    @device_fn
    def issue_b_paged(sm, b, bz, dst, first, r, col, tid, b_z, b_r):
        """Paged only: the copies of the b part of a slice whose rows all
        exist: rows ``first + r + e B_ROWS``, from element ``col`` of each.
        One table look-up when the tile's rows lie in one page."""
        one_page = TILE_IN_PAGE or first // P == (first + B_TILE_ROWS - 1) // P
        at = uint64(0)
        if one_page:
            at = uint64(row_at(b, bz, first, b_z, b_r) + r * b_r + col)
        for e in range(B_PER):
            if B_CH % THREADS == 0 or tid + THREADS * e < B_CH:
                if one_page:
                    src = at + uint64(e * B_ROWS) * uint64(b_r)
                else:
                    src = uint64(row_at(b, bz, first + r + e * B_ROWS, b_z, b_r) + col)
                cp_async16(sm, dst + uint32(e * B_ROWS * BP // B_HALF), b, src, 16)

    @device_fn
    def issue(sm, a, b, z, bz, s, row0, col0, tid, m_len, n_len, k_len, a_z, a_m, b_z, b_r,
              inner):
        """Start the copies of slice ``s`` into ring entry ``s % STAGES``.
        ``inner``: the block's rows and columns are all in range (then a slice
        inside ``k_len`` is copied whole, from one base and one stride)."""
        base = (s % STAGES) * STAGE
        k0 = s * BK
        if inner and k0 + BK <= k_len:
            r = tid // A_CPR
            kc = (tid % A_CPR) * 4
            src = uint64(z * a_z + (row0 + r) * a_m + k0 + kc)
            dst = uint32(base + r * AP + kc)
            for e in range(A_PER):
                if A_CH % THREADS == 0 or tid + THREADS * e < A_CH:
                    cp_async16(sm, dst + uint32(e * A_ROWS * AP), a,
                               src + uint64(e * A_ROWS) * uint64(a_m), 16)
            r = tid // B_CPR
            c = (tid % B_CPR) * BE
            if PAGED:
                dst = uint32(base + A_WORDS + (r * BP + c) // B_HALF)
                if B_ZNK:
                    issue_b_paged(sm, b, bz, dst, col0, r, k0 + c, tid, b_z, b_r)
                else:
                    issue_b_paged(sm, b, bz, dst, k0, r, col0 + c, tid, b_z, b_r)
                return
            if B_ZNK:
                src = uint64(bz * b_z + (col0 + r) * b_r + k0 + c)
            else:
                src = uint64(bz * b_z + (k0 + r) * b_r + col0 + c)
            dst = uint32(base + A_WORDS + (r * BP + c) // B_HALF)
            for e in range(B_PER):
                if B_CH % THREADS == 0 or tid + THREADS * e < B_CH:
                    cp_async16(sm, dst + uint32(e * B_ROWS * BP // B_HALF), b,
                               src + uint64(e * B_ROWS) * uint64(b_r), 16)
            return
        for e in range(A_PER):
            ch = tid + THREADS * e
            if ch < A_CH:
                r = ch // A_CPR
                kc = (ch % A_CPR) * 4
                valid = min(max(k_len - k0 - kc, 0), 4) if row0 + r < m_len else 0
                src = z * a_z + (row0 + r) * a_m + k0 + kc if valid > 0 else 0
                cp_async16(sm, uint32(base + r * AP + kc), a, uint64(src), 4 * valid)
        for e in range(B_PER):
            ch = tid + THREADS * e
            if ch < B_CH:
                r = ch // B_CPR
                c = (ch % B_CPR) * BE
                if PAGED:  # each row looked up (only rows that exist)
                    if B_ZNK:
                        valid = min(max(k_len - k0 - c, 0), BE) if col0 + r < n_len else 0
                        src = row_at(b, bz, col0 + r, b_z, b_r) + k0 + c if valid > 0 else 0
                    else:
                        valid = min(max(n_len - col0 - c, 0), BE) if k0 + r < k_len else 0
                        src = row_at(b, bz, k0 + r, b_z, b_r) + col0 + c if valid > 0 else 0
                elif B_ZNK:  # row r: column col0 + r, k from k0 + c
                    valid = min(max(k_len - k0 - c, 0), BE) if col0 + r < n_len else 0
                    src = bz * b_z + (col0 + r) * b_r + k0 + c if valid > 0 else 0
                else:  # row r: k0 + r, columns from col0 + c
                    valid = min(max(n_len - col0 - c, 0), BE) if k0 + r < k_len else 0
                    src = bz * b_z + (k0 + r) * b_r + col0 + c if valid > 0 else 0
                cp_async16(sm, uint32(base + A_WORDS + (r * BP + c) // B_HALF), b,
                           uint64(src), (4 // B_HALF) * valid)

    @device_fn
    def flush(acc, part):
        """acc += part (fp32, rounded to nearest), part = 0, for every tile."""
        for i in range(MT):
            for j in range(NT):
                for r in range(4):
                    acc[i, j, r] += part[i, j, r]
                    part[i, j, r] = float32(0.0)

    @device_fn
    def tiles_mma(xa, xb, part):
        """part[i, j] += xa[i] xb[j] for every tile of the warp (one mma each; the
        MT x NT mmas are independent of each other)."""
        for i in range(MT):
            for j in range(NT):
                d = mma(xa[i, 0], xa[i, 1], xa[i, 2], xa[i, 3], xb[j, 0], xb[j, 1],
                        part[i, j, 0], part[i, j, 1], part[i, j, 2], part[i, j, 3])
                part[i, j, 0], part[i, j, 1] = d[0], d[1]
                part[i, j, 2], part[i, j, 3] = d[2], d[3]

    def kernel(a, b, c, zb, n_ext, k_ext, alpha, m_len, a_z, a_m, b_z, b_r, c_z, c_m):
        z = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid // WARP
        g = (tid % WARP) // 4
        t = tid % 4
        wm0 = (warp // WARPS_N) * WM
        wn0 = (warp % WARPS_N) * WN
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        n_len = n_ext[z]
        k_len = k_ext[z]
        if col0 >= n_len:
            return  # the whole block is past this batch's N (uniform exit)
        bz = zb[z]  # paged: batch z's row of the page table
        sm = cuda.shared.array(0, float32)
        smh = cuda.shared.array(0, types.float16)  # the same bytes, as halves
        acc = cuda.local.array((MT, NT, 4), float32)
        part = cuda.local.array((MT, NT, 4), float32)
        ah = cuda.local.array((MT, 4), float32)
        al = cuda.local.array((MT, 4), float32)
        bh = cuda.local.array((NT, 2), float32)
        bl = cuda.local.array((NT, 2), float32)
        for i in range(MT):
            for j in range(NT):
                for r in range(4):
                    acc[i, j, r] = float32(0.0)
                    part[i, j, r] = float32(0.0)
        n_slices = (k_len + BK - 1) // BK
        inner = row0 + BM <= m_len and col0 + BN <= n_len
        for s in range(STAGES - 1):  # the ring's first slices
            if s < n_slices:
                issue(sm, a, b, z, bz, s, row0, col0, tid, m_len, n_len, k_len, a_z, a_m,
                      b_z, b_r, inner)
            commit()  # one group a slice, empty or not: wait counts groups
        for s in range(n_slices):
            wait()  # this thread's copies of slice s have landed ...
            cuda.syncthreads()  # ... and everyone's; slice s - 1 is fully read
            if s + STAGES - 1 < n_slices:  # into the entry slice s - 1 held
                issue(sm, a, b, z, bz, s + STAGES - 1, row0, col0, tid, m_len, n_len,
                      k_len, a_z, a_m, b_z, b_r, inner)
            commit()
            base = (s % STAGES) * STAGE
            if RING_STALE and s > 0 and s + 1 == n_slices:
                base = ((s - 1) % STAGES) * STAGE  # the entry of the slice before
            steps = KS
            if K_SLICE_DROPPED and s + 1 == n_slices:
                steps = 0  # the last slice is not multiplied
            for kk in range(steps):
                # b0 = B[k = 8 kk + t][n = wn0 + 8 j + g], b1: k + 4
                for j in range(NT):
                    for r in range(2):
                        k = kk * 8 + t + 4 * r
                        n = wn0 + 8 * j + g
                        e = n * BP + k if B_ZNK else k * BP + n
                        if SPLIT_B:
                            hl = split(sm[uint64(base + A_WORDS + e)])
                            bh[j, r] = hl[0]
                            bl[j, r] = hl[1]
                        else:
                            bh[j, r] = float32(smh[uint64(2 * (base + A_WORDS) + e)])
                # a0 = A[m = wm0 + 16 i + g][k = 8 kk + t]; a1: m + 8; a2: k + 4
                for i in range(MT):
                    for r in range(4):
                        m = wm0 + 16 * i + g + 8 * (r % 2)
                        k = kk * 8 + t + 4 * (r // 2)
                        hl = split(sm[uint64(base + m * AP + k)])
                        ah[i, r] = hl[0]
                        al[i, r] = hl[1]
                # term by term over all tiles, small terms first
                if not TF32_SINGLE:
                    tiles_mma(al, bh, part)
                if SPLIT_B and not TF32_SINGLE:
                    tiles_mma(ah, bl, part)
                tiles_mma(ah, bh, part)
                if FLUSH_IN_SLICE and kk % PART_STEPS == PART_STEPS - 1:
                    flush(acc, part)
            # the partial into the totals after its last slice; a fresh one next
            if FLUSH_AT_SLICE_END and (s % PART_SLICES == PART_SLICES - 1
                                       or s + 1 == n_slices):
                flush(acc, part)
            if NO_PARTIALS and s + 1 == n_slices:
                flush(acc, part)
        # -- epilogue: d[g][2t], d[g][2t+1], d[g+8][2t], d[g+8][2t+1] of each tile --
        for i in range(MT):
            for r in range(4):
                row = row0 + wm0 + 16 * i + g + 8 * (r // 2)
                if row < m_len:
                    for j in range(NT):
                        col = col0 + wn0 + 8 * j + 2 * t + r % 2
                        if col < n_len:
                            c[uint64(z * c_z + row * c_m + col)] = alpha * acc[i, j, r]

    kernel.__name__ = kernel.__qualname__ = (f"tgemm_{b_order}_{'f16' if b16 else 'f32'}"
                                             + (f"_{defect}" if defect else "")
                                             + (f"_paged{P}" if PAGED else "")
                                             + (f"_{page_defect}" if page_defect else ""))
    # fastmath off: it would let the compiler re-associate the two-level sum
    return jit(kernel, fastmath=False)


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------

def weight_plan(n_len, n_batch, sms):
    """The ``WEIGHT_PLANS`` entry for a weight GEMM of N ``n_len`` over
    ``n_batch`` batches (one row of tiles) on a GPU of ``sms`` SMs: the widest
    tile whose grid gives every SM two blocks, else the narrowest."""
    for plan in WEIGHT_PLANS:
        if -(-int(n_len) // tile_shape(plan)[1]) * int(n_batch) >= 2 * int(sms):
            return plan
    return WEIGHT_PLANS[-1]


def weight_blocks(m_len, n_len, n_batch, plan):
    """Blocks of the grid of a GEMM of ``m_len`` x ``n_len`` over ``n_batch``."""
    bm, bn = tile_shape(plan)
    return -(-int(m_len) // bm) * -(-int(n_len) // bn) * int(n_batch)


def _m_len(a, a_order):
    return int(a.shape[1] if a_order == "zmk" else a.shape[0])


def _aligned(x):
    """Device array ``x`` starts on a 16-byte boundary (always, on the simulator)."""
    if SIMULATOR:
        return True
    return x.__cuda_array_interface__["data"][0] % 16 == 0


def usable(a, b, *, a_order, b_order, plan=PLAN):
    """True when this GEMM takes the call (else use ``sgemm``): ``a`` in
    "zmk" or "mzk" order, ``b`` float32 / float16 in "znk" or "zkn" order, rows
    and batches of both 16-byte aligned (every copy is 16 bytes), and ``M``
    more than half ``plan``'s block tile (fewer rows leave most of a tile's
    work unused)."""
    name = np.dtype(b.dtype).name
    if a_order not in A_ORDERS or b_order not in sgemm.B_ORDERS or name not in B_DTYPES:
        return False
    if np.dtype(a.dtype) != np.float32 or a.ndim != 3 or b.ndim != 3:
        return False
    per_copy = 8 if name == "float16" else 4
    a_z, a_m = sgemm._strides(a, a_order)
    b_z, b_r = sgemm._strides(b, b_order)
    return (_m_len(a, a_order) > tile_shape(plan)[0] // 2 and a_z % 4 == 0 and a_m % 4 == 0
            and b_z % per_copy == 0 and b_r % per_copy == 0 and _aligned(a) and _aligned(b))


def launch(a, b, c, zb, n_ext, k_ext, alpha, *, a_order, b_order, c_order, max_n, n_batch,
           stream, ready=None, plan=PLAN, defect=None, page_size=0, page_defect=None):
    """Enqueue the GEMM (arguments as ``sgemm.launch``; no validation). The
    call must be ``usable`` (for ``plan``): ``ValueError`` otherwise, before
    any launch. ``defect``: a planted switch (``DEFECTS``) or None.

    ``page_size`` > 0: ``b`` is a paged cache ``[num_pages, page_size, row]``
    and ``zb`` the page table ``[n_batch, max_pages]`` int32 (C-contiguous):
    batch z's rows of b are looked up through ``zb[z]`` (``tgemm_kernel``).
    ``page_defect``: ``PAGED_DEFECTS`` or None."""
    if c_order not in sgemm.C_ORDERS or not usable(a, b, a_order=a_order, b_order=b_order,
                                                   plan=plan):
        raise ValueError(f"tgemm: layouts a {a_order!r} b {b_order!r} c {c_order!r}, b "
                         f"{np.dtype(b.dtype).name}, a {tuple(a.shape)}: not usable "
                         "(see tgemm.usable)")
    m_len = _m_len(a, a_order)
    if n_batch == 0 or m_len == 0 or max_n <= 0:
        return
    bm, bn = tile_shape(plan)
    grid = ((max_n + bn - 1) // bn, (m_len + bm - 1) // bm, n_batch)
    a_z, a_m = sgemm._strides(a, a_order)
    b_z, b_r = sgemm._strides(b, b_order)
    c_z, c_m = sgemm._strides(c, c_order)
    b16 = np.dtype(b.dtype) == np.float16
    if page_size:
        kernel = tgemm_kernel(b_order, b16, plan, defect, int(page_size), page_defect)
    else:
        kernel = tgemm_kernel(b_order, b16, plan, defect)
    args = (sgemm._flat(a), sgemm._flat(b), sgemm._flat(c), zb, n_ext, k_ext, float32(alpha),
            m_len, a_z, a_m, b_z, b_r, c_z, c_m)
    dynamic = shared_bytes(b_order, b16, plan)
    ensure_dynamic_shared(kernel, args, dynamic, 0, np.dtype(b.dtype).str, ready)
    kernel[grid, (WARP * plan[0] * plan[1],), stream, dynamic](*args)
