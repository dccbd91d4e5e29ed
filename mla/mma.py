"""MLA decode attention on 16-bit tensor cores (``mma.m16n8k16``, fp32 accumulation).

The absorbed MLA attention of ``mla.pipeline`` (method "mma"): every query row
``qc = [q_lat | q_pe]`` (``W = r + d_rope`` wide, fp32, from the absorb GEMM)
attends its sequence's latent rows ``[c_kv | k_pe]`` of a 16-bit cache, and the
output is ``o_lat = softmax(scale qc . row) c_kv`` ([r] a row), decompressed
afterwards through W_UV. As FlashMLA does, q is rounded to the cache's 16-bit
type, the scores and P.V run on 16-bit mma, softmax and accumulation are fp32
and P is rounded to the 16-bit type before P.V.

* **One block per (split, row block, sequence).** A row block holds ``16 RG``
  of a sequence's ``R = s_q nh`` query rows (row ``i nh + h``: query ``i``,
  head ``h``; padded with zero rows that are computed and never written).
  Its ``4 RG`` warps are ``RG`` row groups of 16 rows times 4 column
  quarters (``cq``).
* **Q in shared memory.** The block rounds its rows to 16 bits (``mma16.pack``,
  to nearest even) into a swizzled tile ``[16 RG, W]``, stored as ``W / 64``
  column blocks of ``[16 RG, 64]`` (``mma16``'s swizzle of 8 chunks a row).
* **Latent tiles of ``KT`` positions, double buffered.** The whole block copies
  tile ``t + 1`` (``cp.async``, the same column-block layout) while it computes
  tile ``t``. A tile is both K (all ``W`` columns) and V (the first ``r``).
  Rows past the split's end and rows of a bad page entry are zero-filled. A
  whole tile of consecutive cache rows (contiguous, or pages of a multiple of
  KT) is copied without position checks, each thread one 16-byte chunk of
  every ``NTH // (W / 8)``-th row, its source a constant step on.
* **S = Q K^T:** warp ``(rg, cq)`` scores its 16 rows against the tile's 16
  positions ``16 cq ..`` (KT = 64), ``W / 16`` k steps, Q and K fragments from
  ``ldmatrix`` x4.
* **Online softmax in fp32** (natural ``exp``, fast math). A row's tile max is
  taken over its lane quad (``attention.core.warp.group_max``) and over the 4
  warps of its row group through shared memory, so the 4 warps hold the same
  running max; each lane keeps its part of the row sum ``l`` (of the
  unrounded P). P is rounded to 16 bits into a shared tile ``[16 RG, KT]``.
* **O += P V:** warp ``(rg, cq)`` owns columns ``cq r / 4 ..`` of its 16 rows'
  ``O`` (``r / 4 / 8`` mma n tiles, ``r / 4 / 8 * 4`` fp32 registers a lane):
  P from the shared tile (``ldmatrix`` x4), V from the latent tile
  (``ldmatrix`` x4 ``.trans``: two n tiles a load). Shared addresses are
  32-bit offsets (``mma16.smem_ops``): one lane offset serves every ldmatrix,
  the k step an XOR of a constant (``mla_mma_kernel``); integer address
  arithmetic in the loops made the first version issue-bound (notes/bench.md
  run 22). The thread and block indices are taken as unsigned, so indices
  derived from them need no wraparound test and no sign fix-up on a division
  by a power of two (4,360 -> 2,800 SASS instructions at RG 4, 138 -> 128
  registers; notes/bench.md run 42).
* **End.** The row sums are added over the quad and the 4 warps (in that fixed
  order); one split writes ``o_lat = O / l`` and ``lse = m + log l``; more
  splits write the unnormalised partial (acc, m, l) in
  ``attention.decode.fast``'s layout, merged by its combine kernel in column
  slices (``combine_slices``).

Registers: at RG 4 (512 threads) a thread has 128. There the lane's shared
offsets are derived again on every tile from ``tid`` plus an opaque zero
(``it & 2^30``): kept as loop invariants they were spilled, and the refills,
once a tile, miss the L1 that the shared memory leaves (notes/bench.md).
Fewer row groups keep them in registers. A paged cache's page size is compiled
in (``plan(page_size=)``, one kernel a page size, as ``prepare`` plans it):
read at run time, its division and shift paths spilled 124 to 184 bytes a
thread at RG 4, against 16 with it a constant.

Hopper's warp-group MMA (``wgmma``: 1, S on it; 2, S and P.V; a 16-bit cache at
RG 4, sm_90a, and its emulation on the simulator; ``plan`` picks 2 on a
compute-capability-9.0 GPU): the 4 warps of a warp group are the 4 row groups
of one column quarter. S: the group multiplies the block's 64 Q rows by its
quarter's 16 positions with ``4 W / 64`` (36) ``wgmma.m64n16k16`` a tile
(``attention.gemm.wgmma.tile_product``), reading Q and K from their tiles, whose
layout is the 128-byte swizzle the instruction expects; each warp's
accumulators are then its S fragments as the mma.sync loop leaves them. P.V:
the group adds the P tile (64 rows, K-major) times its quarter's ``r / 4``
columns of the latent tile (MN-major: V as the tile stores it, 64-column
blocks the descriptor's LBO apart) onto O in ``KT / 16`` (4)
``wgmma.m64n{r/4}k16`` (``tile_accumulate``); O's registers are the mma.sync
loop's. Q's and V's shared bytes a tile fall fourfold (one read a warp group,
not one a warp). Each thread fences its shared stores for the async proxy
before the barriers after which a wgmma reads them (a landed tile, the P
tile). The planted ``ldmatrix_no_trans`` reads V K-major there (trans-b 0),
``v_block_stride`` drops the quarter's column-block offset and the LBO.

Three ``__syncthreads`` a tile (tile landed; row maxima; P tile). Shared memory,
words of 4 bytes: Q ``8 RG W``, two latent tiles ``KT W / 2`` each, the P tile
``8 RG KT`` and ``64 RG`` floats of row maxima: 230,400 bytes at RG 4, KT 64, W
576 (the H200 allows 232,448 a block); an fp8 cache adds ``KT`` floats of row
scales (230,656 bytes).

The absorb and decompress GEMMs around the attention (``prepare``,
``launch_prepared``; ``mla.attn_gemm.weight_gemm``) run on split-tf32 tensor
cores (``attention.gemm.tgemm``, 64-row tiles, ``a`` read as [q, head, k])
where their grid fills the GPU once (128 heads at B 64), else on fp32 FMAs as
the other methods do (``sgemm``, ``skinny``); a batch-invariant call
(``capacity``) keeps the FMA ways, whose bits do not depend on the batch's
rows. Either way their error is of
fp32's class, far below the 16-bit rounding of q_lat after the absorb and of P
and the cache before the decompress.

Layouts (C-contiguous device arrays):
    qc        [B, R, W] float32 (R = s_q nh rows of a sequence)
    latent    contiguous [S, max_seq, W] with slots [B] (``table`` [B, 1]), or
              paged [num_pages, P, W] with ``table`` [B, max_pages] int32
              (position p of sequence b: row p % P of page table[b, p // P])
    lens      [B] int32: the rows sequence b sees (its last query's end)
    o_lat     [B, R, r] float32; lse [B, R] float32 (one split)
    part_acc  [B, R, n_split, r] float32, part_ml [B, R, n_split, 2] (more splits)

Multi-token decode: query ``i`` of ``s_q`` (row ``i nh + h``) sees positions
below ``lens[b] - s_q + 1 + i``.

Device guard (the launchers check on the host first): a length outside ``[0,
capacity]`` or in ``1 .. s_q - 1``, or a slot outside the cache, makes its
sequence empty (zeros, lse -inf); a page entry outside ``[0, num_pages)``
reads as zero rows. Nothing is read out of bounds.

fp8 cache (``fp8=`` "tensor" / "token"; ``mla.fp8``: rows of r e4m3 codes and
d_rope fp16 values, ``r + 2 d_rope`` bytes, with float32 scales ``sc``): the
same kernel with fp16 operands (``kind`` "f16"). A tile's codes are copied
(``cp.async``) into two code buffers ``[KT, r]`` bytes; at the top of the next
tile's step the block converts them into one f16 c_kv tile (the 16-bit
layout). Per tensor the tile holds the codes' values (``cvt.rn.f16x2.e4m3x2``,
exact) and the scale ``s`` goes on the c_kv part of S (the c_kv column blocks'
sums times ``s``, one rounding, before k_pe's k steps are added) and on O
(times ``s`` before ``1 / l``, or before a split's partial is written): one
conversion instruction a code pair, against three through fp32 (notes/bench.md).
Per tensor at a rank that is a power of two (128 and up: ``DIRECT``, DeepSeek's
512) there is no f16 c_kv tile and no conversion pass: the code buffers are
stored swizzled (chunk ``c ^ (row & 7)`` of each 8, as the tiles) and the
fragments are read from them. S's K by ``ldmatrix`` x4 of the codes (a lane's
word is codes ``4 t .. 4 t + 3`` of a k step's 16, converted into its two B
registers; Q's tile holds its c_kv columns in that order, pairs ``(2 L, 2 L +
1)`` for ``L < 8`` else ``(2 L - 14, 2 L - 13)``, which changes no bit: the mma
sums a k step's 16 products in one go). P.V's V by ``ldmatrix`` x4 ``.trans``
of byte pairs (a word: positions ``2 t, 2 t + 1`` of columns ``2 g, 2 g + 1``;
a ``prmt`` pairs each column's positions): one load covers 32 output columns
as n tiles of the even and the odd columns of each 16, which the end writes
back in place. Per tile the block moves about a third fewer shared-memory
bytes than the 16-bit kernel and has no conversion barrier (notes/bench.md).
Per token the tile holds ``fp16(fl32(e4m3(c) s))``, s the code's row's (its
scale varies along P.V's k, so it cannot leave the tile). A thread converts
units of 8 codes (a uint64 load, a 16-byte chunk of the tile stored as two
uint64), a warp 32 consecutive units of a row, so its loads and stores have no
bank conflicts; it converts the same 8 columns of rows ``NTH / (r / 8)`` apart,
its addresses a base plus a constant a unit. Per token, threads below KT load
their row's scale when the tile's copy is issued and store it to shared
memory (``KT`` more words) once the tile has landed. k_pe is copied straight
into two f16 buffers of its ``d_rope`` columns. One more ``__syncthreads`` a
tile (not with ``DIRECT``). A zero-filled row (past the end, a bad page entry)
converts to zeros (its scale taken as 0, never read).

Planted defects (``defect=``, compile-time switches for the tests and the
defect catalogue; without one the kernel is unchanged, its name has no suffix):
    "ldmatrix_no_trans"   V's B fragments loaded by ``ldmatrix`` without
                          ``.trans`` (the same row addresses)
    "swizzle_off_by_one"  latent tiles stored with the swizzle of the next row
                          (``ldmatrix`` reads them with the right one)
    "causal_tile_edge"    a query whose causal end falls on a tile edge (a
                          multiple of 16) sees one more position
    "v_block_stride"      V's B fragments all read from the latent tile's first
                          64-column block (the column block's stride dropped:
                          only ranks past 64, where a warp's r / 4 columns
                          reach a second block, show it)
  and with an fp8 cache (``FP8_DEFECTS``):
    "fp8_scale_twice"     each value multiplied by its scale twice (per tensor:
                          S's c_kv part and O)
    "fp8_no_scale"        the codes' values taken unscaled
    "fp8_scale_wrong_token"  per token: a row converted with the next row's scale
    "fp8_as_e5m2"         the codes decoded as e5m2
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from attention.core.device import (
    SIMULATOR,
    as_device_view,
    device_empty,
    device_fn,
    ensure_dynamic_shared,
    gpu_available,
    jit,
    page_split,
    to_device,
)
from attention.core.warp import fragment_softmax_step, group_max, group_sum, softmax_finish
from attention.decode import fast
from attention.decode.mma import _codes_f16x2, _v_codes_f16x2
from attention.gemm import mma16

from . import attn_gemm as G
from .fp8 import SCALE_MODES as FP8_MODES  # "tensor", "token"

WARP = 32
CB = 64  # columns of a shared column block (8 chunks of 16 bytes: the swizzle's row)
CQ = 4  # column quarters: warps a row group
TILES = (64,)  # positions a latent tile (KT)
ROW_GROUPS = (1, 2, 4)  # row groups of 16 a block (RG)
SMEM_BLOCK_MAX = 232448  # the H100 / H200 opt-in limit of a block's shared memory
SMEM_PER_SM = 233472
DEFECTS = ("ldmatrix_no_trans", "swizzle_off_by_one", "causal_tile_edge", "v_block_stride")
# fp8 cache only (``fp8=``): the dequantization's scale applied twice / not at
# all, the scale of the next cached row (per token), codes decoded as e5m2
FP8_DEFECTS = ("fp8_scale_twice", "fp8_no_scale", "fp8_scale_wrong_token", "fp8_as_e5m2")
# planted in the batch-invariant plan itself (``capacity_plan``): the chunk the
# batch's default plan would take, so the splits follow the batch
PLAN_DEFECTS = ("mla_chunk_follows_batch",)


def check_defect(defect, fp8=None):
    allowed = DEFECTS + (FP8_DEFECTS if fp8 is not None else ())
    if fp8 == "tensor":
        allowed = tuple(d for d in allowed if d != "fp8_scale_wrong_token")
    if defect is not None and defect not in allowed:
        raise ValueError(f"defect: expected None or one of {allowed}, got {defect!r}")


def _codes4(fmt):
    """Device ``codes4(word) -> (v0, v1, v2, v3)``: the float32 values of the four
    fp8 codes of a uint32 word, low byte first (``fmt`` "e4m3"; "e5m2": the
    planted ``fp8_as_e5m2``'s decoding). GPU: ``cvt.rn.f16x2.e4m3x2`` (sm_89 and
    later, exact) then ``cvt.f32.f16``; simulator: a table."""
    if SIMULATOR:
        from attention.cache.fp8 import E4M3_VALUES

        if fmt == "e5m2":  # e5m2 is float16's upper byte
            table = (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)
        else:
            table = E4M3_VALUES

        def codes4(word):
            w = int(word)
            return (float32(table[w & 255]), float32(table[(w >> 8) & 255]),
                    float32(table[(w >> 16) & 255]), float32(table[(w >> 24) & 255]))

        return device_fn(codes4)

    from numba import types
    from numba.cuda.extending import intrinsic

    kind = "f8_e5m2" if fmt == "e5m2" else "f8"

    @intrinsic
    def codes4(typingctx, word):
        sig = types.UniTuple(types.float32, 4)(types.uint32)

        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, sig.return_type,
                                      fast._codes_to_f32(builder, args[0], kind))

        return sig, codegen

    return codes4


def supported(rank, d_rope):
    """None when the kernel takes latent width ``r + d_rope`` and rank ``r``, else why not."""
    width = rank + d_rope
    if width % CB:
        return f"r + d_rope = {width}: expected a multiple of {CB}"
    if rank % (CQ * 16):
        return f"r = {rank}: expected a multiple of {CQ * 16}"
    return None


def smem_words(width, row_groups, tile, fp8=None):
    """uint32 words of a block's dynamic shared memory (module docstring); an fp8
    cache (``fp8`` "tensor" / "token") adds a tile's row scales."""
    rows = 16 * row_groups
    words = rows * width // 2 + 2 * tile * width // 2 + rows * tile // 2 + CQ * rows
    return words + (tile if fp8 is not None else 0)


