"""Tensor-core decode attention for 16-bit caches (fp16 / bf16, q in the cache's dtype).

The flash-attention-2 / FlashInfer decode shape on ``mma.m16n8k16``
(``attention.gemm.mma16``):

* **One block per (split, kv head, sequence).** Its query rows are the GQA
  group's ``G = H / H_kv`` heads times the ``T`` queries of a multi-token
  decode, ``R = G * T <= 16`` rows, row ``r`` = query ``r // G`` of head
  ``kv_head * G + r % G``, padded with zero rows to one m16 tile (padded rows
  are computed and never written). K and V rows are read once a kv head for
  all ``T`` queries: T_q = 4 costs the same memory traffic and the same mma
  count as T_q = 1 whenever ``G * 4 <= 16``.
* **Q in registers.** The block stages Q ``[16, D]`` in a swizzled shared tile
  (``mma16``'s ``Tile`` layout); each warp keeps its A fragments (``ldmatrix``
  x4, ``D / 16`` k steps) in registers.
* **K / V tiles through a ring.** Warp ``w`` takes the tiles ``w, w + NW, ...``
  of 16 positions of the block's chunk. Each tile's K and V rows ``[16, D]``
  arrive in a swizzled shared stage of the warp's ring of ``stages`` stages
  (``cp.async`` 16-byte copies, ``stages - 1`` tiles in flight while one is
  computed; on the simulator plain copies; ``STAGES`` by default, fp8 rings as
  deep as the residency allows, ``default_stages``). A paged cache's rows are found
  through the page table row by row, or once a tile where P is a multiple of
  16 (a tile's 16 positions start at a multiple of 16, so they share a page).
  Rows past the block's last position, and rows whose page entry is out of
  range, are zero-filled: V of a masked position is 0, never NaN times 0. A
  pooled tile wholly below the end is 16 consecutive rows: its copies take one
  base address and 32-bit shared addresses, with no per-row test. A warp's
  first ``stages - 1`` tiles are issued before Q is staged (the rings lie past
  the Q tile), so DRAM works while the block stages Q; a checked paged plan
  issues them after its range check.
* **S = Q K^T** on the mma (K rows ``[pos, D]`` are ``B^T``: one ``ldmatrix``
  x4 gives the B fragments of both 8-position halves), fp32 accumulation,
  times ``scale``.
* **Masking.** Row ``r`` (query ``i = r // G``) sees positions below
  ``min(chunk end, len - T + 1 + i)`` (causal among the new tokens; the length
  counts them).
* **Online softmax in fp32 on the accumulator fragments.** A lane holds 4
  scores of rows ``g = lane // 4`` and ``g + 8``; a row's max is taken over its
  lane quad (``attention.core.warp.group_max``, two ``shfl.xor``); each lane
  keeps its part of the row sums and the quad adds them at the end
  (``attention.core.warp.group_sum``).
  ``P = exp(S - m)`` is rounded to the 16-bit type (``mma16`` ``pack``, to
  nearest even) and the score fragments are the A fragments of ``O += P V``
  (V B fragments from ``ldmatrix`` x4.trans, two 8-column n tiles a load);
  ``l`` sums the fp32 ``P``. ``O`` is rescaled by ``exp(m - m_new)`` only in
  a lane whose rows' max moved (``O * 1`` is ``O``: the same bits, and most
  tiles of a long row skip the multiplies); the mask is applied only to a tile
  that holds a row's limit.
* **Index arithmetic.** The thread and block indices are taken as unsigned,
  so every index derived from them is known non-negative: no wraparound test
  on an array index and no sign fix-up on a division or remainder by a power
  of two (in signed 64-bit form these were most of the instructions an empty
  block ran: 3,100 a warp, about 7 us a launch on an H100). The Q staging and
  the end's merge run a fixed number of rounds over the block.
* **Addresses.** ``ldmatrix`` takes 32-bit shared-space addresses
  (``mma16.smem_ops``): a lane's row address in a stage is one per-lane
  offset computed once, and every load of a tile is that offset XOR a
  constant (load ``i`` reads chunks ``2i, 2i + 1``, and the swizzle key
  depends on the row alone), plus the stage's base.
* **Warps merged through shared memory** at the end: each warp's state
  ``(m, l, O)`` of its 16 rows, one batch a row (the batch's max, one weight a
  warp: ``attention.core.warp.batch_reference``).
* **Split-KV.** With ``n_split > 1`` every block writes its unnormalised
  partial (acc, m, l) in ``attention.decode.fast``'s layout and that module's
  combine kernel merges them (``fast.combine_kernel``, the ``T * H`` rows of a
  sequence as its heads); one split writes ``out`` / ``lse`` directly. Where the
  GPU has it (sm_90 and later, ``attention.core.pdl``) the combine is a
  programmatic dependent of the main kernel: every block releases it as it
  starts, so its launch and ramp overlap the main kernel (``plan(pdl=...)``).

Numerics: q and K are 16-bit, so every product of S is exact in fp32 and S
accumulates in fp32 on the mma; the softmax is fp32 (``exp`` with fast math:
``ex2.approx``); P is rounded to the cache's 16-bit type before P.V, which
accumulates in fp32; ``l`` is the sum of the unrounded P. The output is
``O / l`` (a correctly rounded reciprocal, ``softmax_finish``).

Layouts (C-contiguous; device arrays, or numpy arrays staged by ``mma_decode``):
    q           [M, T, H, D]  (or [M, H, D]: T = 1) float16 / bfloat16, the cache's dtype
    k_cache     pooled [KV_SLOTS, H_kv, max_seq, D] with slot_table [M] int32;
                paged "HND" [num_pages, H_kv, P, D] or "NHD" [num_pages, P, H_kv, D]
                with page_table [M, max_pages] int32 (position p of sequence m is
                row p % P of page page_table[m, p // P]; pages may be shared and
                in any order; P >= 1)
    v_cache     the same shape and dtype as k_cache
    seq_lens    [M] int32: 0, or T .. capacity (query i attends 0 .. len - T + i)
    out         [M, T, H, D] float32 (zeros where a row attends nothing)
    lse         [M, T, H] float32 (natural log; -inf where a row attends nothing)
    part_acc    [M, T * H, n_split, D] float32, part_ml [M, T * H, n_split, 2]
                (split-KV scratch, ``fast.scratch``: row i * H + h)

fp8 e4m3 caches (kind ``FP8_KIND``, ``mma_decode(..., k_scale=, v_scale=)``:
uint8 codes, per-tensor scales, q float16; sm_89 and later on a GPU): a ring
stage holds a tile's codes as they are (``cp.async``, a quarter of the bytes),
a row of D codes swizzled as a 16-bit tile row of D / 2 columns (the same
swizzle, the same planted switches), and the codes are converted in registers
as ``ldmatrix`` delivers them (``cvt.rn.f16x2.e4m3x2``: exact, every e4m3 value
is an f16 value), with no f16 copy of the tile:

* K: ``ldmatrix`` x4 gives lane ``(g, t)`` codes ``16 kd + 4t .. + 3`` of
  position ``g`` (and ``g + 8``), two k steps a load. They are the B
  fragment of a k step whose k index ``2t + e`` is column ``16 kd + 4t + e``
  and ``2t + 8 + e`` column ``16 kd + 4t + 2 + e``; Q's A fragments are read
  from the Q tile in the same order. A k step sums its 16 products in one go
  (``mma16.k_step_sum``, the rule fitted to the H200), so the order inside a
  step does not change S.
* V: ``ldmatrix`` x4.trans of 32 codes a row (two chunks of 16) gives lane
  ``(g, t)``, for each chunk, the code pairs of columns ``2g`` and ``2g + 1``
  at positions ``2t, 2t + 1`` (and ``+ 8``); a byte permute (``prmt``) splits
  them into the fragment of the even columns
  and that of the odd ones, two mmas whose n index ``n`` is column ``16 j + 2n``
  and ``16 j + 2n + 1``. Only where O's columns land changes (the warps' merge
  stores them in place).

S is multiplied by ``k_scale`` after ``scale`` (two roundings, the
fast kernel's order) and the output by ``v_scale`` (before ``1 / l``; a split's
partial before the combine). With both scales 1 the result is the 16-bit
kernel's over an f16 cache holding the codes' values, bit for bit
(``tests/test_decode_mma_fp8.py``). ``DecodePlan`` takes it for an fp8 cache
with q float16 under ``method="auto"`` or ``"mma"`` (on the H200 it is 1.37x the
CUDA-core kernel's speed at B 32 / L 4096, notes/bench.md; the validation's
``decode_fp8`` entries pin ``method="fast"``); registry entry ``decode_mma_fp8``.

Per-(token, kv head) scales (``scales="token_head"``; ``mma_decode`` takes them
when ``k_scale`` / ``v_scale`` are arrays in the cache's layout without D,
``DecodePlan(fp8_scales="token_head", method="mma")``): a ring stage also holds
the tile's 16 K and 16 V scales (lane ``l`` copies row ``l % 16``'s K or V
scale with a 4-byte ``cp.async``; 0 for a row past the end or behind a bad page
entry, so a NaN scale of an unused row is never read). A score is multiplied by
its position's K scale after ``scale``. The V scales cannot leave P.V (they
vary along its k), so they go into P, and a row normaliser keeps P in f16's
range: with ``u`` a row's running max of ``P vs`` (rescaled by the softmax's
``alpha`` as ``O`` is), each tile takes ``u' = max(u alpha, max_tile P vs)``,
rounds ``P' = P vs / u'`` (in [0, 1]) to f16 for the mma, rescales ``o`` by
``alpha u / u'`` and keeps ``O = u' o``; ``o`` is multiplied by ``u`` before
the warps' merge. The rescale is exactly 1 where ``u' = u alpha`` (every tile
while the normaliser stands), else ``(u alpha) (1 / u')``: formed as ``u (1 /
u')``, or as a fast-math ``u / u'``, it is an ulp or two off 1 for some ``u``
and o drifts by that on every later tile (validation.findings). Without the
normaliser (planted ``fp8_p_unnormalized``) V scales near 1e-6 put ``P vs``
among f16's subnormals and the rule fails. ``l`` sums the unscaled fp32 ``P``.
Registry entry ``decode_mma_fp8_tok``.

Head dims 32, 64 and 128 (a row is a power of two of 16-byte chunks, as the
tile swizzle wants). The kernel sees the arrays as uint32 words (two 16-bit
elements a word): q ``[M, T, H, D / 2]``, caches flat ``[N * D / 2]``.

Planted defects (``defect=``, compile-time switches for the tests; without one
the kernel is unchanged, its name has no suffix):
    "ldmatrix_no_trans"   V's B fragments loaded by ``ldmatrix`` without
                          ``.trans`` (the same row addresses)
    "swizzle_off_by_one"  K tiles stored with the swizzle of the next row
                          (``ldmatrix`` reads them with the right one)
    "causal_tile_edge"    a row whose causal limit ``len - T + 1 + i`` falls on
                          a tile edge (a multiple of 16) sees one more position
``FP8_TOKEN_DEFECTS`` (token_head scales only):
    "fp8_scale_wrong_head"  a row's K and V scales read from kv head
                          ``(h + 1) % H_kv``
    "fp8_scale_wrong_token" a row's K and V scales read from the next position
                          of its page (slot), ``(off + 1) % P``
    "fp8_p_unnormalized"  ``P vs`` rounded to f16 as it is (no row normaliser)
``PRECISION_MUTANTS`` (the registry runs them beside the clean kernel, to show
what the judge resolves; ``mutant_applies`` says which entry takes which):
    "p_bf16"              P rounded to bfloat16 (8 significant bits) before the
                          pack to the mma's 16-bit type, where the kernel and its
                          baseline round to f16 (11 bits): about 8x the weights'
                          rounding error, every other step unchanged. Inert on a
                          bf16 cache (P is packed to bf16 there anyway)
    "fp8_p_unnormalized"  (above; token_head scales only)

Device guard (the launcher checks on the host first): a length outside
``[0, capacity]`` or in ``1 .. T - 1``, or a pooled slot outside the pool, makes
its sequence empty; a page entry outside ``[0, num_pages)`` reads as zero rows.
Nothing is read out of bounds.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int64, uint32

from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    SIMULATOR,
    device_fn,
    ensure_dynamic_shared,
    finish,
    host_ints,
    is_host_array,
    jit,
    launch_stream,
    output_array,
    page_split,
    ptx_statement,
    to_device,
    to_host,
)
from attention.core.pdl import capable as pdl_capable
from attention.core.pdl import grid_dependency_ops, is_graph_builder, launch_dependent
from attention.core.rounding import round_bf16
from attention.core.warp import (
    batch_reference,
    fragment_softmax_step,
    group_max,
    group_sum,
    softmax_finish,
)
from attention.decode import fast
from attention.gemm import mma16

WARP = 32
TILE_ROWS = 16  # query rows of a block: one m16 tile
KT = 16  # positions of a warp's tile (the k of P.V)
HEAD_DIMS = (32, 64, 128)
WARPS = 4
STAGES = 3  # ring stages a warp (stages - 1 tiles in flight): 16-bit caches
# fp8: the deepest ring, up to this, that the blocks an SM holds by registers still
# fit in its shared memory (``default_stages``: 6 at D 128, 100 KB a block; the H200
# took 78.4 us at B 32 / L 4096 with 4 warps x 6 stages, 85-86 us with 3 or 4 stages
# and 8 warps, all one split, notes/bench.md)
FP8_STAGES = 6
SMEM_PER_SM = 227 * 1024  # H100 / H200: a block's shared memory at most, and an SM's
RESIDENT_MAX = 4  # blocks an SM, at most, for the split heuristic
REGS_PER_SM = 65536  # H100 / H200: 32-bit registers an SM
# registers a thread, at most, by head dim (ptxas sm_90 over the 16-bit, fp8 and
# token_head kernels, pooled and paged, rounded up: 96-111 at D 32, 119-156 at
# D 64, 165-210 at D 128): how many blocks an SM holds by registers
REGISTERS = {32: 128, 64: 160, 128: 216}
CACHE_DTYPES = tuple(d for d in (np.dtype(np.float16), BFLOAT16) if d is not None)
# fp8 per-(token, kv head) scales only: the scales of another kv head or of the next
# position of the page (the fast kernel's switches of the same names), and the V
# scales folded into P without the row normaliser (module docstring)
FP8_TOKEN_DEFECTS = ("fp8_scale_wrong_head", "fp8_scale_wrong_token", "fp8_p_unnormalized")
DEFECTS = ("ldmatrix_no_trans", "swizzle_off_by_one", "causal_tile_edge")
# the registry's precision mutants (its resolving-power rows; ``mutant_applies``)
PRECISION_MUTANTS = ("p_bf16", "fp8_p_unnormalized")
# every switch the kernel takes
ALL_DEFECTS = tuple(dict.fromkeys(DEFECTS + FP8_TOKEN_DEFECTS + PRECISION_MUTANTS))
KINDS = ("f16", "bf16")  # the 16-bit cache kinds (``fast.dtype_kind``'s names)
FP8_KIND = "f8"  # fp8 e4m3 codes (uint8), q float16
FP8_SCALES = ("tensor", "token_head")  # a K and a V scale, or one a cached row (token, kv head)
LAYOUTS = ("HND", "NHD")
FP8_DTYPE = np.dtype(np.uint8)  # fp8 e4m3 caches: the codes


def mutant_applies(defect, scales):
    """Whether precision mutant ``defect`` is a switch of the kernel with this
    scale mode (``registry.MUTANT_SOURCES``: "tensor" for the 16-bit and the
    per-tensor fp8 entries, "token_head"): ``fp8_p_unnormalized`` needs
    token_head scales, ``p_bf16`` takes both."""
    return defect in PRECISION_MUTANTS and (defect != "fp8_p_unnormalized"
                                            or scales == "token_head")


def dtype_kind(dt):
    """"f16" / "bf16" for a 16-bit cache dtype."""
    return mma16.kind_of(dt, "k_cache")


def check_defect(defect):
    if defect is not None and defect not in ALL_DEFECTS:
        raise ValueError(f"defect: expected None or one of {ALL_DEFECTS}, got {defect!r}")


# ---------------------------------------------------------------------------
# device pieces
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _async_copy(size):
    """``copy(smem, word, src, i)``: start copying ``size`` bytes (16: words
    ``i .. i + 3`` of a uint32 array, ``cp.async.cg``, past L1; 4: element ``i``
    of a 4-byte array, ``cp.async.ca``) from global array ``src`` to word
    ``word`` (and on) of shared array ``smem`` (same element size), in the
    current group. The simulator copies at once."""
    if SIMULATOR:
        def copy(smem, word, src, i):
            for x in range(size // 4):
                smem[word + x] = src[i + x]

        return device_fn(copy)

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i8p = ir.IntType(8).as_pointer()
    i64 = ir.IntType(64)
    level = "cg" if size == 16 else "ca"  # .cg takes 16 bytes only

    def pointer(context, builder, aty, aval, idx):
        ary = context.make_array(aty)(context, builder, aval)
        if idx.type.width < 64:
            idx = builder.sext(idx, i64)
        return builder.gep(builder.bitcast(ary.data, i8p), [builder.mul(idx, ir.Constant(i64, 4))])

    @intrinsic
    def copy(typingctx, smem, word, src, i):
        sig = types.void(smem, word, src, i)

        def codegen(context, builder, sig, args):
            sp = pointer(context, builder, sig.args[0], args[0], args[1])
            gp = pointer(context, builder, sig.args[2], args[2], args[3])
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p])
            text = ("{ .reg .u64 sa64; .reg .u32 sa32; cvta.to.shared.u64 sa64, $0; "
                    f"cvt.u32.u64 sa32, sa64; cp.async.{level}.shared.global [sa32], [$1], "
                    f"{size}; }}")
            builder.call(ir.InlineAsm(fnty, text, "l,l,~{memory}", side_effect=True), [sp, gp])
            return context.get_dummy_value()

        return sig, codegen

    return copy


@functools.lru_cache(maxsize=None)
def _copy_ops(stages):
    """``(copy, commit, wait)`` for a warp's ring: ``copy(smem, word, src, flat)``
    starts copying the 16 bytes (4 uint32 words) at word ``flat`` of global
    array ``src`` to words ``word .. word + 3`` of shared array ``smem``
    (``cp.async.cg``, past L1); ``commit()`` closes a group of copies; ``wait()``
    returns once at most ``stages - 1`` groups are in flight. The simulator
    copies at once."""
    if SIMULATOR:
        def nothing():
            return None

        return _async_copy(16), device_fn(nothing), device_fn(nothing)
    return (_async_copy(16), ptx_statement("cp.async.commit_group;"),
            ptx_statement(f"cp.async.wait_group {stages - 1};"))


@functools.lru_cache(maxsize=None)
def _codes_f16x2(fmt="e4m3"):
    """Device ``codes_f16x2(word) -> (lo, hi)``: the four fp8 e4m3 codes of a
    uint32 word (low byte first) as two f16x2 words, codes 0-1 in ``lo`` and 2-3
    in ``hi``, each code's value in the half of its position (exact: every e4m3
    value is an f16 value). GPU: ``cvt.rn.f16x2.e4m3x2`` (sm_89 and later) on
    each 16-bit half; simulator: a table of the codes' f16 bits. ``fmt`` "e5m2":
    the codes decoded as e5m2 (a planted defect of ``mla.mma``)."""
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"fmt: expected 'e4m3' or 'e5m2', got {fmt!r}")
    if SIMULATOR:
        from attention.cache.fp8 import E4M3_VALUES

        if fmt == "e5m2":  # e5m2 is float16's upper byte
            bits = np.arange(256, dtype=np.uint32) << 8
        else:
            bits = E4M3_VALUES.astype(np.float16).view(np.uint16).astype(np.uint32)

        def codes_f16x2(word):
            w = int(word)
            lo = int(bits[w & 255]) | (int(bits[(w >> 8) & 255]) << 16)
            hi = int(bits[(w >> 16) & 255]) | (int(bits[(w >> 24) & 255]) << 16)
            return uint32(lo), uint32(hi)

        return device_fn(codes_f16x2)

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def codes_f16x2(typingctx, word):
        sig = types.UniTuple(types.uint32, 2)(types.uint32)

        def codegen(context, builder, sig, args):
            i16, i32 = ir.IntType(16), ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i16]), f"cvt.rn.f16x2.{fmt}x2 $0, $1;",
                               "=r,h")
            lo = builder.call(asm, [builder.trunc(args[0], i16)])
            hi = builder.call(asm, [builder.trunc(builder.lshr(args[0], ir.Constant(i32, 16)),
                                                  i16)])
            return context.make_tuple(builder, sig.return_type, [lo, hi])

        return sig, codegen

    return codes_f16x2


@functools.lru_cache(maxsize=None)
def _v_codes_f16x2(fmt="e4m3"):
    """Device ``v_codes_f16x2(word) -> (even, odd)``: an ``ldmatrix .trans``
    word of a V code tile (bytes: position p columns c, c + 1, then position
    p + 1 columns c, c + 1) as the f16x2 pairs (p, p + 1) of column c and of
    column c + 1 (bytes 0, 2 and 1, 3; ``codes_f16x2`` of ``fmt``)."""
    codes_f16x2 = _codes_f16x2(fmt)
    swap = _swap_middle_bytes()

    def v_codes_f16x2(word):
        return codes_f16x2(swap(word))

    return device_fn(v_codes_f16x2)


@functools.lru_cache(maxsize=None)
def _swap_middle_bytes():
    """Device ``swap(word) -> word``: bytes (0, 1, 2, 3) as (0, 2, 1, 3)
    (``prmt.b32`` selector 0x3120 on a GPU)."""
    if SIMULATOR:
        def swap(word):
            w = uint32(word)
            return ((w & uint32(0xFF0000FF)) | ((w & uint32(0x00FF0000)) >> uint32(8))
                    | ((w & uint32(0x0000FF00)) << uint32(8)))

        return device_fn(swap)

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def swap(typingctx, word):
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "prmt.b32 $0, $1, 0, 0x3120;",
                               "=r,r")
            return builder.call(asm, [args[0]])

        return sig, codegen

    return swap


def smem_words(head_dim, warps, stages, fp8=False, token_head=False):
    """uint32 words of a block's dynamic shared memory: the Q tile and the
    warps' rings, or (reusing them at the end) the warps' states. fp8: a ring
    stage holds the tile's codes (a quarter word an element); ``token_head``
    scales: a stage also holds the tile's 16 K and 16 V scales."""
    tile = KT * head_dim // 2
    if fp8:
        ring = stages * (2 * (KT * head_dim // 4) + (2 * KT if token_head else 0))
    else:
        ring = stages * 2 * tile
    main = TILE_ROWS * head_dim // 2 + warps * ring
    merge = warps * (TILE_ROWS * head_dim + 2 * TILE_ROWS + TILE_ROWS) + TILE_ROWS
    return max(main, merge)


@functools.lru_cache(maxsize=None)
def mma_decode_kernel(kind, head_dim, group, t_q=1, warps=WARPS, stages=STAGES, paging=None,
                      defect=None, checked=False, scales="tensor", pdl=False):
    """The tensor-core decode kernel (module docstring).

    kind: "f16" / "bf16", or ``FP8_KIND`` (e4m3 codes, q f16: two more
    arguments at the end, ``k_sc`` and ``v_sc``: float32 [1] with ``scales``
    "tensor", or with "token_head" the flat scales [N], one a cached row, in
    the cache's layout without D); head_dim: D (32, 64, 128); group: G = H / H_kv;
    t_q: T (G * T <= 16); warps: NW; stages: ring stages a warp (>= 1);
    paging: None (pooled cache, slot table as ``[M, 1]``), "HND" or "NHD";
    defect: None or one of ``DEFECTS``; checked: the plan's range check in the
    kernel (``attention.decode.plan.DecodePlan``): two more arguments, ``limit``
    int32 (the longest length the plan serves) and ``err`` [fast.ERR_WORDS]
    int32 (``fast``'s flag format). A length outside ``[0, limit]`` or in ``1 ..
    T - 1``, a pooled slot outside the pool or, paged, any page entry below
    the length outside ``[0, num_pages)`` (every block reads the sequence's
    entries, combined over the block by the barrier after Q) makes the whole
    sequence empty in every block (zeros, LSE -inf), and block (0, 0) of the
    sequence counts it once: ``err[ERR_COUNT] += 1``, ``err[ERR_FIRST] =
    min(.., m)``, ``ERR_SLOTS`` (slot or page entry) or ``ERR_LENGTHS`` += 1.
    Without ``checked`` the kernel is the one below, unchanged. ``pdl``: every
    block releases the split-KV combine launched after it as it starts
    (``attention.core.pdl``; sm_90 and later; the name ends in ``_pdl``).

    Grid ``(n_split, H_kv, M)``, block ``32 * NW``, dynamic shared memory
    ``4 * smem_words(D, NW, stages)`` bytes. Arguments:
        q         [M, T, H, D / 2] uint32 (16-bit pairs)
        k, v      [N * D / 2] uint32, the cache's words, flat
        seq_lens  [M] int32
        table     [M, max_pages] int32 (pooled: [M, 1], the slots)
        n_kv      int32 H_kv; page: int32 P (pooled: max_seq); n_pages: int32
                  num_pages (pooled: KV_SLOTS); shift: int32 log2(P) or -1
        scale     float32; chunk: int32 positions a split (a multiple of 16)
        out       [M, T, H, D] f32, lse [M, T, H] f32 (one split)
        part_acc  [M, T * H, n_split, D] f32, part_ml [M, T * H, n_split, 2] f32
                  (more splits)
    """
    D = int(head_dim)
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {head_dim}")
    GROUP, TQ, NW, S = int(group), int(t_q), int(warps), int(stages)
    ROWS = GROUP * TQ
    if not 1 <= ROWS <= TILE_ROWS:
        raise ValueError(f"group * t_q: expected 1..{TILE_ROWS} rows, got {ROWS}")
    if NW < 1 or S < 1:
        raise ValueError(f"warps, stages: expected >= 1, got {warps}, {stages}")
    if paging not in (None,) + LAYOUTS:
        raise ValueError(f"paging: expected None, 'HND' or 'NHD', got {paging!r}")
    check_defect(defect)
    CHECKED = bool(checked)
    EARLY = not (CHECKED and paging is not None)  # the ring's first tiles before Q
    FP8 = kind == FP8_KIND
    if kind not in KINDS and not FP8:
        raise ValueError(f"kind: expected one of {KINDS + (FP8_KIND,)}, got {kind!r}")
    if scales not in FP8_SCALES:
        raise ValueError(f"scales: expected one of {FP8_SCALES}, got {scales!r}")
    TOK = FP8 and scales == "token_head"  # a K and a V scale a cached row
    if defect in FP8_TOKEN_DEFECTS and not TOK:
        raise ValueError(f"defect: {defect!r} needs an fp8 kernel with token_head scales")
    WRONG_HEAD = defect == "fp8_scale_wrong_head"
    WRONG_TOKEN = defect == "fp8_scale_wrong_token"
    UNNORMALIZED = defect == "fp8_p_unnormalized"
    P_BF16 = defect == "p_bf16"
    PAGED = paging is not None
    NHD = paging == "NHD"
    NO_TRANS = defect == "ldmatrix_no_trans"
    SWIZZLE_OFF = defect == "swizzle_off_by_one"
    CAUSAL_EDGE = defect == "causal_tile_edge"

    WR = D // 2  # words a row of a 16-bit tile
    CW = D // 4 if FP8 else WR  # words a cache row (fp8: four codes a word)
    # a staged K / V tile is an mma16 Tile of TC 16-bit columns (fp8: a code row of
    # D bytes is D / 2 16-bit columns, swizzled and read by ldmatrix as such)
    TC = D // 2 if FP8 else D
    TWC = KT * CW  # words a staged tile
    # the swizzle with bit operations (``mma16.swizzle``): chunk c of row r is stored
    # at chunk c ^ ((r >> LOG_PER) & KEY_MASK)
    CHUNKS = TC // 8
    LOG_PER = (max(1, 8 // CHUNKS)).bit_length() - 1
    KEY_MASK = CHUNKS - 1
    CPR = CW // 4  # 16-byte chunks a cache row
    KS = D // 16  # k steps of S = Q K^T
    NT = D // 8  # n tiles of O = P V
    COPIES = KT * CPR // WARP  # chunks of a tile a lane copies (K and V each)
    RING0 = TILE_ROWS * WR  # the rings start after the Q tile (words)
    # a stage: the K tile, then the V tile (fp8: their codes); token_head: then the
    # tile's 16 K scales and its 16 V scales (float32, 0 where no row is read)
    SC0 = 2 * TWC  # the scales' first word in a stage
    STAGE = SC0 + (2 * KT if TOK else 0)
    RING = S * STAGE  # words of a warp's ring
    N_QA, N_O = 4 * KS, 4 * NT
    Q_ROUNDS = -(-TILE_ROWS * WR // (NW * WARP))  # the block's rounds over the Q tile
    MERGE_ROUNDS = -(-ROWS * D // (NW * WARP))  # ... and over the merged rows
    # the warps' states at the end (float32 words from 0, over the Q tile and rings)
    M_ML = NW * TILE_ROWS * D  # (m, l) a row a warp
    M_WT = M_ML + NW * 2 * TILE_ROWS  # the merge's weight of a warp a row
    M_INV = M_WT + NW * TILE_ROWS  # 1 / l a row (one split)

    release_dependents, _ = grid_dependency_ops(bool(pdl))
    mma, pack = mma16.ops("f16" if FP8 else kind)
    copy, commit, wait = _copy_ops(S)
    shared_base, ld_x4, ld_x4_trans, copy_at = mma16.smem_ops()[:4]
    copy4 = _async_copy(4)  # token_head: a scale (cp.async.ca, 4 bytes)
    codes_f16x2 = _codes_f16x2() if FP8 else None
    v_codes_f16x2 = _v_codes_f16x2() if FP8 else None

    def k_slot(row, col):
        # word of (row, col) in a staged K tile (the planted switch: the next row's
        # swizzle)
        if SWIZZLE_OFF:
            return mma16.tile_index(row + 1, col, TC) - CW
        return mma16.tile_index(row, col, TC)

    k_slot = device_fn(k_slot)

    def v_fragments(smem, addr):
        # a staged V tile's two 8-column slices (16-bit columns; k = the tile's 16
        # positions) by ``ldmatrix`` x4.trans at the lane's row address: the B
        # fragments of both slices (fp8: the code pairs of 32 columns,
        # ``v_codes_f16x2``). The planted switch: the plain instruction, same addresses
        if NO_TRANS:
            return ld_x4(smem, addr)
        return ld_x4_trans(smem, addr)

    v_fragments = device_fn(v_fragments)

    def s_step(qa, kd, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3):
        # k step kd of S = Q K^T for both 8-position halves: (c..) += Q B(b0, b1),
        # (d..) += Q B(b2, b3)
        c0, c1, c2, c3 = mma(qa[4 * kd], qa[4 * kd + 1], qa[4 * kd + 2], qa[4 * kd + 3],
                             b0, b1, c0, c1, c2, c3)
        d0, d1, d2, d3 = mma(qa[4 * kd], qa[4 * kd + 1], qa[4 * kd + 2], qa[4 * kd + 3],
                             b2, b3, d0, d1, d2, d3)
        return c0, c1, c2, c3, d0, d1, d2, d3

    s_step = device_fn(s_step)

    def pv_two(o, n, p0, p1, p2, p3, b0, b1, b2, b3):
        # O += P V for two n tiles: o[n .. n + 3] by B(b0, b1), o[n + 4 ..] by B(b2, b3)
        o[n], o[n + 1], o[n + 2], o[n + 3] = mma(p0, p1, p2, p3, b0, b1,
                                                 o[n], o[n + 1], o[n + 2], o[n + 3])
        o[n + 4], o[n + 5], o[n + 6], o[n + 7] = mma(p0, p1, p2, p3, b2, b3, o[n + 4],
                                                     o[n + 5], o[n + 6], o[n + 7])

    pv_two = device_fn(pv_two)

    def row_word(kc, table, seq, pos, kv_head, n_kv, page, shift, n_pages, row0):
        # first word of position pos's row in the flat cache; -1: a bad page entry
        if PAGED:
            j, off = page_split(pos, page, shift)
            pg = int64(table[seq, j])
            if pg < 0 or pg >= n_pages:
                return int64(-1)
            if NHD:
                return ((pg * page + off) * n_kv + kv_head) * CW
            return ((pg * n_kv + kv_head) * page + off) * CW
        return row0 + int64(pos) * CW

    row_word = device_fn(row_word)

    def scale_index(table, seq, slot, pos, kv_head, n_kv, page, shift, n_pages):
        # token_head: position pos's scale in the flat scales (the cache's layout
        # without D; pooled [slot, kv head, pos]); -1: a bad page entry. The
        # planted switches: kv head (h + 1) % H_kv's, the next position of the page
        g = kv_head
        if WRONG_HEAD:
            g = (kv_head + 1) % n_kv
        if PAGED:
            j, off = page_split(pos, page, shift)
            pg = int64(table[seq, j])
            if pg < 0 or pg >= n_pages:
                return int64(-1)
        else:
            pg = int64(slot)
            off = pos
        if WRONG_TOKEN:
            off = (off + 1) % page  # pooled: page is max_seq
        if NHD:
            return (pg * page + off) * n_kv + g
        return (pg * n_kv + g) * page + off

    scale_index = device_fn(scale_index)

    def issue(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page, shift,
              n_pages, row0, tile0, end, kb, lane, whole):
        # start copying the K and V rows of positions tile0 .. tile0+15 into the
        # stage at word kb (rows at or past end: zeros); token_head: lane l the K
        # (l < 16) or V scale of row l % 16 (0 past end or for a bad page entry).
        # ``whole``: a paged cache whose pages hold whole tiles (P a multiple of
        # 16): one page entry a tile
        if not PAGED and tile0 + KT <= end:
            # a pooled tile of rows all below the end: its rows are consecutive,
            # chunk ci of the tile at word 4 ci past its first row's
            # (32-bit shared addresses: ``mma16.smem_ops``)
            src = row0 + int64(tile0) * CW
            at = shared_base(smem) + 4 * kb
            for a in range(COPIES):
                ci = lane + WARP * a
                row = ci // CPR
                c = ci % CPR
                copy_at(smem, at + 4 * k_slot(row, 8 * c), kc, src + 4 * ci)
                copy_at(smem, at + 4 * (TWC + mma16.tile_index(row, 8 * c, TC)), vc,
                        src + 4 * ci)
        else:
            first = int64(-1)
            if whole and tile0 < end:
                first = row_word(kc, table, seq, tile0, kv_head, n_kv, page, shift, n_pages,
                                 row0)
            step = CW * n_kv if NHD else CW  # words between a page's consecutive rows
            for a in range(COPIES):
                ci = lane + WARP * a
                row = ci // CPR
                c = ci % CPR
                pos = tile0 + row
                dk = kb + k_slot(row, 8 * c)  # chunk c of the row (fp8: 16 codes)
                dv = kb + TWC + mma16.tile_index(row, 8 * c, TC)
                src = int64(-1)
                if pos < end:
                    if not whole:
                        src = row_word(kc, table, seq, pos, kv_head, n_kv, page, shift,
                                       n_pages, row0)
                    elif first >= 0:
                        src = first + row * step
                if src >= 0:
                    copy(smem, dk, kc, src + 4 * c)
                    copy(smem, dv, vc, src + 4 * c)
                else:
                    for x in range(4):
                        smem[dk + x] = uint32(0)
                        smem[dv + x] = uint32(0)
        if TOK:
            pos = tile0 + lane % KT
            at = int64(-1)
            if pos < end:
                at = scale_index(table, seq, slot, pos, kv_head, n_kv, page, shift, n_pages)
            if at < 0:
                smf[kb + SC0 + lane] = float32(0.0)
            elif lane < KT:
                copy4(smf, kb + SC0 + lane, ksc, at)
            else:
                copy4(smf, kb + SC0 + lane, vsc, at)

    issue = device_fn(issue)

    def first_tiles(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page,
                    shift, n_pages, row0, start, end, ring, warp, lane, whole, n_mine):
        # the warp's first S - 1 tiles into its ring's stages 0 .. S - 2, a copy
        # group each (empty past its n_mine tiles)
        for a in range(S - 1):
            if a < n_mine:
                issue(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page,
                      shift, n_pages, row0, start + (warp + a * NW) * KT, end,
                      ring + a * STAGE, lane, whole)
            commit()

    first_tiles = device_fn(first_tiles)

    def row_limit(r, length, end):
        # positions below this are seen by row r (query r // GROUP)
        i = int64(r // GROUP) if r < ROWS else int64(TQ - 1)  # signed (r: unsigned)
        lim = length - TQ + 1 + i
        if CAUSAL_EDGE and lim % KT == 0:
            lim += 1
        return min(lim, end)

    row_limit = device_fn(row_limit)

    def body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
             out, lse, part_acc, part_ml, limit, err, kscale, vscale, ksc, vsc):
        release_dependents()  # the combine's blocks may be placed from now on
        split = uint32(cuda.blockIdx.x)
        kv_head = uint32(cuda.blockIdx.y)
        seq = uint32(cuda.blockIdx.z)
        n_split = cuda.gridDim.x
        tid = uint32(cuda.threadIdx.x)
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        tq = lane % 4
        n_heads = q.shape[2]
        smem = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)  # the same memory (the end's merge)
        sbase = shared_base(smem)  # shared-space byte address of word 0
        # the lane's ldmatrix row address in a staged tile (bytes): row r_l = lane % 8
        # + 8 ((lane // 8) % 2), chunk 2 i + lane // 16 (x4: matrices (rows 0-7, chunk
        # 2i), (rows 8-15, 2i), (rows 0-7, 2i + 1), (rows 8-15, 2i + 1)); chunk ^ key
        # = (2 i) ^ (lane // 16 ^ key), so load i is an XOR of the constant 32 i
        r_l = (lane & 7) | (lane & 8)
        a_lane = 4 * (r_l * (TC // 2) + 4 * ((lane >> 4) ^ ((r_l >> LOG_PER) & KEY_MASK)))

        # -- the sequence's length and rows (the device guard: module docstring) --
        length = seq_lens[seq]
        row0 = int64(0)
        cap = page
        bad_slot = 0
        slot = 0
        if PAGED:
            cap = table.shape[1] * page
        else:
            slot = table[seq, 0]
            if slot < 0 or slot >= n_pages:
                length = 0
                slot = 0
                if CHECKED:
                    bad_slot = 1
            row0 = (int64(slot) * n_kv + kv_head) * page * CW
        bad_len = False
        if CHECKED:
            bad_len = length < 0 or length > cap or (TQ > 1 and 0 < length < TQ) or (
                length > limit)
            if bad_len:
                length = 0
        elif length < 0 or length > cap or (TQ > 1 and 0 < length < TQ):
            length = 0
        start = split * chunk
        end = min(length, start + chunk)
        whole = PAGED and page % KT == 0  # a tile (16 positions from a multiple of 16): one page

        # -- the warp's tiles: w, w + NW, ... of the chunk, through its ring; its
        # first S - 1 are issued before Q is staged (the rings lie past the Q tile),
        # so DRAM is busy while the block stages Q, except in a checked paged plan,
        # whose range check (with Q's barrier) must pass first --
        n_tiles = (end - start + KT - 1) // KT if end > start else 0
        n_mine = (n_tiles - warp + NW - 1) // NW if n_tiles > warp else 0
        ring = RING0 + warp * RING
        if EARLY:
            first_tiles(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page,
                        shift, n_pages, row0, start, end, ring, warp, lane, whole, n_mine)

        # -- Q [16, D] into the swizzled tile (rows past ROWS: zeros) --
        for k in range(Q_ROUNDS):  # a fixed count (unrolled; tid is unsigned)
            w = tid + k * NW * WARP
            r = w // WR
            cw = w % WR
            if Q_ROUNDS * NW * WARP == TILE_ROWS * WR or w < TILE_ROWS * WR:
                word = uint32(0)
                if r < ROWS:
                    word = q[seq, r // GROUP, kv_head * GROUP + r % GROUP, cw]
                smem[mma16.tile_index(r, 2 * cw, D)] = word
        if CHECKED and PAGED:
            # the range check: every page entry below the length, read by the block
            j = tid
            while j * page < length:
                pg = table[seq, j]
                if pg < 0 or pg >= n_pages:
                    bad_slot = 1
                j += NW * WARP
            bad_slot = cuda.syncthreads_or(bad_slot)  # also: the Q tile is complete
            if bad_slot:
                length = 0
                end = 0
                n_mine = 0
        else:
            cuda.syncthreads()  # the Q tile is complete
        if CHECKED and split == 0 and kv_head == 0 and tid == 0 and (bad_slot or bad_len):
            cuda.atomic.add(err, fast.ERR_COUNT, 1)
            cuda.atomic.min(err, fast.ERR_FIRST, seq)
            cuda.atomic.add(err, fast.ERR_SLOTS if bad_slot else fast.ERR_LENGTHS, 1)
        qa = cuda.local.array(N_QA, uint32)
        for kd in range(KS):
            if FP8:
                # k step kd's k index 2t + e is column 16 kd + 4t + e, 2t + 8 + e is
                # 16 kd + 4t + 2 + e (the order ldmatrix gives K's codes in)
                col = kd * 16 + 4 * tq
                a0 = smem[mma16.tile_index(g, col, D)]
                a1 = smem[mma16.tile_index(g + 8, col, D)]
                a2 = smem[mma16.tile_index(g, col + 2, D)]
                a3 = smem[mma16.tile_index(g + 8, col + 2, D)]
            else:
                a0, a1, a2, a3 = mma16.ldmatrix_x4(smem, D, 0, kd * 16, lane)
            qa[4 * kd] = a0
            qa[4 * kd + 1] = a1
            qa[4 * kd + 2] = a2
            qa[4 * kd + 3] = a3

        # -- the lane's two rows (g, g + 8): limits and running state --
        lim0 = row_limit(g, length, end)
        lim1 = row_limit(g + 8, length, end)
        m0 = float32(-math.inf)
        m1 = float32(-math.inf)
        l0 = float32(0.0)  # this lane's part of the row sums
        l1 = float32(0.0)
        u0 = float32(0.0)  # token_head: the rows' V normalisers (O = u o)
        u1 = float32(0.0)
        o = cuda.local.array(N_O, float32)
        for x in range(N_O):
            o[x] = float32(0.0)
        s = cuda.local.array(8, float32)

        # -- the warp's tiles through its ring (the first S - 1 issued above, or here) --
        st = 0  # the ring stage of tile it (it % S)
        if not EARLY:
            first_tiles(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page,
                        shift, n_pages, row0, start, end, ring, warp, lane, whole, n_mine)
        for it in range(n_mine):
            ahead = it + S - 1
            if ahead < n_mine:
                wst = st + S - 1  # the stage of tile ahead ((it + S - 1) % S)
                if wst >= S:
                    wst -= S
                issue(smem, smf, kc, vc, ksc, vsc, table, seq, slot, kv_head, n_kv, page,
                      shift, n_pages, row0, start + (warp + ahead * NW) * KT, end,
                      ring + wst * STAGE, lane, whole)
            commit()
            wait()  # this lane's copies of tile it have landed
            cuda.syncwarp()  # ... and every lane's are visible to the warp
            kb = ring + st * STAGE
            k_base = sbase + 4 * kb  # the stage's K tile (bytes); its V tile follows
            v_base = k_base + 4 * TWC
            tile0 = start + (warp + it * NW) * KT

            # -- S = Q K^T: one x4 load gives both 8-position halves' B fragments
            # (fp8: two k steps' codes, converted in registers) --
            c0 = c1 = c2 = c3 = float32(0.0)
            d0 = d1 = d2 = d3 = float32(0.0)
            if FP8:
                for kp in range(KS // 2):
                    # k0 / k1: positions g / g + 8, codes 32 kp + 4t .. + 3; k2 / k3:
                    # the same 16 codes on
                    k0, k1, k2, k3 = ld_x4(smem, k_base + (a_lane ^ (32 * kp)))
                    for half in range(2):
                        e0, e1 = codes_f16x2(k2 if half else k0)
                        f0, f1 = codes_f16x2(k3 if half else k1)
                        c0, c1, c2, c3, d0, d1, d2, d3 = s_step(
                            qa, 2 * kp + half, e0, e1, f0, f1, c0, c1, c2, c3, d0, d1, d2, d3)
            else:
                for kd in range(KS):
                    k0, k1, k2, k3 = ld_x4(smem, k_base + (a_lane ^ (32 * kd)))
                    c0, c1, c2, c3, d0, d1, d2, d3 = s_step(
                        qa, kd, k0, k2, k1, k3, c0, c1, c2, c3, d0, d1, d2, d3)
            s[0], s[1], s[2], s[3] = c0, c1, c2, c3
            s[4], s[5], s[6], s[7] = d0, d1, d2, d3

            # -- scale and mask: s[4 h + e] row g, s[4 h + 2 + e] row g + 8, position
            # tile0 + 8 h + 2 tq + e --
            sc = kb + SC0  # token_head: the tile's K scales, then its V scales
            for h in range(2):
                for e in range(2):
                    ksc_p = kscale  # the K scale on the score (the fast kernel's order)
                    if TOK:
                        ksc_p = smf[sc + 8 * h + 2 * tq + e]
                    x = float32(s[4 * h + e] * scale)
                    y = float32(s[4 * h + 2 + e] * scale)
                    if FP8:
                        x = float32(x * ksc_p)
                        y = float32(y * ksc_p)
                    s[4 * h + e] = x
                    s[4 * h + 2 + e] = y
            if tile0 + KT > min(lim0, lim1):  # a row's limit falls in the tile
                for h in range(2):
                    for e in range(2):
                        pos = tile0 + 8 * h + 2 * tq + e
                        if pos >= lim0:
                            s[4 * h + e] = float32(-math.inf)
                        if pos >= lim1:
                            s[4 * h + 2 + e] = float32(-math.inf)

            # -- online softmax of the two rows (max over the quad) --
            new0 = max(m0, group_max(max(max(s[0], s[1]), max(s[4], s[5])), 4))
            new1 = max(m1, group_max(max(max(s[2], s[3]), max(s[6], s[7])), 4))
            # P and l by the shared step; o is rescaled here (the step's alpha: an
            # all-masked row takes reference 0), and only where a row's max moved:
            # o * 1 is o, so most tiles of a long row skip the N_O multiplies
            ref0 = new0 if new0 > float32(-3.0e38) else float32(0.0)
            ref1 = new1 if new1 > float32(-3.0e38) else float32(0.0)
            alpha0 = float32(math.exp(m0 - ref0))
            alpha1 = float32(math.exp(m1 - ref1))
            l0, l1 = fragment_softmax_step(s, o, 0, m0, m1, l0, l1, new0, new1)
            if TOK:
                # then P' = P vs / u' with u' = max(u alpha, the tile's max P vs) a
                # row: P' <= 1 whatever the scales' range, and O = u' o' with o' = o
                # alpha u / u'
                for h in range(2):
                    for e in range(2):
                        vsc_p = smf[sc + KT + 8 * h + 2 * tq + e]
                        s[4 * h + e] = float32(s[4 * h + e] * vsc_p)
                        s[4 * h + 2 + e] = float32(s[4 * h + 2 + e] * vsc_p)
                if UNNORMALIZED:  # P vs as it is (u stays 1: O = o)
                    f0 = alpha0
                    f1 = alpha1
                    u0 = float32(1.0)
                    u1 = float32(1.0)
                else:
                    w0 = group_max(max(max(s[0], s[1]), max(s[4], s[5])), 4)
                    w1 = group_max(max(max(s[2], s[3]), max(s[6], s[7])), 4)
                    # o's rescale alpha u / u': exactly 1 where u' = u alpha (the
                    # normaliser stands or takes alpha's rounding); a product u (1 / u')
                    # or a fast-math u / u' is off by an ulp or two for some u, a drift
                    # of o on every later tile
                    au0 = float32(u0 * alpha0)
                    au1 = float32(u1 * alpha1)
                    nu0 = max(au0, w0)
                    nu1 = max(au1, w1)
                    inv0 = float32(0.0)  # a row with no weight yet: o and P' stay 0
                    inv1 = float32(0.0)
                    f0 = alpha0
                    f1 = alpha1
                    if nu0 > float32(0.0):
                        inv0 = float32(1.0) / nu0
                        f0 = float32(1.0) if nu0 == au0 else float32(au0 * inv0)
                    if nu1 > float32(0.0):
                        inv1 = float32(1.0) / nu1
                        f1 = float32(1.0) if nu1 == au1 else float32(au1 * inv1)
                    for h in range(2):
                        for e in range(2):
                            s[4 * h + e] = float32(s[4 * h + e] * inv0)
                            s[4 * h + 2 + e] = float32(s[4 * h + 2 + e] * inv1)
                    u0 = nu0
                    u1 = nu1
                if f0 != float32(1.0) or f1 != float32(1.0):  # o * 1 is o
                    for nd in range(NT):
                        o[4 * nd] *= f0
                        o[4 * nd + 1] *= f0
                        o[4 * nd + 2] *= f1
                        o[4 * nd + 3] *= f1
            elif alpha0 != float32(1.0) or alpha1 != float32(1.0):
                for nd in range(NT):
                    o[4 * nd] *= alpha0
                    o[4 * nd + 1] *= alpha0
                    o[4 * nd + 2] *= alpha1
                    o[4 * nd + 3] *= alpha1
            m0 = new0
            m1 = new1

            # -- O += P V: P rounded to 16 bits, the score fragments as A --
            if P_BF16:  # the precision mutant: 8 significant bits before the pack
                for e in range(8):
                    s[e] = round_bf16(s[e])
            p0 = pack(s[0], s[1])
            p1 = pack(s[2], s[3])
            p2 = pack(s[4], s[5])
            p3 = pack(s[6], s[7])
            if FP8:
                # V's code chunks 2 jp, 2 jp + 1 (columns 32 jp .. 32 jp + 31) a load;
                # chunk j's even columns' fragment into o[8 j .. 8 j + 3], its odd
                # columns' into o[8 j + 4 ..]
                for jp in range(D // 32):
                    v0, v1, v2, v3 = v_fragments(smem, v_base + (a_lane ^ (32 * jp)))
                    for half in range(2):
                        e0, f0 = v_codes_f16x2(v2 if half else v0)
                        e1, f1 = v_codes_f16x2(v3 if half else v1)
                        pv_two(o, 8 * (2 * jp + half), p0, p1, p2, p3, e0, e1, f0, f1)
            else:
                # V's columns 16 nd2 .. 16 nd2 + 15 a load: n tiles 2 nd2, 2 nd2 + 1
                for nd2 in range(NT // 2):
                    b0, b1, b2, b3 = v_fragments(smem, v_base + (a_lane ^ (32 * nd2)))
                    pv_two(o, 8 * nd2, p0, p1, p2, p3, b0, b1, b2, b3)
            cuda.syncwarp()  # every lane has read the stage before it is refilled
            st += 1
            if st == S:
                st = 0

        # -- the warps' states into shared memory (over the Q tile and rings) --
        l0 = group_sum(l0, 4)
        l1 = group_sum(l1, 4)
        if TOK:  # O = u o (the V scales are in it)
            for nd in range(NT):
                o[4 * nd] *= u0
                o[4 * nd + 1] *= u0
                o[4 * nd + 2] *= u1
                o[4 * nd + 3] *= u1
        cuda.syncthreads()  # every warp is done with the Q tile and its ring
        base = warp * TILE_ROWS * D
        for nd in range(NT):
            # o[4 nd + e] (row g) and o[4 nd + 2 + e] (row g + 8) hold column
            # nd * 8 + 2 t + e; fp8 (chunk j = nd // 2, the even columns' fragment
            # then the odd ones'): column 16 j + 4 t + 2 e + nd % 2
            col = nd * 8 + 2 * tq
            step = 1
            if FP8:
                col = (nd // 2) * 16 + 4 * tq + nd % 2
                step = 2
            smf[base + g * D + col] = o[4 * nd]
            smf[base + g * D + col + step] = o[4 * nd + 1]
            smf[base + (g + 8) * D + col] = o[4 * nd + 2]
            smf[base + (g + 8) * D + col + step] = o[4 * nd + 3]
        if tq == 0:
            smf[M_ML + warp * 2 * TILE_ROWS + 2 * g] = m0
            smf[M_ML + warp * 2 * TILE_ROWS + 2 * g + 1] = l0
            smf[M_ML + warp * 2 * TILE_ROWS + 2 * (g + 8)] = m1
            smf[M_ML + warp * 2 * TILE_ROWS + 2 * (g + 8) + 1] = l1
        cuda.syncthreads()  # the states are complete

        # -- a row's merge weights (one batch: its max, one weight a warp) --
        single = n_split == 1
        if tid < ROWS:
            r = tid
            m_all = float32(-math.inf)
            for w in range(NW):
                m_all = max(m_all, smf[M_ML + w * 2 * TILE_ROWS + 2 * r])
            ref = batch_reference(m_all)
            l_all = float32(0.0)
            for w in range(NW):
                wt = float32(math.exp(smf[M_ML + w * 2 * TILE_ROWS + 2 * r] - ref))
                smf[M_WT + w * TILE_ROWS + r] = wt
                l_all = float32(l_all + wt * smf[M_ML + w * 2 * TILE_ROWS + 2 * r + 1])
            i = r // GROUP
            head = kv_head * GROUP + r % GROUP
            if single:
                inv, lse_r = softmax_finish(m_all, l_all)  # (0, -inf) for an empty row
                smf[M_INV + r] = inv
                lse[seq, i, head] = lse_r
            else:
                part_ml[seq, i * n_heads + head, split, 0] = m_all
                part_ml[seq, i * n_heads + head, split, 1] = l_all
        cuda.syncthreads()  # the weights are complete

        # -- the merged rows: out (one split) or the partial --
        for k in range(MERGE_ROUNDS):
            e = tid + k * NW * WARP
            if MERGE_ROUNDS * NW * WARP != ROWS * D and e >= ROWS * D:
                break
            r = e // D
            d = e % D
            acc = float32(0.0)
            for w in range(NW):
                acc = float32(acc + smf[M_WT + w * TILE_ROWS + r]
                              * smf[w * TILE_ROWS * D + r * D + d])
            if FP8 and not TOK:  # the V scale on the output (before 1 / l; partials:
                acc = float32(acc * vscale)  # unnormalised)
            i = r // GROUP
            head = kv_head * GROUP + r % GROUP
            if single:
                out[seq, i, head, d] = acc * smf[M_INV + r]
            else:
                part_acc[seq, i * n_heads + head, split, d] = acc

    body = device_fn(body)
    one = float32(1.0)
    # the arguments past part_ml: (limit, err) when checked, then (k_sc, v_sc) with
    # fp8; body takes the tensor scales as values and token_head's as arrays (an
    # unused argument gets a stand-in)
    if CHECKED and TOK:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml, limit, err, k_sc, v_sc):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, limit, err, one, one, k_sc, v_sc)
    elif CHECKED and FP8:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml, limit, err, k_sc, v_sc):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, limit, err, k_sc[0], v_sc[0], k_sc, v_sc)
    elif CHECKED:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml, limit, err):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, limit, err, one, one, lse, lse)
    elif TOK:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml, k_sc, v_sc):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, 0, seq_lens, one, one, k_sc, v_sc)
    elif FP8:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml, k_sc, v_sc):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, 0, seq_lens, k_sc[0], v_sc[0], k_sc, v_sc)
    else:
        def kernel(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                   out, lse, part_acc, part_ml):
            body(q, kc, vc, seq_lens, table, n_kv, page, n_pages, shift, scale, chunk,
                 out, lse, part_acc, part_ml, 0, seq_lens, one, one, lse, lse)

    name = (f"decode_mma_{kind}{'t' if TOK else ''}_d{D}_g{GROUP}_t{TQ}_w{NW}_s{S}_"
            f"{paging or 'pooled'}")
    kernel.__name__ = kernel.__qualname__ = (name + ("_checked" if CHECKED else "")
                                             + ("_pdl" if pdl else "")
                                             + ("" if defect is None else "_" + defect))
    return jit(kernel, fastmath=True)


# ---------------------------------------------------------------------------
# plan and launch
# ---------------------------------------------------------------------------

def blocks_by_registers(head_dim, warps=WARPS):
    """Blocks of ``warps`` warps an SM holds by registers (``REGISTERS``'s bound
    a thread for the head dim), at most ``RESIDENT_MAX``."""
    return max(1, min(RESIDENT_MAX,
                      REGS_PER_SM // (REGISTERS.get(int(head_dim), 256) * int(warps) * WARP)))


def blocks_by_smem(dyn_smem):
    """Blocks an SM holds by shared memory: ``dyn_smem`` bytes a block plus the
    1 KB the driver reserves a block."""
    return SMEM_PER_SM // (int(dyn_smem) + 1024)


def default_stages(kind, head_dim, warps=WARPS, scales="tensor"):
    """Ring stages a warp when none are given: ``STAGES`` for 16-bit caches; for
    fp8 the most, up to ``FP8_STAGES``, with which the blocks an SM holds by
    registers (``blocks_by_registers``) still fit in its shared memory (a
    stage holds a quarter of a 16-bit one, so deeper rings cost no residency)."""
    if kind != FP8_KIND:
        return STAGES
    blocks = blocks_by_registers(head_dim, warps)
    for s in range(FP8_STAGES, STAGES, -1):
        dyn = 4 * smem_words(head_dim, warps, s, fp8=True, token_head=scales == "token_head")
        if blocks_by_smem(dyn) >= blocks:
            return s
    return STAGES


def plan(m_count, n_heads, n_kv, head_dim, max_len, kind, *, t_q=1, n_split=None,
         warps=WARPS, stages=None, paging=None, defect=None, checked=False,
         scales="tensor", chunk=None, pdl=None):
    """Launch plan (a dict): kernel, grid, block, dyn_smem, chunk, n_split, pdl, ...

    ``max_len``: the longest length served (positions the splits cover).
    ``n_split`` (default: ``fast.split_count`` over the ``M * H_kv`` blocks a
    split, with the blocks an SM holds by shared memory and by registers,
    ``REGISTERS``) is then trimmed to
    the chunks that hold a position; a chunk is a whole number of rounds of
    the warps' 16-position tiles (``16 * warps``). ``checked``: the kernel
    with the plan's range check (``mma_decode_kernel``; ``launch`` then takes
    ``limit`` and ``d_err``). ``scales``: an fp8 plan's scale mode
    (``FP8_SCALES``). ``chunk`` (not with ``n_split``): the positions a split,
    fixed (rounded up to a whole round of the warps' tiles): a batch-invariant
    plan's (``invariant_chunk``); ``n_split`` then covers ``max_len``.
    ``stages``: ring stages a warp (default ``default_stages``; they change no
    result bit, only how many tiles a warp has in flight). ``pdl`` (default: a
    split plan where ``attention.core.pdl.capable()``): the combine is launched
    as a programmatic dependent of the main kernel (``launch``; as the fast
    kernel's, ``attention.decode.fast.plan``), so its launch and ramp overlap
    the main kernel; the same bits either way.
    """
    if stages is None:
        stages = default_stages(kind, head_dim, warps, scales)
    t_q, warps, stages = int(t_q), int(warps), int(stages)
    group = int(n_heads) // int(n_kv)
    if scales not in FP8_SCALES or (scales != "tensor" and kind != FP8_KIND):
        raise ValueError(f"scales: expected 'tensor', or 'token_head' with kind "
                         f"{FP8_KIND!r}, got {scales!r} (kind {kind!r})")
    dyn = 4 * smem_words(head_dim, warps, stages, fp8=kind == FP8_KIND,
                         token_head=scales == "token_head")
    # blocks an SM holds: by shared memory and by registers (at D 128 the fp8
    # kernel's 200-210 registers allow 2 whatever its ring; counted by shared memory
    # alone, its 3-stage 52 KB gave 4, and the H200 took 90.5 us with the 2 splits
    # that gave, 78-86 us with one split, notes/bench.md)
    resident = max(1, min(blocks_by_smem(dyn), blocks_by_registers(head_dim, warps)))
    chunk, n_split = fast.split_chunk(max_len, KT * warps, m_count * n_kv, resident,
                                      n_split=n_split, chunk=chunk)
    pdl = (n_split > 1 and pdl_capable()) if pdl is None else bool(pdl)
    return {
        "kernel": mma_decode_kernel(kind, head_dim, group, t_q, warps, stages, paging, defect,
                                    bool(checked), scales, pdl),
        "pdl": pdl,
        "kind": kind,
        "scales": scales,
        "head_dim": int(head_dim),
        "group": group,
        "t_q": t_q,
        "paging": paging,
        "grid": (n_split, int(n_kv), int(m_count)),
        "block": warps * WARP,
        "dyn_smem": dyn,
        "chunk": chunk,
        "n_split": n_split,
        "warps": warps,
        "stages": stages,
        "defect": defect,
        "checked": bool(checked),
    }


def invariant_chunk(n_heads, n_kv, head_dim, max_len, kind, *, t_q=1, warps=WARPS,
                    stages=None, scales="tensor"):
    """The split length of a batch-invariant plan (``plan(chunk=...)``): the
    chunk the default plan gives a lone sequence of ``max_len`` positions (so
    one sequence still fills the GPU). It depends on the geometry, the
    capacity and the GPU, never on the batch: a sequence's blocks then cover
    the same positions in any batch, their warps take the same tiles, and the
    splits merge in a fixed order, so its output and LSE are the same bits."""
    return plan(1, n_heads, n_kv, head_dim, max_len, kind, t_q=t_q, warps=warps,
                stages=stages, scales=scales)["chunk"]


def launch(pl, d_q, d_k, d_v, d_lens, d_table, scale, d_out, d_lse, d_part_acc, d_part_ml,
           stream=0, limit=None, d_err=None, d_k_scale=None, d_v_scale=None):
    """Enqueue a planned decode (one launch, or two with the combine); no
    checks, copies or allocations beyond array views.

    d_q [M, T, H, D] 16-bit; d_k, d_v the caches (pooled or the plan's page
    layout); d_lens [M] int32; d_table [M, max_pages] int32 (pooled: the slot
    table [M] or [M, 1]); d_out [M, T, H, D] f32; d_lse [M, T, H] f32;
    d_part_acc / d_part_ml ``fast.scratch(M, T * H, D, n_split)``. A
    ``checked`` plan: ``limit`` (the longest length served) and ``d_err``
    [fast.ERR_WORDS] int32, the flag the kernel's range check counts into.
    An fp8 plan (kind ``FP8_KIND``): d_k, d_v hold e4m3 codes (uint8), d_q is
    float16, and ``d_k_scale`` / ``d_v_scale`` are float32 device arrays (K =
    code * k_scale), read by the kernel: [1] (scales "tensor"), or one a cached
    row in the cache's layout without D ("token_head"; viewed flat here).
    """
    m_count, t_q, n_heads, head_dim = (int(s) for s in d_q.shape)
    if pl["paging"] == "NHD":
        n_pages, page, n_kv = (int(s) for s in d_k.shape[:3])
    else:
        n_pages, n_kv, page = (int(s) for s in d_k.shape[:3])
    if len(d_table.shape) == 1:
        d_table = d_table.reshape(m_count, 1)
    shift = page.bit_length() - 1 if page & (page - 1) == 0 else -1
    words = mma16.as_words
    args = (words(d_q), words(d_k, True), words(d_v, True), d_lens, d_table,
            np.int32(n_kv), np.int32(page), np.int32(n_pages), np.int32(shift),
            np.float32(scale), np.int32(pl["chunk"]), d_out, d_lse, d_part_acc, d_part_ml)
    if pl.get("checked"):
        args += (np.int32(limit), d_err)
    if pl["kind"] == FP8_KIND:
        if pl.get("scales") == "token_head":
            d_k_scale, d_v_scale = (x.reshape(int(np.prod(x.shape)))
                                    for x in (d_k_scale, d_v_scale))
        args += (d_k_scale, d_v_scale)
    ensure_dynamic_shared(pl["kernel"], args, pl["dyn_smem"], 0, pl["kind"],
                          pl.setdefault("smem_ready", set()))
    pl["kernel"][pl["grid"], pl["block"], stream, pl["dyn_smem"]](*args)
    if pl["n_split"] > 1:
        rows = t_q * n_heads
        pdl = bool(pl.get("pdl", False))
        comb = fast.combine_kernel(-(-head_dim // WARP), pdl)
        grid, block = (rows, m_count), fast.combine_warps(pl["n_split"]) * WARP
        cargs = (d_part_acc, d_part_ml, d_out.reshape(m_count, rows, head_dim),
                 d_lse.reshape(m_count, rows))
        if pdl and not is_graph_builder(stream):
            launch_dependent(comb, grid, block, stream, cargs)
        else:
            comb[grid, block, stream](*cargs)


def check_inputs(q, k_cache, v_cache, seq_lens, slot_table=None, page_table=None,
                 layout="HND", t_q=None):
    """Validate a call (errors name the argument and the expected shape).

    Returns a dict: M, T, H, H_kv, D, kind, paging (None / "HND" / "NHD"),
    capacity (positions a sequence may hold), lens (int32 host copy), table
    (int32 host copy: the slot table [M] or the page table [M, max_pages])."""
    paged = page_table is not None
    if paged and slot_table is not None:
        raise checks.AttentionInputError(
            "slot_table: a paged call takes page_table, not slot_table (give one)")
    if paged and layout not in LAYOUTS:
        raise checks.LayoutError(
            f"layout: expected 'HND' ([num_pages, H_kv, P, D]) or 'NHD' "
            f"([num_pages, P, H_kv, D]), got {layout!r}")
    if not paged:
        dims = (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", None))
    elif layout == "HND":
        dims = (("num_pages", None), ("H_kv", None), ("P", None), ("D", None))
    else:
        dims = (("num_pages", None), ("P", None), ("H_kv", None), ("D", None))
    shape = checks.check_array("k_cache", k_cache, dims, dtypes=CACHE_DTYPES + (FP8_DTYPE,))
    fp8 = checks._dtype(k_cache) == FP8_DTYPE
    kind = FP8_KIND if fp8 else dtype_kind(checks._dtype(k_cache))
    q_dtypes = (np.dtype(np.float16),) if fp8 else CACHE_DTYPES
    n_rows, head_dim = shape[0], shape[3]
    n_kv, page = (shape[2], shape[1]) if layout == "NHD" and paged else (shape[1], shape[2])
    if head_dim not in HEAD_DIMS:
        raise checks.RangeError(f"k_cache: expected head_dim D in {HEAD_DIMS}, got {head_dim}")
    checks.check_array("v_cache", v_cache, tuple((label, s) for (label, _), s in zip(dims, shape)),
                       dtypes=CACHE_DTYPES + (FP8_DTYPE,))
    if fp8:  # e4m3 codes; q float16 (the mma's operand type)
        checks.check_same_dtype([("k_cache", k_cache), ("v_cache", v_cache)])
    else:
        checks.check_same_dtype([("k_cache", k_cache), ("v_cache", v_cache), ("q", q)])
    if len(getattr(q, "shape", ())) == 3:
        m_count, n_heads, q_dim = checks.check_array(
            "q", q, (("M", None), ("H", None), ("D", head_dim)), dtypes=q_dtypes)
        tq = 1
    else:
        m_count, tq, n_heads, q_dim = checks.check_array(
            "q", q, (("M", None), ("T", None), ("H", None), ("D", head_dim)),
            dtypes=q_dtypes)
    if t_q is not None and int(t_q) != tq:
        raise checks.ShapeError(f"t_q: q holds T={tq} queries a sequence, got t_q={t_q}")
    checks.check_range("q", tq, 1, TILE_ROWS, what="queries a sequence T")
    checks.check_heads(n_heads, n_kv)
    group = n_heads // n_kv
    if group * tq > TILE_ROWS:
        raise checks.RangeError(
            f"q: the GQA group H / H_kv = {group} times T = {tq} queries gives "
            f"{group * tq} rows a kv head; expected at most {TILE_ROWS} (one mma tile)")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_aligned(name, x, 16)
    if paged:
        table = np.asarray(host_ints(page_table))
        if table.ndim != 2 or table.shape[0] != m_count or table.shape[1] < 1:
            raise checks.ShapeError(
                f"page_table: expected shape [M={m_count}, max_pages], got {table.shape}")
        if not np.issubdtype(table.dtype, np.integer):
            raise checks.DTypeError(f"page_table: expected int32, got {table.dtype}")
        capacity = table.shape[1] * page
    else:
        capacity = page
    lens = checks.check_lengths("seq_lens", None if seq_lens is None else host_ints(seq_lens),
                                capacity, count=m_count)
    short = (lens > 0) & (lens < tq)
    if short.any():
        m = int(np.flatnonzero(short)[0])
        raise checks.RangeError(
            f"seq_lens: sequence {m} has length {int(lens[m])}, fewer than the T={tq} new "
            f"tokens it must hold; expected 0 or a length in [{tq}, {capacity}]")
    if paged:
        for m in range(m_count):
            used = table[m, :-(-int(lens[m]) // page)] if lens[m] else table[m, :0]
            if used.size and (used.min() < 0 or used.max() >= n_rows):
                bad = int(used[(used < 0) | (used >= n_rows)][0])
                raise checks.RangeError(
                    f"page_table: sequence {m} names page {bad} among its first "
                    f"ceil(length / P) entries; expected pages in [0, num_pages={n_rows})")
        table = table.astype(np.int32)
    else:
        if slot_table is None and n_rows < m_count:
            raise checks.ShapeError(
                f"k_cache: expected KV_SLOTS >= M={m_count} slots (no slot_table), got {n_rows}")
        table = checks.check_slot_table(
            None if slot_table is None else host_ints(slot_table), m_count, n_rows)
    return {"M": m_count, "T": tq, "H": n_heads, "H_kv": n_kv, "D": head_dim, "kind": kind,
            "paging": layout if paged else None, "capacity": capacity, "lens": lens,
            "table": table}


def _stage(x, stream):
    """numpy 16-bit arrays to the device (as uint16: bfloat16 travels that way),
    fp8 codes as uint8; device arrays as they are (``launch`` views them as words)."""
    if is_host_array(x):
        x = np.ascontiguousarray(x)
        return to_device(x if x.dtype == FP8_DTYPE else x.view(np.uint16), stream)
    return x


def _fp8_scale(name, value):
    """A per-tensor fp8 scale (a positive finite float, or a float32 [1] array,
    numpy or device), checked: a float32 [1] numpy array, or the device array."""
    if value is None:
        raise checks.AttentionInputError(
            f"{name}: an fp8 cache (uint8 e4m3 codes) needs its per-tensor scale "
            f"(K = code * k_scale), got None")
    if is_host_array(value) or isinstance(value, (float, int, np.floating, np.integer)):
        arr = np.asarray(value, np.float32).reshape(-1)
        if arr.shape != (1,) or not np.isfinite(arr[0]) or arr[0] <= 0:
            raise checks.RangeError(
                f"{name}: expected one finite positive float32 scale, got {value!r}")
        return arr
    checks.check_array(name, value, (("1", 1),), dtypes=(np.float32,))
    return value


def _attended(shape, geo):
    """bool mask of a scale array in the cache's layout without D (``shape``):
    the rows some query of the call attends (``check_inputs``'s ``geo``)."""
    seen = np.zeros(shape, bool)
    lens, table = geo["lens"], geo["table"]
    for m, n in enumerate(int(x) for x in lens):
        if geo["paging"] is None:
            seen[table[m], :, :n] = True
            continue
        page = shape[2] if geo["paging"] == "HND" else shape[1]
        for j in range(-(-n // page)):
            rows = min(page, n - j * page)
            if geo["paging"] == "HND":
                seen[table[m, j], :, :rows] = True
            else:
                seen[table[m, j], :rows, :] = True
    return seen


def _fp8_scales(k_scale, v_scale, k_cache, geo):
    """The scale mode ("tensor" / "token_head") and the two scales, checked:
    one positive finite value each (a float or a float32 [1] array), or arrays
    float32 in the cache's layout without D (``k_cache.shape[:3]``), finite and
    >= 0 on every attended row (host arrays; device arrays are taken as given)."""
    ranks = [len(getattr(x, "shape", ())) for x in (k_scale, v_scale)]
    if 3 not in ranks:
        return "tensor", (_fp8_scale("k_scale", k_scale), _fp8_scale("v_scale", v_scale))
    want = tuple(int(x) for x in k_cache.shape[:3])
    if geo["paging"] == "NHD":
        dims = (("num_pages", want[0]), ("P", want[1]), ("H_kv", want[2]))
    elif geo["paging"] == "HND":
        dims = (("num_pages", want[0]), ("H_kv", want[1]), ("P", want[2]))
    else:
        dims = (("KV_SLOTS", want[0]), ("H_kv", want[1]), ("max_seq", want[2]))
    seen = None
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise checks.AttentionInputError(
                f"{name}: an fp8 cache with per-(token, kv head) scales needs both k_scale "
                f"and v_scale (float32 {want}), got None")
        checks.check_array(name, x, dims, dtypes=(np.float32,))
        if is_host_array(x):
            seen = _attended(want, geo) if seen is None else seen
            vals = np.asarray(x)[seen]
            bad = ~(np.isfinite(vals) & (vals >= 0))
            if bad.any():
                raise checks.RangeError(
                    f"{name}: expected finite scales >= 0 on every attended row, got "
                    f"{vals[bad][0]!r} ({int(bad.sum())} such rows)")
    return "token_head", (k_scale, v_scale)


def mma_decode(q, k_cache, v_cache, seq_lens, slot_table=None, *, page_table=None,
               layout="HND", t_q=None, n_split=None, out=None, lse=None, scale=None,
               stream=None, warps=WARPS, stages=None, defect=None, k_scale=None,
               v_scale=None, pdl=None):
    """Tensor-core decode attention over a pooled or paged 16-bit or fp8 cache.

    q:          [M, T, H, D] (or [M, H, D]: T = 1) float16 / bfloat16, the cache's
                dtype (numpy bf16 arrays are ``ml_dtypes.bfloat16``); float16 with
                an fp8 cache
    k_cache:    pooled [KV_SLOTS, H_kv, max_seq, D]; with ``page_table``,
                [num_pages, H_kv, P, D] (``layout="HND"``) or [num_pages, P, H_kv,
                D] ("NHD"); D in 32, 64, 128; H / H_kv * T <= 16
    v_cache:    the same shape and dtype. fp8 e4m3 codes (uint8,
                ``attention.cache.fp8``; sm_89 and later on a GPU) with scales
                ``k_scale`` / ``v_scale``: the codes are converted to f16 (exact)
                in shared memory; S is multiplied by the K scale, the V scale goes
                on the output (per tensor) or into P (per row, module docstring)
    seq_lens:   [M] int: 0 or T .. capacity; query i of sequence m attends
                positions 0 .. seq_lens[m] - T + i
    slot_table: [M] int (pooled; default ``arange(M)``)
    page_table: [M, max_pages] int (paged): position p is row p % P of page
                page_table[m, p // P]; the entries of the first ceil(len / P)
                pages must be in [0, num_pages)
    t_q:        optional: T, checked against q
    n_split:    KV chunks a sequence (default: sized to fill the GPU)
    out, lse:   optional float32 buffers [M, T, H, D] / [M, T, H] (q's rank: [M, H,
                D] / [M, H] for a 3-D q)
    scale:      default 1 / sqrt(D)
    stream:     numba stream; None synchronises before returning
    warps, stages: the kernel's warps a block and ring stages a warp (default
                ``default_stages``)
    defect:     None or a planted switch of ``DEFECTS`` (tests only)
    pdl:        the split combine as a programmatic dependent launch (``plan``;
                default where ``attention.core.pdl.capable()``); the same bits
    k_scale, v_scale: fp8 caches only: per tensor, a positive float or a float32
                [1] array (numpy or device); per (token, kv head), float32 arrays
                in the cache's layout without D (``k_cache.shape[:3]``: pooled
                [KV_SLOTS, H_kv, max_seq], HND [num_pages, H_kv, P], NHD
                [num_pages, P, H_kv]), >= 0 and finite on every attended row
                (checked for numpy arrays; other rows are never read)
    Returns (out, lse): numpy when q is numpy, else device arrays; lse is -inf
    and out zeros where a row attends nothing.
    """
    geo = check_inputs(q, k_cache, v_cache, seq_lens, slot_table, page_table, layout, t_q)
    scale = checks.check_scale(scale, geo["D"])
    check_defect(defect)
    fp8 = geo["kind"] == FP8_KIND
    scales = "tensor"
    pair = (None, None)
    if fp8:  # both checked before either is staged
        scales, pair = _fp8_scales(k_scale, v_scale, k_cache, geo)
    elif k_scale is not None or v_scale is not None:
        raise checks.AttentionInputError(
            "k_scale, v_scale: only fp8 caches (uint8 e4m3 codes) take scales")
    if defect in FP8_TOKEN_DEFECTS and scales != "token_head":
        raise ValueError(f"defect: {defect!r} needs an fp8 kernel with token_head scales")
    m_count, tq, n_heads, head_dim = geo["M"], geo["T"], geo["H"], geo["D"]
    if n_split is not None:
        checks.check_range("n_split", int(n_split), 1, 1 << 16, what="split count")
    rank3 = len(q.shape) == 3
    o_shape = (m_count, n_heads, head_dim) if rank3 else (m_count, tq, n_heads, head_dim)
    s_shape = o_shape[:-1]
    if m_count == 0:
        return np.zeros(o_shape, np.float32), np.zeros(s_shape, np.float32)
    max_len = int(geo["lens"].max())
    pl = plan(m_count, n_heads, geo["H_kv"], head_dim, max_len, geo["kind"], t_q=tq,
              n_split=n_split, warps=warps, stages=stages, paging=geo["paging"],
              defect=defect, scales=scales, pdl=pdl)
    d_ks, d_vs = (to_device(np.ascontiguousarray(x), stream) if is_host_array(x) else x
                  for x in pair)
    d_q, d_k, d_v = (_stage(x, stream) for x in (q, k_cache, v_cache))
    d_lens = to_device(geo["lens"], stream)
    d_table = to_device(geo["table"], stream)
    d_out = output_array("out", out, o_shape, stream)
    d_lse = output_array("lse", lse, s_shape, stream)
    d_pa, d_pm = fast.scratch(m_count, tq * n_heads, head_dim, pl["n_split"], stream)
    launch(pl, d_q.reshape(m_count, tq, n_heads, head_dim), d_k, d_v, d_lens, d_table,
           scale, d_out.reshape(m_count, tq, n_heads, head_dim),
           d_lse.reshape(m_count, tq, n_heads), d_pa, d_pm, launch_stream(stream),
           d_k_scale=d_ks, d_v_scale=d_vs)
    result = (d_out, d_lse)
    if is_host_array(q):
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    return result