def sub_word(rows, row, col):
    # word of elements (row, col), (row, col + 1) (col even) of a [rows, W] 16-bit
    # tile stored as column blocks of [rows, CB]
    return (col // CB) * (rows * CB // 2) + mma16.tile_index(row, col % CB, CB)


sub_word = device_fn(sub_word)


@functools.lru_cache(maxsize=None)
def mla_mma_kernel(kind, rank, d_rope, row_groups=4, tile=64, paged=False, defect=None,
                   fp8=None, page_size=None, wgmma=0):
    """The tensor-core MLA attention kernel (module docstring).

    kind: "f16" / "bf16" (the cache's type; "f16" for an fp8 cache); rank: r;
    d_rope; row_groups: RG (1, 2, 4); tile: KT (64); paged: the cache is
    ``[num_pages, P, W]`` read through the page table; page_size (paged only):
    None (P read from the ``page`` argument) or P, compiled in (the ``page``
    and ``shift`` arguments are then ignored: ``launch`` checks the cache's P
    against it). With P a run-time value the RG 4 kernels spilled 124 to 184
    bytes a thread, with it a constant 16 (notes/bench.md); defect: None or one of
    ``DEFECTS`` (and ``FP8_DEFECTS`` with ``fp8``); fp8: None (a 16-bit cache)
    or "tensor" / "token": an fp8 latent cache (``mla.fp8``'s rows of ``r +
    2 d_rope`` bytes) with that scale mode (module docstring, "fp8 cache").

    Grid ``(n_split, ceil(R / 16 RG), B)``, block ``128 RG``, dynamic shared
    memory ``4 smem_words(W, RG, KT, fp8)`` bytes. Arguments:
        qc        [B, R, W] float32
        lat       [N * W / 2] uint32, the cache's words, flat (fp8: [N * RB / 4])
        sc        fp8: float32 scales, flat ([1] per tensor, [N] per token: the
                  scale of cache row n); a 16-bit cache: unused ([1])
        lens      [B] int32
        table     [B, max_pages] int32 (contiguous: [B, 1], the slots)
        page      int32 P (contiguous: max_seq); n_pages: int32 num_pages
                  (contiguous: S); shift: int32 log2(P) or -1
        nh        int32 heads (row i nh + h is query i); s_q: int32
        scale     float32; chunk: int32 positions a split (a multiple of KT)
        o_lat     [B, R, r] f32, lse [B, R] f32 (one split)
        part_acc  [B, R, n_split, r] f32, part_ml [B, R, n_split, 2] f32

    Shared addresses are 32-bit byte offsets from ``mma16.smem_ops``'s base.
    Every ldmatrix of the kernel reads 16-row blocks of 128-byte rows (a
    64-column block of Q, K or V, or the P tile) at chunk ``2 k + lane // 16``,
    so one lane offset serves them all: row ``(lane & 7) | (lane & 8)``, chunk
    ``(lane >> 4) ^ (lane & 7)`` (the swizzle key of a row is ``row & 7``), and
    the k step (or V's chunk pair) is an XOR of a constant.
    """
    why = supported(int(rank), int(d_rope))
    if why is not None:
        raise ValueError(why)
    if row_groups not in ROW_GROUPS or tile not in TILES:
        raise ValueError(f"row_groups, tile: expected {ROW_GROUPS} and {TILES}, "
                         f"got {row_groups}, {tile}")
    if fp8 not in (None,) + FP8_MODES:
        raise ValueError(f"fp8: expected None or one of {FP8_MODES}, got {fp8!r}")
    if fp8 is not None and kind != "f16":
        raise ValueError(f"kind: an fp8 cache is attended in f16, got {kind!r}")
    check_defect(defect, fp8)
    RANK, W, RG, KT = int(rank), int(rank) + int(d_rope), int(row_groups), int(tile)
    # wgmma (attention.gemm.wgmma; sm_90a, and its emulation on the simulator),
    # a 16-bit cache at RG 4 only. Level 1, S = Q K^T: warp group cq (warps 4 cq
    # .. 4 cq + 3, one a row group) multiplies the block's 64 Q rows by its 16
    # positions, 4 W / 64 instructions m64n16k16 a tile reading both operands from
    # their swizzled tiles; its accumulators are each warp's S fragments as
    # mma.sync leaves them. Level 2 adds P.V: the warp group adds the P tile times
    # its quarter's r / 4 latent columns (V read MN-major from the latent tile)
    # onto O's registers, in m64n(r/4)k16 instructions
    if int(wgmma) not in (0, 1, 2):
        raise ValueError(f"wgmma: 0 (off), 1 (S) or 2 (S and P.V), got {wgmma!r}")
    WGS, WGV = int(wgmma) >= 1, int(wgmma) == 2
    if WGS and (RG != 4 or fp8 is not None):
        raise ValueError(f"wgmma: a 16-bit cache at row_groups 4, got row_groups {RG}, "
                         f"fp8 {fp8!r}")
    if WGV and not 8 <= RANK // CQ <= 256:
        raise ValueError(f"wgmma: P.V's n (r / {CQ}) in [8, 256], got rank {RANK}")
    PAGED = bool(paged)
    if page_size is not None and (not PAGED or int(page_size) < 1):
        raise ValueError(f"page_size: a page size >= 1 of a paged kernel, got {page_size!r} "
                         f"(paged={paged!r})")
    PAGE = int(page_size) if page_size is not None else 0  # 0: P at run time
    SHIFT = PAGE.bit_length() - 1 if PAGE & (PAGE - 1) == 0 else -1
    FP8 = fp8 is not None
    PER_TOKEN = fp8 == "token"
    # per tensor: the tile holds the codes' values, the scale goes on the c_kv part
    # of S and on O (module docstring, "fp8 cache")
    TENSOR = fp8 == "tensor"
    # per tensor at a rank that is a power of two >= 128: no f16 tile. S's K and
    # P.V's V fragments are read from the staged codes by ldmatrix (plain and
    # .trans) and converted in registers (module docstring, "fp8 cache")
    DIRECT = TENSOR and RANK >= 128 and RANK & (RANK - 1) == 0
    # times a dequantized value (per tensor: the c_kv part of S, O) is multiplied
    # by its scale (once; the planted fp8_no_scale / fp8_scale_twice: 0 / 2)
    SCALINGS = {"fp8_no_scale": 0, "fp8_scale_twice": 2}.get(defect, 1)
    WRONG_TOKEN = defect == "fp8_scale_wrong_token"
    NO_TRANS = defect == "ldmatrix_no_trans"
    SWIZZLE_OFF = defect == "swizzle_off_by_one"
    CAUSAL_EDGE = defect == "causal_tile_edge"
    V_BLOCK = 0 if defect == "v_block_stride" else KT * 128  # V's column-block stride (KBLK)
    # derive the lane's offsets again on every tile (module docstring, Registers):
    # at RG 4 only; with fewer threads the registers hold them (at RG 2 the
    # 16-bit kernel ran 13 % slower at 16 heads with it: notes/bench.md)
    REMAT = RG == 4

    ROWS = 16 * RG
    NTH = CQ * RG * WARP
    WR = W // 2  # words a latent row
    CPR = W // 8  # 16-byte chunks a latent row
    NCB = W // CB  # 64-column blocks of a row
    NCOL = RANK // CQ  # output columns a warp (a multiple of 16)
    NT = NCOL // 8  # mma n tiles of a warp's O
    N_O = 4 * NT
    COPIES = -(-KT * CPR // NTH)  # chunks of a tile a thread copies (at most)
    # a whole tile (``issue``): threads below RSC CPR copy one chunk of every RSC-th row
    RSC = NTH // CPR  # (0: rows wider than NTH chunks, the checked copies only)
    FULL_COPIES = -(-KT // RSC) if RSC else 0
    ROW_STEP, CHUNK_STEP = NTH // CPR, NTH % CPR  # a thread's next chunk: + NTH
    # byte offsets in shared memory
    QB = ROWS * W * 2  # the Q tile
    LATB = KT * W * 2  # a latent tile
    Q0B = 0
    LAT0B = QB
    P0B = LAT0B + 2 * LATB  # the P tile [ROWS, KT] 16-bit
    RED = (P0B + ROWS * KT * 2) // 4  # float32 words: [CQ, ROWS]
    SCL = RED + CQ * ROWS  # fp8: float32 words [KT], the converted tile's row scales
    QBLK = ROWS * 128  # bytes a 64-column block of Q
    KBLK = KT * 128  # ... of a latent tile

    # fp8 cache: rows of RB bytes; a tile's codes are staged (cp.async, two
    # buffers of [KT, r] bytes) and converted into one f16 tile of the r c_kv
    # columns; k_pe (16-bit in the row) is copied straight into two buffers of
    # its d_rope columns. Same total bytes as the two 16-bit tiles. The
    # conversion's unit is 8 codes (a uint64 of a staged row, one 16-byte chunk
    # of the f16 tile); a warp converts 32 consecutive units of one row, so its
    # loads and stores are free of bank conflicts.
    DROPE = int(d_rope)
    WRB = (RANK + 2 * DROPE) // 4  # words an fp8 row
    CPRN = RANK // 16  # 16-byte chunks of codes a row
    CPRR = max(1, DROPE // 8)  # 16-byte chunks of k_pe a row
    COPIES_N = -(-KT * CPRN // NTH)
    UPR = RANK // 8  # conversion units a row
    UNITS = -(-KT * UPR // NTH)  # units of a tile a thread converts (at most)
    # where NTH is a multiple of UPR a thread converts the same 8 columns of rows
    # RS apart (every plan's shape: UPR <= 64 divides 128): its addresses are a
    # base plus k times a constant, derived once a tile
    FIXED_COLS = NTH % UPR == 0
    RS = NTH // UPR if FIXED_COLS else 0
    COPIES_R = -(-KT * CPRR // NTH) if DROPE else 0
    ROW_STEP_N, CHUNK_STEP_N = NTH // CPRN, NTH % CPRN
    RSN, RSR = NTH // CPRN, NTH // CPRR  # a whole tile's copies (issue8), as RSC
    FULL_N = -(-KT // RSN) if RSN else 0
    FULL_R = -(-KT // RSR) if RSR else 0
    ROW_STEP_R, CHUNK_STEP_R = NTH // CPRR, NTH % CPRR
    NCBN = RANK // CB  # column blocks of c_kv
    NOPE0B = QB  # the f16 c_kv tile [KT, r]
    ROPE0B = NOPE0B + KT * RANK * 2  # two k_pe tiles [KT, d_rope]
    ROPEB = KT * DROPE * 2
    STG0B = ROPE0B + 2 * ROPEB  # two code buffers [KT, r] bytes
    STGB = KT * RANK
    if FP8:
        assert STG0B + 2 * STGB == P0B

    NC16 = NCOL // 16  # DIRECT: 16-code chunks of a warp's output columns
    # DIRECT, the planted v_block_stride: V's chunk bits past a 64-column block dropped
    VMASK = 3 if defect == "v_block_stride" else 0x7FFFFFFF

    mma, pack = mma16.ops(kind)
    if WGS:
        from attention.gemm import wgmma as WG

        wdesc = WG.descriptor()
        fence_async = WG.fence_async()
        s_tile = WG.tile_product(kind, 16, NCB, QBLK, KBLK)
        if WGV:  # V MN-major, 64-column blocks V_BLOCK apart (the descriptor's LBO)
            pv_tile = WG.tile_accumulate(kind, NCOL, KT // 16, 0 if NO_TRANS else 1)
            vdesc = WG.descriptor(V_BLOCK)
    shared_base, ld_x4, ld_x4_trans, copy, commit, _, wait_all = mma16.smem_ops()
    codes4 = _codes4("e5m2" if defect == "fp8_as_e5m2" else "e4m3")
    codes_f16x2 = _codes_f16x2("e5m2" if defect == "fp8_as_e5m2" else "e4m3")
    # an ldmatrix .trans word of byte pairs as the f16x2 pairs of its two columns
    v_codes_f16x2 = _v_codes_f16x2("e5m2" if defect == "fp8_as_e5m2" else "e4m3")

    def chunk_at(row, c):
        # byte offset of 16-byte chunk c of row `row` in a tile stored as 64-column
        # blocks of [KT, 64] (the layout of every latent tile: swizzle key row & 7;
        # the planted swizzle_off_by_one: the next row's)
        key = row & 7
        if SWIZZLE_OFF:
            key = (row + 1) & 7
        return (c >> 3) * KBLK + row * 128 + (((c & 7) ^ key) << 4)

    chunk_at = device_fn(chunk_at)

    def code_at(row, c):
        # byte offset of 16-byte chunk c of row `row` in a code buffer [KT, r]: with
        # DIRECT swizzled as the tiles (chunk c ^ (row & 7) within each 8; the planted
        # swizzle_off_by_one: the next row's key), so ldmatrix reads 8 rows of one
        # chunk from 8 bank groups; else row-major
        if DIRECT:
            key = row & 7
            if SWIZZLE_OFF:
                key = (row + 1) & 7
            return row * RANK + ((c ^ key) << 4)
        return row * RANK + 16 * c

    code_at = device_fn(code_at)

    def tile_row(table, seq, tile0, end, page, shift, n_pages, slot_row):
        # cache row of position tile0 when the tile's KT positions are KT consecutive
        # rows: a contiguous cache, or pages of a multiple of KT rows (tile0 is a
        # multiple of KT, so the tile lies in one page: one page-table read a tile,
        # not one a copied chunk); -1: a bad page entry or no position below end;
        # -2: smaller pages, each row looked up (pos_row)
        if PAGED:
            if page % KT != 0:
                return int64(-2)
            if tile0 >= end:
                return int64(-1)
            j, off = page_split(tile0, page, shift)
            pg = int64(table[seq, j])
            if pg < 0 or pg >= n_pages:
                return int64(-1)
            return pg * page + off
        return slot_row + int64(tile0)

    tile_row = device_fn(tile_row)

    def next_chunk(row, c, row_step, chunk_step, per_row):
        # the chunk NTH chunks on from (row, c) in rows of per_row chunks
        row += row_step
        c += chunk_step
        if c >= per_row:
            c -= per_row
            row += 1
        return row, c

    next_chunk = device_fn(next_chunk)

    def issue(smem, sbase, lat, table, seq, page, shift, n_pages, slot_row, tile0, end, kb,
              row, c):
        # start copying the latent rows of positions tile0 .. tile0 + KT - 1 into the
        # tile at byte kb (rows at or past end: zeros); this thread's chunks are
        # (row, c), then NTH chunks on each time
        tb = tile_row(table, seq, tile0, end, page, shift, n_pages, slot_row)
        if RSC > 0 and tb >= 0 and tile0 + KT <= end:
            # a whole tile of consecutive cache rows (the common case): no position
            # checks, and each thread below RSC CPR copies chunk c of rows row + RSC a
            # (row, c: its first chunk), its source a constant step on (the per-chunk
            # checks and index arithmetic were about as many instructions as the
            # tile's mma work: notes/bench.md)
            if row < RSC:
                src = (tb + row) * WR + 4 * c
                for a in range(FULL_COPIES):
                    if KT % RSC == 0 or row < KT:
                        copy(smem, sbase + kb + chunk_at(row, c), lat, src)
                    row += RSC
                    src += RSC * WR
            return
        for a in range(COPIES):
            if KT * CPR % NTH == 0 or row < KT:
                dst = kb + chunk_at(row, c)
                pos = tile0 + row
                ri = pos_row(tb, row, table, seq, pos, end, page, shift, n_pages)
                if ri >= 0:
                    copy(smem, sbase + dst, lat, ri * WR + 4 * c)
                else:
                    for x in range(4):
                        smem[(dst >> 2) + x] = uint32(0)
            row, c = next_chunk(row, c, ROW_STEP, CHUNK_STEP, CPR)

    issue = device_fn(issue)

    def pos_row(tb, row, table, seq, pos, end, page, shift, n_pages):
        # cache row of the tile's row `row` (position pos; tb: tile_row's); -1: none
        # (at or past end, or a bad page entry: the row reads as zeros)
        if pos >= end or tb == -1:
            return int64(-1)
        if tb >= 0:
            return tb + row
        if PAGED:
            j, off = page_split(pos, page, shift)
            pg = int64(table[seq, j])
            if pg >= 0 and pg < n_pages:
                return pg * page + off
        return int64(-1)

    pos_row = device_fn(pos_row)


    def issue8(smem, sbase, lat, sc, table, seq, page, shift, n_pages, slot_row, tile0,
               end, nb, tid):
        # fp8: start copying tile tile0's codes into code buffer nb and its k_pe into
        # k_pe buffer nb (rows at or past end, or of a bad page entry: zeros); the
        # thread's code chunks are (row, c), then NTH chunks on each time. Returns,
        # per token, the scale of the tile's row tid (threads below KT; 0 for a
        # zero row; it lands while the tile is in flight and goes to shared memory
        # when the tile has landed), else 0.
        tb = tile_row(table, seq, tile0, end, page, shift, n_pages, slot_row)
        s_row = float32(0.0)
        if PER_TOKEN and tid < KT:
            ri = pos_row(tb, tid, table, seq, tile0 + tid, end, page, shift, n_pages)
            if ri >= 0:
                if WRONG_TOKEN:
                    ri = min(ri + 1, int64(sc.shape[0] - 1))
                s_row = sc[ri]
        if RSN > 0 and RSR > 0 and tb >= 0 and tile0 + KT <= end:
            # a whole tile of consecutive cache rows: as ``issue``'s, each thread one
            # chunk of every RSN-th row (codes) and of every RSR-th row (k_pe)
            row = tid // CPRN
            c = tid % CPRN
            if row < RSN:
                src = (tb + row) * WRB + 4 * c
                for a in range(FULL_N):
                    if KT % RSN == 0 or row < KT:
                        copy(smem, sbase + STG0B + nb * STGB + code_at(row, c), lat, src)
                    row += RSN
                    src += RSN * WRB
            row = tid // CPRR
            c = tid % CPRR
            if DROPE > 0 and row < RSR:
                src = (tb + row) * WRB + RANK // 4 + 4 * c
                for a in range(FULL_R):
                    if KT % RSR == 0 or row < KT:
                        copy(smem, sbase + ROPE0B + nb * ROPEB + chunk_at(row, c), lat, src)
                    row += RSR
                    src += RSR * WRB
            return s_row
        row = tid // CPRN
        c = tid % CPRN
        for a in range(COPIES_N):
            if KT * CPRN % NTH == 0 or row < KT:
                dst = STG0B + nb * STGB + code_at(row, c)
                pos = tile0 + row
                ri = pos_row(tb, row, table, seq, pos, end, page, shift, n_pages)
                if ri >= 0:
                    copy(smem, sbase + dst, lat, ri * WRB + 4 * c)
                else:
                    for x in range(4):
                        smem[(dst >> 2) + x] = uint32(0)
            row, c = next_chunk(row, c, ROW_STEP_N, CHUNK_STEP_N, CPRN)
        row = tid // CPRR
        c = tid % CPRR
        for a in range(COPIES_R):
            if KT * CPRR % NTH == 0 or row < KT:
                dst = ROPE0B + nb * ROPEB + chunk_at(row, c)
                pos = tile0 + row
                ri = pos_row(tb, row, table, seq, pos, end, page, shift, n_pages)
                if ri >= 0:
                    copy(smem, sbase + dst, lat, ri * WRB + RANK // 4 + 4 * c)
                else:
                    for x in range(4):
                        smem[(dst >> 2) + x] = uint32(0)
            row, c = next_chunk(row, c, ROW_STEP_R, CHUNK_STEP_R, CPRR)
        return s_row

    issue8 = device_fn(issue8)

    def convert_unit(smem64, smf, nb, row, p):
        # fp8: unit (row, p) of code buffer nb, codes 8 p .. 8 p + 7 of the row: a
        # uint64 load, one 16-byte chunk of the f16 tile stored as two uint64 (the
        # half of odd column blocks first: the 16 lanes of a store cover the 32
        # banks). Per tensor the codes' values (exact in f16); per token
        # fp16(fl32(e4m3(c) s)), s the row's from the scale words SCL. Indices
        # unsigned (no negative-index wraparound): uint64 words
        src = uint64((STG0B + nb * STGB) // 8 + row * (RANK // 8) + p)
        dst = uint64((NOPE0B + chunk_at(row, p)) >> 3)
        codes = smem64[src]
        first = (p >> 3) & 1  # the half stored first
        if PER_TOKEN:
            s = smf[SCL + row]
        for hh in range(2):
            h = hh ^ first  # codes 4 h .. 4 h + 3 -> the chunk's half h
            word = uint32((codes >> uint64(32 * h)) & uint64(0xFFFFFFFF))
            if PER_TOKEN:
                v0, v1, v2, v3 = codes4(word)
                for _ in range(SCALINGS):
                    v0 = float32(v0 * s)
                    v1 = float32(v1 * s)
                    v2 = float32(v2 * s)
                    v3 = float32(v3 * s)
                lo = pack(v0, v1)
                hi = pack(v2, v3)
            else:
                lo, hi = codes_f16x2(word)
            smem64[dst + uint64(h)] = uint64(lo) | (uint64(hi) << uint64(32))

    convert_unit = device_fn(convert_unit)

    def convert8(smem64, smf, nb, tid):
        # fp8: code buffer nb into the f16 c_kv tile (module docstring). Unit u =
        # tid + NTH k is row u // UPR, codes 8 (u % UPR) ..; with FIXED_COLS that
        # is row tid // UPR + RS k, the same codes of each row
        if FIXED_COLS:
            row0 = tid // UPR
            p = tid % UPR
            for k in range(UNITS):
                row = row0 + RS * k
                if KT % RS == 0 or row < KT:
                    convert_unit(smem64, smf, nb, row, p)
        else:
            for k in range(UNITS):
                u = tid + NTH * k
                if KT * UPR % NTH == 0 or u < KT * UPR:
                    convert_unit(smem64, smf, nb, u // UPR, u % UPR)

    convert8 = device_fn(convert8)

    def scale8(sc, c0, c1, c2, c3, d0, d1, d2, d3):
        # per tensor: the c_kv part of 8 scores times the scale (SCALINGS times)
        for _ in range(SCALINGS):
            c0 = float32(c0 * sc)
            c1 = float32(c1 * sc)
            c2 = float32(c2 * sc)
            c3 = float32(c3 * sc)
            d0 = float32(d0 * sc)
            d1 = float32(d1 * sc)
            d2 = float32(d2 * sc)
            d3 = float32(d3 * sc)
        return c0, c1, c2, c3, d0, d1, d2, d3

    scale8 = device_fn(scale8)

    def warp_place(warp):
        # (rg, cq) of a warp: row group and column quarter; with WGS the 4 warps of a
        # warp group are the 4 row groups of one quarter (wgmma's rows 16 w ..)
        if WGS:
            return warp % RG, warp // RG
        return warp // CQ, warp % CQ

    warp_place = device_fn(warp_place)

    def lane_offsets(t):
        # thread t's shared byte offsets for ldmatrix (a_lane: the x4 row address of
        # its lane; Q's, K's and P's from it: the XORs of a k step act on the
        # offset's chunk bits, then the base is added), its first row of the block
        # (lrow; and lrow + 8), its P tile words (lrow, chunk) (+ 256: lrow + 8) and
        # their swizzle key
        lane = t % WARP
        warp = t // WARP
        rg, cq = warp_place(warp)
        a_lane = ((lane & 7) | (lane & 8)) * 128 + (((lane >> 4) ^ (lane & 7)) << 4)
        lrow = rg * 16 + lane // 4
        return (a_lane, Q0B + rg * 16 * 128 + a_lane, cq * 16 * 128 + a_lane,
                P0B + rg * 16 * 128 + a_lane, lrow, P0B // 4 + lrow * 32 + lane % 4,
                lrow & 7)

    lane_offsets = device_fn(lane_offsets)

    def code_offsets(t):
        # DIRECT: thread t's byte offsets in a code buffer for ldmatrix x4 at its
        # lane's row (lane & 7) | (lane & 8) and chunk lane >> 4 of a chunk pair,
        # swizzled (code_at; the key is lane & 7): K's, rows its warp's 16
        # positions (a chunk pair 2 j: XOR 2 j << 4), and V's, rows a k step's 16
        # positions, chunks from its warp's first output column (NC16 a power of
        # two, so the warp's chunk bits and a chunk pair's are apart: XOR 2 q << 4)
        lane = t % WARP
        _, cq = warp_place(t // WARP)
        r16 = (lane & 7) | (lane & 8)
        sw = (lane >> 4) ^ (lane & 7)
        k8 = (cq * 16 + r16) * RANK + (sw << 4)
        v8 = r16 * RANK + ((((cq * NC16) & VMASK) ^ sw) << 4)
        return k8, v8

    code_offsets = device_fn(code_offsets)

    def s_codes(smem, qa, ka, c0, c1, c2, c3, d0, d1, d2, d3):
        # DIRECT: S's k steps 2 j, 2 j + 1 of a c_kv column block (qa: Q's first at
        # the lane's shared address; ka: the codes', from k8_lane). Code words 0,
        # 1 are the warp's two 8-position halves at the first k step, 2, 3 at the
        # second (codes 4 t .. 4 t + 3 of a 16: b0 = 4 t, 4 t + 1, b1 = the next
        # two; Q's tile holds its columns in that order, see the kernel's Q)
        a0, a1, a2, a3 = ld_x4(smem, qa)
        e0, e1, e2, e3 = ld_x4(smem, qa ^ 32)
        w0, w1, w2, w3 = ld_x4(smem, ka)
        b0, b1 = codes_f16x2(w0)
        b2, b3 = codes_f16x2(w1)
        c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b2, b3, d0, d1, d2, d3)
        b0, b1 = codes_f16x2(w2)
        b2, b3 = codes_f16x2(w3)
        c0, c1, c2, c3 = mma(e0, e1, e2, e3, b0, b1, c0, c1, c2, c3)
        d0, d1, d2, d3 = mma(e0, e1, e2, e3, b2, b3, d0, d1, d2, d3)
        return c0, c1, c2, c3, d0, d1, d2, d3

    s_codes = device_fn(s_codes)

    def pv_codes(smem, va, p0, p1, p2, p3, o, n):
        # DIRECT: O += P V over 32 output columns of one k step, V's fragments by
        # ldmatrix .trans of the codes at va (a word: positions 2 t, 2 t + 1 of
        # columns 2 g, 2 g + 1; v_codes_f16x2): o[n ..] the even columns of the
        # first 16, o[n + 4 ..] the odd, o[n + 8 ..], o[n + 12 ..] the second 16's
        if NO_TRANS:
            w0, w1, w2, w3 = ld_x4(smem, va)
        else:
            w0, w1, w2, w3 = ld_x4_trans(smem, va)
        e0, f0 = v_codes_f16x2(w0)
        e1, f1 = v_codes_f16x2(w1)
        o[n], o[n + 1], o[n + 2], o[n + 3] = mma(
            p0, p1, p2, p3, e0, e1, o[n], o[n + 1], o[n + 2], o[n + 3])
        o[n + 4], o[n + 5], o[n + 6], o[n + 7] = mma(
            p0, p1, p2, p3, f0, f1, o[n + 4], o[n + 5], o[n + 6], o[n + 7])
        e0, f0 = v_codes_f16x2(w2)
        e1, f1 = v_codes_f16x2(w3)
        o[n + 8], o[n + 9], o[n + 10], o[n + 11] = mma(
            p0, p1, p2, p3, e0, e1, o[n + 8], o[n + 9], o[n + 10], o[n + 11])
        o[n + 12], o[n + 13], o[n + 14], o[n + 15] = mma(
            p0, p1, p2, p3, f0, f1, o[n + 12], o[n + 13], o[n + 14], o[n + 15])

    pv_codes = device_fn(pv_codes)

    # DIRECT: the c_kv part of S and the tile's P V written out (generated source,
    # every offset a constant: as loops the compiler kept them rolled)
    s_nope = pv_all = None
    if DIRECT:
        lines = ["def s_nope(smem, sbase, q_lane, kbase, k8, c0, c1, c2, c3, d0, d1, d2, d3):"]
        for cb in range(NCBN):
            for j in range(2):
                lines.append(f"    c0, c1, c2, c3, d0, d1, d2, d3 = s_codes(smem, sbase + "
                             f"((q_lane + {cb * QBLK}) ^ {64 * j}), kbase + (k8 ^ "
                             f"{(4 * cb + 2 * j) << 4}), c0, c1, c2, c3, d0, d1, d2, d3)")
        lines.append("    return c0, c1, c2, c3, d0, d1, d2, d3")
        lines.append("def pv_all(smem, sbase, p_lane, vbase, v8, o):")
        for kk in range(KT // 16):
            lines.append(f"    p0, p1, p2, p3 = ld_x4(smem, sbase + (p_lane ^ {32 * kk}))")
            for q in range(NT // 4):
                lines.append(f"    pv_codes(smem, vbase + {kk * 16 * RANK} + (v8 ^ "
                             f"{((2 * q) & VMASK) << 4}), p0, p1, p2, p3, o, {16 * q})")
        space = {"s_codes": s_codes, "pv_codes": pv_codes, "ld_x4": ld_x4}
        exec("\n".join(lines), space)  # noqa: S102 - fixed text built above
        s_nope = device_fn(space["s_nope"])
        pv_all = device_fn(space["pv_all"])

    def row_limit(row, n_rows, nh, s_q, length, end):
        # positions below this are seen by query row `row` (0 for a padded row)
        if row >= n_rows:
            return 0
        lim = length - s_q + 1 + int64(row // nh)  # signed (row: unsigned)
        if CAUSAL_EDGE and lim % 16 == 0:
            lim += 1
        return min(lim, end)

    row_limit = device_fn(row_limit)

    def kernel(qc, lat, sc, lens, table, page, n_pages, shift, nh, s_q, scale, chunk,
               o_lat, lse, part_acc, part_ml):
        split = uint32(cuda.blockIdx.x)
        rb = uint32(cuda.blockIdx.y)
        seq = uint32(cuda.blockIdx.z)
        n_split = cuda.gridDim.x
        tid = uint32(cuda.threadIdx.x)
        warp = tid // WARP
        lane = tid % WARP
        tq = lane % 4
        rg, cq = warp_place(warp)
        n_rows = qc.shape[1]
        smem = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)
        sbase = shared_base(smem)

        if PAGE:  # the page size compiled in (the arguments ignored)
            page = int32(PAGE)
            shift = int32(SHIFT)
        # -- the sequence's length and rows (the device guard) --
        length = lens[seq]
        slot_row = int64(0)
        cap = page
        if PAGED:
            cap = table.shape[1] * page
        else:
            slot = table[seq, 0]
            if slot < 0 or slot >= n_pages:
                length = 0
                slot = 0
            slot_row = int64(slot) * page
        if length < 0 or length > cap or (s_q > 1 and 0 < length < s_q):
            length = 0
        start = split * chunk
        end = min(length, start + chunk)
        n_tiles = (end - start + KT - 1) // KT if end > start else 0
        crow = tid // CPR  # this thread's first chunk of a tile
        cc = tid % CPR
        smem64 = cuda.shared.array(0, uint64)
        s_next = float32(0.0)  # fp8 per token: the scale of the next tile's row tid
        s_all = float32(1.0)
        if FP8 and not PER_TOKEN:
            s_all = sc[0]
        if n_tiles > 0:  # the first tile's copies go out before Q is staged
            if FP8:
                s_next = issue8(smem, sbase, lat, sc, table, seq, page, shift, n_pages,
                                slot_row, start, end, 0, tid)
            else:
                issue(smem, sbase, lat, table, seq, page, shift, n_pages, slot_row, start,
                      end, LAT0B, crow, cc)
        commit()

        # -- Q [16 RG, W] rounded to 16 bits into its tile (rows past R: zeros) --
        first = rb * ROWS
        for w in range(tid, ROWS * WR, NTH):
            r = w // WR
            col = 2 * (w % WR)
            word = uint32(0)
            if first + r < n_rows:
                src = col
                if DIRECT and col < RANK:
                    # c_kv's k step holds columns 4 t .. 4 t + 3 of its 16 where the
                    # mma reads 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (a code word's four,
                    # ldmatrix's lane t): Q's pair (L, L + 1) of the 16 is the
                    # codes' (2 L, 2 L + 1) for L < 8, else (2 L - 14, 2 L - 13)
                    lo = col & 15
                    src = col - lo + (2 * lo if lo < 8 else 2 * lo - 14)
                word = pack(qc[seq, first + r, src], qc[seq, first + r, src + 1])
            smem[Q0B // 4 + sub_word(ROWS, r, col)] = word

        # -- the lane's ldmatrix offsets (docstring) and its P tile words --
        a_lane, q_lane, k_lane, p_lane, lrow, p_word, p_key = lane_offsets(tid)
        k8_lane = v8_lane = uint32(0)
        if DIRECT:
            k8_lane, v8_lane = code_offsets(tid)

        # -- the lane's rows (g, g + 8 of its row group): limits, running state --
        lim0 = row_limit(first + lrow, n_rows, nh, s_q, length, end)
        lim1 = row_limit(first + lrow + 8, n_rows, nh, s_q, length, end)
        active = first + rg * 16 < n_rows  # the warp's row group holds a query row
        m0 = float32(-math.inf)
        m1 = float32(-math.inf)
        l0 = float32(0.0)
        l1 = float32(0.0)
        o = cuda.local.array(N_O, float32)
        for x in range(N_O):
            o[x] = float32(0.0)
        s = cuda.local.array(8, float32)
        for x in range(8):
            s[x] = float32(-math.inf)

        for it in range(n_tiles):
            # RG 4: the lane's offsets again, from tid plus an opaque zero (it &
            # 2^30): as loop invariants the compiler kept them in registers, which
            # at 128 a thread it spilled, and a refill misses the L1 (shared memory
            # takes nearly all of it: notes/bench.md)
            tid_z = tid
            if REMAT:
                tid_z = tid + (it & 0x40000000)
                a_lane, q_lane, k_lane, p_lane, lrow, p_word, p_key = lane_offsets(tid_z)
                if DIRECT:
                    k8_lane, v8_lane = code_offsets(tid_z)
            wait_all()  # this thread's copies of tile it have landed
            if WGS:  # (and Q's stores) visible to the wgmma's async proxy
                fence_async()
            if PER_TOKEN and tid < KT:
                smf[SCL + tid] = s_next  # (the last tile's conversion read them)
            cuda.syncthreads()  # ... every thread's; tile it - 1's buffer and P are free
            kdelta = 0  # fp8: the k_pe column blocks' offset from the c_kv ones'
            if FP8:
                if it + 1 < n_tiles:
                    s_next = issue8(smem, sbase, lat, sc, table, seq, page, shift, n_pages,
                                    slot_row, start + (it + 1) * KT, end, (it + 1) % 2, tid_z)
                commit()
                if not DIRECT:
                    convert8(smem64, smf, it % 2, tid_z)
                    cuda.syncthreads()  # the f16 c_kv tile is complete
                # (kb opaque to the compiler, it & 2^30 being 0: a constant kb let it
                # hoist every V fragment's address out of the tile loop, and spill them)
                kb = NOPE0B + (it & 0x40000000)
                kdelta = ROPE0B + (it % 2) * ROPEB - NOPE0B - NCBN * KBLK
                cbuf = STG0B + (it % 2) * STGB  # DIRECT: tile it's codes
            else:
                cbuf = 0
                if it + 1 < n_tiles:
                    issue(smem, sbase, lat, table, seq, page, shift, n_pages, slot_row,
                          start + (it + 1) * KT, end, LAT0B + ((it + 1) % 2) * LATB,
                          tid_z // CPR if REMAT else crow, tid_z % CPR if REMAT else cc)
                commit()
                kb = LAT0B + (it % 2) * LATB
            tile0 = start + it * KT

            # -- S = Q K^T over the warp's 16 positions tile0 + 16 cq .. --
            w0 = w1 = w2 = w3 = w4 = w5 = w6 = w7 = float32(0.0)
            if WGS:  # the warp group, every warp (wgmma is a warp-group instruction)
                w0, w1, w2, w3, w4, w5, w6, w7 = s_tile(
                    smem, wdesc(sbase + Q0B), wdesc(sbase + kb + cq * 16 * 128))
            if active:
                c0 = c1 = c2 = c3 = float32(0.0)
                d0 = d1 = d2 = d3 = float32(0.0)
                cb0 = 0  # the first column block of the loop below
                if WGS:  # accumulator i: n tile i // 4, as c0 .. c3, d0 .. d3
                    c0, c1, c2, c3, d0, d1, d2, d3 = w0, w1, w2, w3, w4, w5, w6, w7
                    cb0 = NCB
                if DIRECT:  # c_kv from the codes (s_nope)
                    c0, c1, c2, c3, d0, d1, d2, d3 = s_nope(
                        smem, sbase, q_lane, sbase + cbuf, k8_lane, c0, c1, c2, c3, d0, d1,
                        d2, d3)
                    cb0 = NCBN
                for cb in range(cb0, NCB):
                    if TENSOR and cb == NCBN:  # the c_kv part times the tensor's scale
                        c0, c1, c2, c3, d0, d1, d2, d3 = scale8(
                            s_all, c0, c1, c2, c3, d0, d1, d2, d3)
                    qa = q_lane + cb * QBLK
                    ka = k_lane + kb + cb * KBLK
                    if FP8 and cb >= NCBN:
                        ka += kdelta
                    for ks in range(4):
                        a0, a1, a2, a3 = ld_x4(smem, sbase + (qa ^ (32 * ks)))
                        k0, k1, k2, k3 = ld_x4(smem, sbase + (ka ^ (32 * ks)))
                        c0, c1, c2, c3 = mma(a0, a1, a2, a3, k0, k2, c0, c1, c2, c3)
                        d0, d1, d2, d3 = mma(a0, a1, a2, a3, k1, k3, d0, d1, d2, d3)
                if TENSOR and NCBN == NCB:  # no k_pe columns
                    c0, c1, c2, c3, d0, d1, d2, d3 = scale8(
                        s_all, c0, c1, c2, c3, d0, d1, d2, d3)
                s[0], s[1], s[2], s[3] = c0, c1, c2, c3
                s[4], s[5], s[6], s[7] = d0, d1, d2, d3
                # scale and mask: s[4 h + e] row g, s[4 h + 2 + e] row g + 8,
                # position tile0 + 16 cq + 8 h + 2 tq + e
                for h in range(2):
                    for e in range(2):
                        pos = tile0 + cq * 16 + 8 * h + 2 * tq + e
                        x = float32(s[4 * h + e] * scale)
                        if pos >= lim0:
                            x = float32(-math.inf)
                        s[4 * h + e] = x
                        y = float32(s[4 * h + 2 + e] * scale)
                        if pos >= lim1:
                            y = float32(-math.inf)
                        s[4 * h + 2 + e] = y
                # the rows' maxima over the warp's positions (the quad), to shared memory
                t0 = group_max(max(max(s[0], s[1]), max(s[4], s[5])), 4)
                t1 = group_max(max(max(s[2], s[3]), max(s[6], s[7])), 4)
                if tq == 0:
                    smf[RED + cq * ROWS + lrow] = t0
                    smf[RED + cq * ROWS + lrow + 8] = t1
            cuda.syncthreads()  # the row maxima of the tile are complete

            if active:
                # -- online softmax: the row group's 4 warps take the same max --
                new0 = m0
                new1 = m1
                for c in range(CQ):
                    new0 = max(new0, smf[RED + c * ROWS + lrow])
                    new1 = max(new1, smf[RED + c * ROWS + lrow + 8])
                l0, l1 = fragment_softmax_step(s, o, N_O, m0, m1, l0, l1, new0, new1)
                m0 = new0
                m1 = new1
                # -- P rounded to 16 bits into the P tile [ROWS, KT]: chunk 2 cq + h --
                for h in range(2):
                    pw = p_word + ((((2 * cq + h) ^ p_key)) << 2)
                    smem[pw] = pack(s[4 * h], s[4 * h + 1])
                    smem[pw + 256] = pack(s[4 * h + 2], s[4 * h + 3])
            if WGV:  # (the P tile's stores, for the wgmma below)
                fence_async()
            cuda.syncthreads()  # the P tile is complete

            # -- O += P V over the warp's columns NCOL cq .. (two n tiles a load) --
            if WGV:  # the warp group, every warp: its quarter's columns
                col = cq * NCOL
                pv_tile(smem, wdesc(sbase + P0B),
                        vdesc(sbase + kb + (col >> 6) * V_BLOCK + (col & 63) * 2), o)
            elif active and DIRECT:
                # V straight from the codes (pv_all, pv_codes): a load covers 32
                # columns, n tiles of the even and the odd columns of each 16
                # (o[16 q + 4 (2 b + odd) ..]: the warp's columns 32 q + 16 b + 4 tq
                # + odd and + 2; the end writes them so)
                pv_all(smem, sbase, p_lane, sbase + cbuf, v8_lane, o)
            elif active:
                for kk in range(KT // 16):
                    p0, p1, p2, p3 = ld_x4(smem, sbase + (p_lane ^ (32 * kk)))
                    for nd2 in range(NT // 2):
                        col = cq * NCOL + 16 * nd2
                        va = sbase + ((a_lane + kb + (col >> 6) * V_BLOCK + kk * 16 * 128)
                                      ^ (((col >> 3) & 7) << 4))
                        if NO_TRANS:
                            b0, b1, b2, b3 = ld_x4(smem, va)
                        else:
                            b0, b1, b2, b3 = ld_x4_trans(smem, va)
                        n = 8 * nd2
                        o[n], o[n + 1], o[n + 2], o[n + 3] = mma(
                            p0, p1, p2, p3, b0, b1, o[n], o[n + 1], o[n + 2], o[n + 3])
                        o[n + 4], o[n + 5], o[n + 6], o[n + 7] = mma(
                            p0, p1, p2, p3, b2, b3, o[n + 4], o[n + 5], o[n + 6], o[n + 7])

        # -- the row sums over the quad and the row group's warps --
        l0 = group_sum(l0, 4)
        l1 = group_sum(l1, 4)
        cuda.syncthreads()  # every warp has read the last tile's maxima
        if tq == 0:
            smf[RED + cq * ROWS + lrow] = l0
            smf[RED + cq * ROWS + lrow + 8] = l1
        cuda.syncthreads()
        tot0 = float32(0.0)
        tot1 = float32(0.0)
        for c in range(CQ):
            tot0 = float32(tot0 + smf[RED + c * ROWS + lrow])
            tot1 = float32(tot1 + smf[RED + c * ROWS + lrow + 8])

        # -- out: one split normalises, more write the partial --
        single = n_split == 1
        for half in range(2):
            row = first + lrow + 8 * half
            if row < n_rows:
                m = m0 if half == 0 else m1
                tot = tot0 if half == 0 else tot1
                inv, lse_r = softmax_finish(m, tot)  # (0, -inf) for an empty row
                if cq == 0 and tq == 0:
                    if single:
                        lse[seq, row] = lse_r
                    else:
                        part_ml[seq, row, split, 0] = m
                        part_ml[seq, row, split, 1] = tot
                for nd in range(NT):
                    col = cq * NCOL + nd * 8 + 2 * tq
                    step = 1  # x0, x1: columns col, col + step
                    if DIRECT:  # (the P.V loop's n tiles of even and odd columns)
                        col = cq * NCOL + (nd >> 1) * 16 + 4 * tq + (nd & 1)
                        step = 2
                    x0 = o[4 * nd + 2 * half]
                    x1 = o[4 * nd + 2 * half + 1]
                    if TENSOR:  # O over the codes' values, times the tensor's scale
                        for _ in range(SCALINGS):
                            x0 = float32(x0 * s_all)
                            x1 = float32(x1 * s_all)
                    if single:
                        o_lat[seq, row, col] = x0 * inv
                        o_lat[seq, row, col + step] = x1 * inv
                    else:
                        part_acc[seq, row, split, col] = x0
                        part_acc[seq, row, split, col + step] = x1

    name = (f"mla_mma_{kind}_r{RANK}_w{W}_rg{RG}_kt{KT}_{'paged' if PAGED else 'contiguous'}"
            + (f"{PAGE}" if PAGE else "") + ("" if fp8 is None else "_fp8" + fp8)
            + ("" if not WGS else "_wgmma" if WGV else "_wgmma_s"))
    kernel.__name__ = kernel.__qualname__ = name + ("" if defect is None else "_" + defect)
    # 512 threads at RG 4: at most 128 registers a thread for one block an SM
    return jit(kernel, fastmath=True, launch_bounds=(NTH,))


# ---------------------------------------------------------------------------
# plan and launch
# ---------------------------------------------------------------------------

def plan(n_seq, n_rows, rank, d_rope, max_len, kind, *, paged=False, n_split=None,
         row_groups=None, tile=None, defect=None, fp8=None, chunk=None, page_size=None,
         wgmma=None):
    """Launch plan (a dict): kernel, grid, block, dyn_smem, chunk, n_split, ...

    ``n_rows``: R, a sequence's query rows (s_q nh). ``row_groups`` (default
    4 past 32 rows, else 2: at 16 rows the idle row group's warps still copy
    tiles, which the memory-bound case needs), ``tile`` (64),
    ``n_split`` (default: ``fast.split_count`` over
    the ``B ceil(R / 16 RG)`` blocks a split, one block an SM at RG 4) trimmed
    to the chunks that hold a position (a chunk is a multiple of KT). ``fp8``:
    None, or the scale mode of an fp8 latent cache (``mla.fp8``; ``kind`` "f16").
    ``chunk`` (not with ``n_split``): the positions a split, fixed (rounded up
    to a multiple of KT): a batch-invariant plan's (``invariant_chunk``).
    ``page_size`` (paged): the cache's P compiled into the kernel (``launch``
    refuses another); None: one kernel for any P, read at run time.
    ``wgmma``: Hopper's warp-group MMA (module docstring): 0 / False off, 1 S
    only, 2 / True S and P.V (a 16-bit cache at RG 4; on a GPU, compute
    capability 9.0 only); None: ``wgmma_level``'s choice.
    """
    n_rows = int(n_rows)
    if row_groups is None:  # H200 (notes/bench.md run 22): RG 2 beats RG 1 at 16 rows
        row_groups = 4 if n_rows > 32 else 2
    if tile is None:
        tile = 64
    row_groups, tile = int(row_groups), int(tile)
    if wgmma is None:
        wgmma = wgmma_level(kind, row_groups, fp8)
    wgmma = 2 if wgmma is True else int(wgmma)
    if wgmma and not SIMULATOR:
        cc = _compute_capability()
        if cc != (9, 0):
            raise ValueError("wgmma: sm_90a only, " + ("no GPU" if cc is None else
                                                      f"this GPU is compute capability {cc}"))
    width = int(rank) + int(d_rope)
    dyn = 4 * smem_words(width, row_groups, tile, fp8)
    if dyn > SMEM_BLOCK_MAX:
        raise ValueError(f"row_groups {row_groups}, tile {tile}, W {width}: {dyn} bytes of "
                         f"shared memory, more than a block's {SMEM_BLOCK_MAX}")
    blocks = int(n_seq) * -(-n_rows // (16 * row_groups))
    chunk, n_split = fast.split_chunk(max_len, tile, blocks,
                                      max(1, SMEM_PER_SM // (dyn + 1024)), n_split=n_split,
                                      chunk=chunk)
    return {
        "kernel": mla_mma_kernel(kind, int(rank), int(d_rope), row_groups, tile, bool(paged),
                                 defect, fp8, None if page_size is None else int(page_size),
                                 wgmma),
        "kind": kind,
        "rank": int(rank),
        "d_rope": int(d_rope),
        "grid": (n_split, -(-n_rows // (16 * row_groups)), int(n_seq)),
        "block": CQ * row_groups * WARP,
        "dyn_smem": dyn,
        "chunk": chunk,
        "n_split": n_split,
        "row_groups": row_groups,
        "tile": tile,
        "paged": bool(paged),
        "page_size": None if page_size is None else int(page_size),
        "defect": defect,
        "fp8": fp8,
        "wgmma": wgmma,
    }


def invariant_chunk(n_rows, rank, d_rope, capacity, kind, *, paged=False, fp8=None):
    """The split length of a batch-invariant plan (``plan(chunk=...)``): the
    chunk the default plan gives one sequence of ``capacity`` positions (so a
    lone sequence still fills the GPU). It follows the geometry, the capacity
    and the GPU, never the batch; with the plan covering the capacity, every
    batch of that capacity has the same split count, a sequence's blocks cover
    the same positions and the splits merge in a fixed order: its output and
    LSE are the same bits in any batch."""
    return plan(1, n_rows, rank, d_rope, capacity, kind, paged=paged, fp8=fp8)["chunk"]


def kernel_signature():
    """The numba argument types of ``mla_mma_kernel``'s kernel (``kernel(qc, lat,
    sc, lens, table, page, n_pages, shift, nh, s_q, scale, chunk, o_lat, lse,
    part_acc, part_ml)``, the layouts of the module docstring; ``lat`` as uint32
    words), for compiling it without a GPU (``cuda.compile_ptx``)."""
    from numba import types

    u32, i32, f32 = types.uint32, types.int32, types.float32
    arr = types.Array
    return (arr(f32, 3, "C"), arr(u32, 1, "C"), arr(f32, 1, "C"), arr(i32, 1, "C"),
            arr(i32, 2, "C"), i32, i32, i32, i32, i32, f32, i32, arr(f32, 3, "C"),
            arr(f32, 2, "C"), arr(f32, 4, "C"), arr(f32, 4, "C"))


@functools.lru_cache(maxsize=None)
def _compute_capability():
    """The current GPU's (major, minor), or None where there is none
    (``gpu_available``: a plan is still built, not launched). A GPU that is
    there but does not answer raises, rather than passing for "no GPU"."""
    if not gpu_available():
        return None
    return tuple(cuda.get_current_device().compute_capability)


def wgmma_level(kind, row_groups, fp8=None):
    """``plan``'s default ``wgmma``: 2 (S and P.V on wgmma) for a 16-bit cache
    at RG 4 on a compute-capability-9.0 GPU, else 0 (mma.sync; on the simulator
    too, where the wgmma form is an emulation the tests run by name)."""
    if SIMULATOR or fp8 is not None or kind not in ("f16", "bf16") or int(row_groups) != 4:
        return 0
    return 2 if _compute_capability() == (9, 0) else 0


def capacity_plan(n_seq, n_rows, rank, d_rope, capacity, kind, *, paged=False, fp8=None,
                  defect=None, page_size=None):
    """The plan of a batch-invariant call (``prepare``'s ``capacity``): the
    capacity's positions in chunks of ``invariant_chunk``, whatever ``n_seq``.
    ``defect`` "mla_chunk_follows_batch" (``PLAN_DEFECTS``, planted): the
    chunk of the batch's default plan instead; another defect goes to the
    kernel."""
    if defect in PLAN_DEFECTS:
        chunk = plan(n_seq, n_rows, rank, d_rope, capacity, kind, paged=paged,
                     fp8=fp8)["chunk"]
        defect = None
    else:
        chunk = invariant_chunk(n_rows, rank, d_rope, capacity, kind, paged=paged, fp8=fp8)
    return plan(n_seq, n_rows, rank, d_rope, capacity, kind, paged=paged, fp8=fp8,
                chunk=chunk, defect=defect, page_size=page_size)


def scratch(pl, n_seq, n_rows, stream=None):
    """The plan's split-KV partials ``fast.scratch`` (a placeholder at one split)."""
    return fast.scratch(n_seq, n_rows, pl["rank"], pl["n_split"], stream)


def launch(pl, d_qc, d_latent, d_lens, d_table, nh, scale, d_o_lat, d_lse, d_part_acc,
           d_part_ml, stream=0, d_scale=None):
    """Enqueue a planned attention (one launch, or two with the combine).

    d_qc [B, R, W] f32; d_latent [S, max_seq, W] (contiguous, ``d_table`` the
    slots [B] or [B, 1]) or [num_pages, P, W] (paged, ``d_table`` [B,
    max_pages]) 16-bit; d_lens [B] int32; nh: heads (R = s_q nh); d_o_lat [B,
    R, r] f32; d_lse [B, R] f32; d_part_acc / d_part_ml ``scratch(pl, B, R)``.
    A plan with ``fp8``: d_latent holds uint8 fp8 rows (``mla.fp8``) and
    ``d_scale`` its float32 scales ([1] per tensor; per token the cache's
    shape without the row axis).
    """
    n_seq, n_rows = int(d_qc.shape[0]), int(d_qc.shape[1])
    n_pages, page = int(d_latent.shape[0]), int(d_latent.shape[1])
    if pl.get("page_size") is not None and page != pl["page_size"]:
        raise ValueError(f"d_latent: pages of {pl['page_size']} rows (the plan's page_size), "
                         f"got shape {tuple(d_latent.shape)}")
    if len(d_table.shape) == 1:
        d_table = d_table.reshape(n_seq, 1)
    shift = page.bit_length() - 1 if page & (page - 1) == 0 else -1
    if pl.get("fp8") is not None:
        d_scale = as_device_view(d_scale)
        d_scale = d_scale.reshape(int(np.prod(d_scale.shape)))
    elif d_scale is None:
        if "no_scale" not in pl:
            pl["no_scale"] = to_device(np.ones(1, np.float32), stream or None)
        d_scale = pl["no_scale"]
    args = (d_qc, mma16.as_words(d_latent, True), d_scale, d_lens, d_table, np.int32(page),
            np.int32(n_pages), np.int32(shift), np.int32(nh), np.int32(n_rows // nh),
            np.float32(scale), np.int32(pl["chunk"]), d_o_lat, d_lse, d_part_acc, d_part_ml)
    ensure_dynamic_shared(pl["kernel"], args, pl["dyn_smem"], 0, pl["kind"],
                          pl.setdefault("smem_ready", set()))
    pl["kernel"][pl["grid"], pl["block"], stream, pl["dyn_smem"]](*args)
    if pl["n_split"] > 1:
        chunks, slices = combine_slices(pl["rank"], n_rows * n_seq)
        comb = fast.combine_kernel(chunks)
        comb[(n_rows, n_seq, slices), fast.combine_warps(pl["n_split"]) * WARP, stream](
            d_part_acc, d_part_ml, d_o_lat, d_lse)


def combine_slices(rank, rows):
    """(chunks, slices) of the split combine (``fast.combine_kernel``) over ``rows``
    rows of ``rank`` columns: the widest column slices (4, 2 or 1 chunks of 32)
    that still give about a block an SM (``fast.N_SMS``)."""
    full = -(-int(rank) // WARP)
    for chunks in (4, 2, 1):
        slices = -(-full // chunks)
        if int(rows) * slices >= fast.N_SMS or chunks == 1:
            return chunks, slices


def prepare(d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale, *, d_rope,
            w_uk_layout, stream, d_vis=None, page_table=None, s_q=1, n_split=None,
            defect=None, fp8=None, d_scale=None, capacity=None):
    """Allocate and fill everything the MLA decode on tensor cores reads: a
    dict for ``launch_prepared`` (absorb, attention, decompress).

    d_q_nope [Q, nh, d_nope], d_q_pe [Q, nh, d_rope] float32 (Q = B s_q: s_q
    consecutive queries a sequence), d_w_uk [nh, d_nope, r] ("mla") or [nh, r,
    d_nope] ("checkpoint"), d_w_uv [nh, d_v, r], d_latent [S, max_seq, W]
    float16 / bfloat16 (``slots`` [B] its rows of each sequence), or paged
    [num_pages, P, W] with ``page_table`` (device int32 [B, max_pages]);
    ``vis`` host int32 [B]: the rows each sequence sees (its length);
    ``d_vis`` (device int32 [B], optional): read in place of ``vis``, which
    then sizes the plan only. ``fp8`` ("tensor" / "token"): d_latent is an fp8
    latent cache (uint8 rows of ``r + 2 d_rope`` bytes, ``mla.fp8``) and
    ``d_scale`` its device float32 scales. ``capacity`` (batch-invariant, not
    with ``n_split``): the positions a sequence may hold; the plan covers them
    in chunks of ``invariant_chunk``. Returns the dict; its ``out`` [Q,
    nh, d_v], ``o_lat`` [Q, nh, r] and ``lse`` [Q, nh] are written by each
    launch.
    """
    n_q, nh, d_nope = (int(x) for x in d_q_nope.shape)
    n_seq = n_q // s_q
    width = int(d_latent.shape[2])
    if fp8 is not None:
        width -= d_rope  # r + 2 d_rope bytes a row
        kind = "f16"
    else:
        kind = mma16.kind_of(d_latent.dtype, "latent_cache")
    rank = width - d_rope
    d_v = int(d_w_uv.shape[1])
    p = {"n_q": n_q, "n_seq": n_seq, "s_q": s_q, "nh": nh, "rank": rank, "d_rope": d_rope,
         "d_v": d_v, "scale": float(scale),
         "out": device_empty((n_q, nh, d_v), np.float32, stream),
         "o_lat": device_empty((n_q, nh, rank), np.float32, stream),
         "lse": device_empty((n_q, nh), np.float32, stream)}
    if n_q == 0:
        return p
    max_len = int(np.max(vis)) if len(vis) else 0
    paged = page_table is not None
    # paged: one kernel per page size, P compiled in (``mla_mma_kernel``)
    page_size = int(d_latent.shape[1]) if paged else None
    if capacity is not None:  # batch-invariant: the capacity's chunks
        if n_split is not None:
            raise ValueError("n_split, capacity: a batch-invariant plan fixes its chunks")
        pl = capacity_plan(n_seq, s_q * nh, rank, d_rope, int(capacity), kind, paged=paged,
                           fp8=fp8, defect=defect, page_size=page_size)
    else:
        pl = plan(n_seq, s_q * nh, rank, d_rope, max_len, kind, paged=paged, n_split=n_split,
                  defect=None if defect in PLAN_DEFECTS else defect, fp8=fp8,
                  page_size=page_size)
    heads = np.arange(nh)
    table = to_device(np.concatenate((heads, np.full(nh, rank), np.full(nh, d_nope),
                                      np.full(nh, d_v))).astype(np.int32), stream)
    p["heads"], p["h_rank"], p["h_nope"], p["h_dv"] = (table[i * nh:(i + 1) * nh]
                                                       for i in range(4))
    p["index"] = table  # keeps the slices' memory alive with the dict
    p["smem_ready"] = set()
    # the absorb and decompress GEMMs on split-tf32 tensor cores where their grid
    # fills the GPU (``attn_gemm.weight_gemm_method``; fp32-class error, below the
    # 16-bit rounding of q_lat and P that follows or precedes them). Not for a
    # batch-invariant call: the way follows the batch's rows, and only the FMA
    # ways (sgemm, skinny, the K split) give a query the same bits in any batch
    p["weight_tensor"] = capacity is None
    p["qc"] = device_empty((n_q, nh, width), np.float32, stream)
    p.update(q_nope=d_q_nope, q_pe=d_q_pe, w_uv=d_w_uv, plan=pl, latent=d_latent,
             w_uk=d_w_uk, uk_order="zkn" if w_uk_layout == "mla" else "znk",
             latent_scale=d_scale)
    p["lens"] = d_vis if d_vis is not None else to_device(np.asarray(vis, np.int32), stream)
    p["table"] = (page_table if page_table is not None
                  else to_device(np.asarray(slots, np.int32).reshape(n_seq, 1), stream))
    p["part_acc"], p["part_ml"] = scratch(pl, n_seq, s_q * nh, stream)
    return G.weight_gemm_scratch(p, stream)


def launch_prepared(p, stream):
    """Enqueue a ``prepare`` dict's launches on ``stream`` (a numba stream or 0):
    the absorb GEMM (``mla.attn_gemm.launch_absorb``), the attention (one
    launch, two with the split-KV combine) and the decompress GEMM."""
    if p["n_q"] == 0:
        return
    n_seq, rows = p["n_seq"], p["s_q"] * p["nh"]
    G.launch_absorb(p, stream)
    launch(p["plan"], p["qc"].reshape(n_seq, rows, p["rank"] + p["d_rope"]), p["latent"],
           p["lens"], p["table"], p["nh"], p["scale"], p["o_lat"].reshape(n_seq, rows, p["rank"]),
           p["lse"].reshape(n_seq, rows), p["part_acc"], p["part_ml"], stream,
           d_scale=p["latent_scale"])
    G.launch_decompress(p, stream)


__all__ = ["DEFECTS", "SIMULATOR", "launch", "launch_prepared", "mla_mma_kernel", "plan",
           "prepare", "scratch", "smem_words", "supported", "invariant_chunk",
           "capacity_plan", "PLAN_DEFECTS", "wgmma_level", "kernel_signature"]
