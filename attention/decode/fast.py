"""Fast batched decode attention: one block per (split, kv group, sequence).

Same contract as ``attention.reference.warp_decode.batched_decode_attention`` (read its
docstring), built for bandwidth:

* **A block per (KV chunk, kv group, sequence).** The ``GB`` query heads of a
  kv group (GQA) that a block serves share every K/V row it loads, so K and V
  are read from memory once per kv group, not once per query head.
* **Rows over lane groups, vector loads.** A row is spread over ``LPR``
  lanes (``LANES``: 16 for fp16/bf16 caches, 32 for fp32), so a warp holds
  ``32 / LPR`` rows at once: lane ``j`` of a group holds elements
  ``c*LPR*VEC + j*VEC + v`` (``v < VEC``, ``c < CH``) of its row, read with
  16-byte loads at D=128 (fp32 ``VEC=4``, fp16/bf16 ``VEC=8``). A score is a
  butterfly over its group (``attention.core.warp.group_sum``; with 16 lanes, 4
  shuffles reduce two rows' scores), and the groups of a warp merge their
  softmax states by shuffles at the end. Loads go through ``load_row_vec``
  (an LLVM vector load; on the simulator a plain loop). Head sizes that are
  not a multiple of ``LPR*VEC`` use scalar, predicated loads.
* **Several positions per warp at once.** Each lane group loads ``U`` K and
  V rows (``R`` apart) before it uses any (``2*U`` independent loads in flight), forms
  ``U*GB`` scores with ``attention.core.warp.group_sum``, takes the tile's softmax
  (max over its ``U`` scores, ``U`` exponentials) and folds the tile into its
  running state with ``attention.core.warp.online_softmax_merge``: two
  exponentials per tile and head instead of two per position.
* **16-bit rows pipelined** (``PIPELINE``): fp16/bf16 rows stay packed in
  registers, two elements a word, and each warp loads its next step's rows
  into a second buffer before it computes on the current one, so its loads
  overlap its own arithmetic (H200, fp16 B 32 L 4096: 176 -> 157 us; this
  kernel's 210-220 registers leave 2 blocks a SM, which the split count
  knows: ``RESIDENT_BLOCKS``).
* **16-bit rows through shared memory** (``ASYNC_STAGES``, sm_80 and later):
  instead of the second register buffer, each warp has a ring of 4 stages in
  dynamic shared memory that its lanes fill with ``cp.async`` (inline PTX) 3
  steps ahead and read back themselves, so 12 KB a warp are in flight
  without registers (161 a thread). H200, fp16 B 32: L 4096 150.9 -> 142.6
  us, L 16384 546.0 -> 502.7 us (notes/bench.md run 10; torch SDPA 134.8 /
  486.4 us).
* **fp16 / bf16 caches, fp32 accumulation.** Rows are converted to float32
  as they are loaded (bf16 by a 16-bit shift, fp16 by ``cvt.f32.f16``).
* **Split-KV.** Each sequence's positions are cut into ``n_split`` chunks so
  that ``M * H_kv * n_split`` blocks fill whole waves of the 132 SMs even when
  ``M * H_kv`` is small (``split_count``); each block writes an unnormalised partial (acc, m, l) and a
  combine kernel merges the partials in batches of ``COMBINE_BATCH``. With
  one chunk the block writes the final output directly (one launch).
* **The combine as a programmatic dependent** (``attention.core.pdl``, sm_90 and
  later): every block of the main kernel releases the combine as it starts,
  the combine is launched with programmatic stream serialization and waits
  for the main grid (``griddepcontrol.wait``) before it reads a partial, so
  its launch and ramp overlap the main kernel. H200, B 1, L 32768 (with the
  split count trimmed to the chunks that hold positions, 33 -> 32): fp16
  45.7 -> 43.8 us, bf16 45.5 -> 43.8, fp32 77.1 -> 75.2 (notes/bench.md run 13).

Within a block the ``NW`` warps take tiles ``U`` positions apart in turn and
merge their states through shared memory at the end, as one batch a head
(the batch's max, one weight a warp).

Planted defects and precision mutants (``defect=``, for the falsification
suites and precision tests only: compile-time switches of ``fast_decode_kernel``
and ``combine_kernel``, the kernel's name suffixed with ``_<defect>``; without
one the kernels are the production ones, PTX unchanged). ``GROSS_DEFECTS``:
    "gqa_mod"              a block reads kv head ``head0 % H_kv`` (its first
                           query head's) instead of ``head0 // group``
    "slot_off_by_one"      reads slot ``(slot_table[m] + 1) % KV_SLOTS``
    "one_short"            each sequence attends its first ``length - 1`` positions
    "combine_drops_split"  the combine ignores the last split
``PAGED_DEFECTS`` (paged plans only):
    "page_off_by_one"      reads page ``(table[m, j] + 1) % num_pages`` (in bounds:
                           another page's rows)
    "page_offset_stride"   addresses a row inside its page with the other
                           layout's strides (HND as NHD and back; in the page)
``FP8_DEFECTS`` (fp8 plans only):
    "fp8_scale_twice"      the V scale applied twice to the output
    "fp8_no_k_scale"       the K scale not applied to the scores
    "fp8_as_e5m2"          the cache's codes decoded as e5m2 instead of e4m3
    "fp8_scale_wrong_head" per-token-head scales: a row's K and V scales read
                           from kv head ``(h + 1) % H_kv``
    "fp8_scale_wrong_token" per-token-head scales: a row's K and V scales read
                           from the next position of its page (slot), ``(off +
                           1) % P``
``MULTI_DEFECTS`` (multi-token plans only, ``t_q > 1``):
    "causal_off_by_one"    query i of T sees positions 0 .. len - T + i + 1 (one
                           more than causal) for i < T - 1
``PRECISION_MUTANTS`` (roundings by ``attention.core.rounding``):
    "p_fp16" / "p_bf16"    every softmax weight multiplied into V (``p``, or
                           ``p * beta`` in the pipelined forms) rounded to fp16 / bf16
    "q_bf16"               q's elements rounded to bf16 as they are loaded
    "scale_fp16"           the pre-scaled q (``q * scale``) rounded to fp16
    "max_fp16"             the running max rounded to fp16 each time it is
                           stored after a merge, whose alpha and beta used the
                           unrounded max (an inconsistent state)
    "lse_fp16"             the LSE written (main kernel, one split; combine)
                           rounded to fp16
    "exp_approx"           every exponential of both kernels is ``chop_exp``
    "combine_no_max"       the combine's batch weights are ``exp(m_j)``, no
                           batch max subtracted (merged consistently with that)
    "split_off_by_one"     a split reads one position past its chunk (the
                           boundary position is counted by two splits)
    "ring_stale"           ring path: a warp's last step (when not its first)
                           reads the ring stage of the step before it
A switch that cannot act on a plan leaves its result unchanged (``applies``).

Layouts (C-contiguous):
    q           [M, H, D]                     float32, or the cache's dtype
    k_cache     [KV_SLOTS, H_kv, max_seq, D]  float32 / float16 / bfloat16
    v_cache     [KV_SLOTS, H_kv, max_seq, D]  same dtype as k_cache
    seq_lens    [M] int32, slot_table [M] int32
    out         [M, H, D] float32, lse [M, H] float32 (-inf where empty)
    part_acc    [M, H, n_split, D] float32 (split-KV scratch, unnormalised)
    part_ml     [M, H, n_split, 2] float32 (running max, running sum)
    err         [ERR_WORDS] int32: the device range check's flag (``clear_flag``;
                ``launch`` passes ``default_flag()`` when given none; ``read_flag``)

Lengths and slots are checked on the device as well (``fast_decode_kernel``):
a bad sequence is attended as empty and counted in ``err``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    SIMULATOR,
    as_device_view,
    device_empty,
    device_fn,
    ensure_dynamic_shared,
    finish,
    gpu_available,
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
from attention.core.rounding import chop_exp, round_bf16, round_fp16
from attention.core.warp import FULL_MASK as FULL
from attention.core.warp import batch_reference, group_sum, online_softmax_merge, softmax_finish

WARP = 32
N_SMS = 132  # H200 / H100 SXM; only a sizing hint for the split heuristic

CACHE_DTYPES = tuple(d for d in (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
                     if d is not None)

# default tuning (H200, B 32 / H 32 / H_kv 8 / D 128; notes/bench.md, runs 5-7): 4
# warps per block; rows over 16 lanes for 16-bit caches (16-byte loads, half the
# shuffles a score), over 32 lanes for fp32 (16-byte loads already; 16 lanes
# changed its order of additions for no speed); 4 positions per lane group and
# step, with 32 lanes a row 8 once a block's chunk is long enough to use them
WARPS = 4
UNROLL = None  # None: 4; with 32 lanes a row, 8 when the chunk is >= LONG_CHUNK
LONG_CHUNK = 384
LANES = {"f32": 32, "f16": 16, "bf16": 16, "f8": 16}  # lanes per row by cache dtype
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "f8": 1, "f8_e5m2": 1}  # f8_e5m2: a defect's
# fp8 caches (e4m3 codes as uint8, ``attention.cache.fp8``): DecodePlan only, with scales
FP8_DTYPE = np.dtype(np.uint8)
PIPELINE = True  # 16-bit rows: packed, double-buffered (fast_decode_kernel)
SCATTERED = True  # pipelined kernels with GB * U == LPR: one score a lane (ditto)
# pipelined kernels: stages of the shared-memory ring a warp's rows arrive in by
# cp.async (sm_80 and later; 0: two register buffers). H200, fp16 B 32: L 4096
# 150.9 -> 142.6 us at 4 stages (3: 144.5, 6: 148.0); notes/bench.md run 10
ASYNC_STAGES = 4
RING_LIMIT = 96 * 1024  # most ring bytes a block (fewer stages where a stage is larger)
MIN_CHUNK = 256  # fewest positions a split-KV block is given
# blocks of 128 threads an SM holds at once, by kernel form (sm_90 at D 128: the
# one-buffer kernel takes 161-168 registers a thread, so 3; the pipelined 16-bit
# kernel 210, so 2; with the ring, 161 registers and 73 KB of shared memory
# allow 3, but counting 2 keeps B 32 at one split, which measured faster than 3
# splits: run 10): the split heuristic counts blocks in waves of this many
RESIDENT_BLOCKS = {False: 3, True: 2}  # keyed by ``pipeline``
WAVE_FILL = 0.9  # the last wave of blocks must be at least this full

GROSS_DEFECTS = ("gqa_mod", "slot_off_by_one", "one_short", "combine_drops_split")
PRECISION_MUTANTS = ("p_fp16", "p_bf16", "q_bf16", "scale_fp16", "max_fp16", "lse_fp16",
                     "exp_approx", "combine_no_max", "split_off_by_one", "ring_stale")
DEFECTS = GROSS_DEFECTS + PRECISION_MUTANTS
# switches of the paged kernels only (``plan(paging=...)``; a pooled plan ignores
# them): the falsification suite ``validation.suite_decode_paged``
PAGED_DEFECTS = ("page_off_by_one", "page_offset_stride")
# switches of the multi-token kernels only (``plan(t_q=T > 1)``)
MULTI_DEFECTS = ("causal_off_by_one",)
MAX_T_Q = 16  # most queries a sequence in one multi-token decode
# switches of the fp8 kernels only (cache_dtype uint8 plans)
FP8_DEFECTS = ("fp8_scale_twice", "fp8_no_k_scale", "fp8_as_e5m2", "fp8_scale_wrong_head",
               "fp8_scale_wrong_token")
# the fp8 plans' scale modes: one K and one V scale ("tensor", float32 [1]), or a
# scale a cached row ("token_head": the cache's layout without D, float32)
FP8_SCALES = ("tensor", "token_head")
FP8_TOKEN_DEFECTS = ("fp8_scale_wrong_head", "fp8_scale_wrong_token")  # token_head only
CHECK_AHEAD = 8  # paged: table entries a thread loads at once in the block's page check
COMBINE_DEFECTS = ("combine_drops_split", "combine_no_max")  # act in the combine only
# the switches the combine kernel reads (``combine_kernel``); every other one
# leaves it the production combine
COMBINE_SWITCHES = COMBINE_DEFECTS + ("exp_approx", "lse_fp16")

# words of the int32 flag the main kernel counts bad sequences in
ERR_COUNT, ERR_FIRST, ERR_LENGTHS, ERR_SLOTS = 0, 1, 2, 3
ERR_WORDS = 4
NO_SEQUENCE = 2 ** 31 - 1  # ERR_FIRST when no sequence was flagged


def dtype_kind(dt, fp8=False):
    """'f32', 'f16' or 'bf16' for a cache dtype; with ``fp8``, 'f8' for uint8
    (e4m3 codes)."""
    dt = np.dtype(dt)
    if fp8 and dt == FP8_DTYPE:
        return "f8"
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bf16"
    raise checks.DTypeError(f"k_cache: expected float32, float16 or bfloat16, got {dt}")


def check_defect(defect):
    """``defect`` itself when it is None or one of ``DEFECTS``; else ValueError."""
    known = DEFECTS + PAGED_DEFECTS + MULTI_DEFECTS + FP8_DEFECTS
    if defect is not None and defect not in known:
        raise ValueError(f"defect: expected None or one of {known}, got {defect!r}")
    return defect


def combine_switch(defect):
    """The switch the combine kernel is built with for a plan's ``defect``: the
    defect where the combine reads it (``COMBINE_SWITCHES``), else None (the
    production combine, compiled once for every other switch)."""
    return defect if defect in COMBINE_SWITCHES else None


def applies(defect, kind, n_split, stages):
    """Whether switch ``defect`` can change the result of a plan for cache
    dtype ``kind`` ('f32' / 'f16' / 'bf16') with ``n_split`` splits and a ring
    of ``stages`` stages (``plan(...)["stages"]``; 0 without one).

    False where the concept is absent from the plan: the combine's switches
    and ``split_off_by_one`` need ``n_split > 1``, ``ring_stale`` a ring (16-bit
    caches, ``stages > 0``); ``lse_fp16`` acts with any split count. The others
    act on every plan whose data exposes them (``gqa_mod``: GQA with
    ``H_kv > 1``; ``ring_stale``: a warp with at least two steps; ``p_fp16``
    and the like: values not already exact in the narrower type)."""
    check_defect(defect)
    if defect is None:
        return False
    if defect in COMBINE_DEFECTS or defect == "split_off_by_one":
        return int(n_split) > 1
    if defect == "ring_stale":
        return kind != "f32" and int(stages) > 0
    return True  # PAGED_DEFECTS: wherever the plan is paged


def _merge_chop_exp(m, l, m2, l2):
    # online_softmax_merge with chop_exp for each exponential (the exp_approx mutant)
    m_new = max(m, m2)
    if m_new == -math.inf:
        return m_new, float32(0.0), float32(0.0), float32(0.0)
    alpha = chop_exp(m - m_new)
    beta = chop_exp(m2 - m_new)
    return m_new, l * alpha + l2 * beta, alpha, beta


merge_chop_exp = device_fn(_merge_chop_exp)


# ---------------------------------------------------------------------------
# vector row loads
# ---------------------------------------------------------------------------

def _e5m2_value(c):
    # float32 value of the e5m2 code c (0..255): the planted fp8_as_e5m2's
    # decoding of a scalar-loaded code
    e = (c >> 2) & 31
    m = c & 3
    if e == 31:
        v = float32(math.inf) if m == 0 else float32(math.nan)
    elif e == 0:
        v = float32(m) * float32(2.0 ** -16)
    else:
        v = float32(4 + m) * float32(2.0) ** (e - 17)
    return -v if c & 0x80 else v


e5m2_value = device_fn(_e5m2_value)


def _halves_to_f32(builder, word, kind):
    """llvmlite: the two 16-bit elements of an i32 ``word`` as float32
    ``[lo, hi]`` (bf16: a 16-bit shift or mask; fp16: ``cvt.f32.f16``)."""
    from llvmlite import ir

    f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
    if kind == "bf16":
        return [builder.bitcast(builder.shl(word, ir.Constant(i32, 16)), f32),
                builder.bitcast(builder.and_(word, ir.Constant(i32, 0xFFFF0000)), f32)]
    lo16 = builder.trunc(word, i16)
    hi16 = builder.trunc(builder.lshr(word, ir.Constant(i32, 16)), i16)
    return [builder.fpext(builder.bitcast(lo16, ir.HalfType()), f32),
            builder.fpext(builder.bitcast(hi16, ir.HalfType()), f32)]


def _e4m3_pair_to_f32(builder, half16, fmt="e4m3"):
    """llvmlite: the two fp8 codes of an i16 as float32 ``[lo, hi]``
    (``cvt.rn.f16x2.e4m3x2``, sm_89 and later: exact; ``fmt`` "e5m2": the
    planted defect's format), then ``cvt.f32.f16``."""
    from llvmlite import ir

    i16, i32 = ir.IntType(16), ir.IntType(32)
    fnty = ir.FunctionType(i32, [i16])
    word = builder.call(ir.InlineAsm(fnty, f"cvt.rn.f16x2.{fmt}x2 $0, $1;", "=r,h"), [half16])
    return _halves_to_f32(builder, word, "f16")


def _codes_to_f32(builder, word, kind="f8"):
    """llvmlite: the four fp8 codes of an i32 ``word`` as float32, low byte first
    (``kind`` "f8": e4m3; "f8_e5m2": e5m2, the planted defect's)."""
    from llvmlite import ir

    fmt = "e5m2" if kind == "f8_e5m2" else "e4m3"
    i16, i32 = ir.IntType(16), ir.IntType(32)
    lo = builder.trunc(word, i16)
    hi = builder.trunc(builder.lshr(word, ir.Constant(i32, 16)), i16)
    return _e4m3_pair_to_f32(builder, lo, fmt) + _e4m3_pair_to_f32(builder, hi, fmt)


def _element_kind(dtype):
    """'f32' / 'f16' / 'bf16' for a numba array element type."""
    from numba import types

    if dtype == types.float32:
        return "f32"
    if dtype == types.float16:
        return "f16"
    if dtype == cuda.types.bfloat16:
        return "bf16"
    raise TypeError(f"vector load: expected float32, float16 or bfloat16 elements, got {dtype}")


def _vector_loader(kind, n):
    """``load(arr, flat) -> UniTuple(float32, n)``: elements ``flat .. flat+n-1``
    of a C-contiguous array, read with one vector load (``n * itemsize`` bytes,
    aligned to that size) and converted to float32.

    fp32: ``ld.global.v{n}.f32`` (two 16-byte loads at n 8); fp16 and bf16:
    ``n/2`` 32-bit words, each split into two halves (bf16 -> f32 is a 16-bit
    shift; fp16 uses cvt). ``kind`` None: the element type of the array the
    load is compiled for (q, whose dtype the kernel's plan does not fix).
    """
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, arr, flat):
        sig = types.UniTuple(types.float32, n)(arr, flat)

        def codegen(context, builder, sig, args):
            ekind = kind or _element_kind(sig.args[0].dtype)
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            i8p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
            idx = args[1]
            if idx.type.width < 64:
                idx = builder.sext(idx, ir.IntType(64))
            itemsize = ITEMSIZE[ekind]
            align = min(16, itemsize * n)  # what check_fast asks of the arrays
            ptr = builder.gep(i8p, [builder.mul(idx, ir.Constant(ir.IntType(64), itemsize))])
            f32, i32 = ir.FloatType(), ir.IntType(32)
            elems = []
            if ekind == "f32":
                vt = ir.VectorType(f32, n)
                vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=align)
                elems = [builder.extract_element(vec, ir.Constant(i32, i)) for i in range(n)]
            elif ekind in ("f8", "f8_e5m2"):
                vt = ir.VectorType(i32, n // 4)
                vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=align)
                for i in range(n // 4):
                    elems += _codes_to_f32(
                        builder, builder.extract_element(vec, ir.Constant(i32, i)), ekind)
            else:
                vt = ir.VectorType(i32, n // 2)
                vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=align)
                for i in range(n // 2):
                    word = builder.extract_element(vec, ir.Constant(i32, i))
                    elems += _halves_to_f32(builder, word, ekind)
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    return load


def _sim_loader(n, kind=None):
    """Simulator stand-in for the vector load: ``n`` scalar reads along the
    last axis of an array of any rank, from flat element ``flat`` (``kind``
    "f8": e4m3 codes, decoded)."""
    table = None
    if kind == "f8":
        from attention.cache.fp8 import E4M3_VALUES as table
    elif kind == "f8_e5m2":  # the planted defect's decoding: e5m2 is fp16's upper byte
        table = (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)

    def load(arr, flat):
        at = []
        rest = int(flat)
        for extent in reversed(arr.shape):
            at.append(rest % extent)
            rest //= extent
        at.reverse()
        head, d = tuple(at[:-1]), at[-1]
        if table is not None:
            return tuple(float32(table[int(arr[head + (d + i,)])]) for i in range(n))
        return tuple(float32(arr[head + (d + i,)]) for i in range(n))

    return load


def _raw_loader(n_words, itemsize=2):
    """``load(arr, flat) -> UniTuple(uint32, n_words)``: the ``4 * n_words``
    bytes at element ``flat`` of a C-contiguous array of ``itemsize``-byte
    elements (2, or 1 for fp8 codes), one vector load (aligned to its size),
    left packed: two (four) elements a word."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, arr, flat):
        sig = types.UniTuple(types.uint32, n_words)(arr, flat)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            i8p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
            idx = args[1]
            if idx.type.width < 64:
                idx = builder.sext(idx, ir.IntType(64))
            ptr = builder.gep(i8p, [builder.mul(idx, ir.Constant(ir.IntType(64), itemsize))])
            i32 = ir.IntType(32)
            vt = ir.VectorType(i32, n_words)
            vec = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4 * n_words)
            elems = [builder.extract_element(vec, ir.Constant(i32, i)) for i in range(n_words)]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    return load


def _unpacker(kind):
    """``unpack(word) -> (lo, hi)``: the two 16-bit elements of a packed word
    as float32 (``_halves_to_f32``); "f8": the four e4m3 codes, low byte first."""
    from numba import types
    from numba.cuda.extending import intrinsic

    per = 4 // ITEMSIZE[kind]

    @intrinsic
    def unpack(typingctx, word):
        sig = types.UniTuple(types.float32, per)(word)

        def codegen(context, builder, sig, args):
            vals = (_codes_to_f32(builder, args[0], kind) if per == 4
                    else _halves_to_f32(builder, args[0], kind))
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return unpack


def _gpu_async_ops(stages, words, itemsize=2):
    """llvmlite intrinsics (inline PTX) for the shared-memory ring:
    ``copy(ring, word, arr, flat)``: ``cp.async`` of the ``4 * words`` bytes
    (16: ``.cg``, past L1; 8 or 4: ``.ca``) at element ``flat`` of a 16-bit
    array into uint32 word ``word`` of a shared array; ``commit()``:
    ``cp.async.commit_group``; ``wait()``: ``cp.async.wait_group stages - 2``
    (at most that many of the thread's groups still in flight); ``read(ring,
    word)``: its ``words`` words with one shared load. A thread's own copies are
    visible to it after the wait; nothing is shared between lanes.
    """
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i8p = ir.IntType(8).as_pointer()
    i32, i64 = ir.IntType(32), ir.IntType(64)
    to_shared = "{ .reg .u64 sa64; .reg .u32 sa32; cvta.to.shared.u64 sa64, $%d; " \
                "cvt.u32.u64 sa32, sa64; %s }"

    def pointer(context, builder, aty, aval, idx, itemsize):
        ary = context.make_array(aty)(context, builder, aval)
        if idx.type.width < 64:
            idx = builder.sext(idx, i64)
        return builder.gep(builder.bitcast(ary.data, i8p),
                           [builder.mul(idx, ir.Constant(i64, itemsize))])

    nbytes = 4 * words
    level = "cg" if nbytes == 16 else "ca"
    outs = ", ".join(f"${i}" for i in range(words))
    vec = f".v{words}" if words > 1 else ""
    dst = f"{{{outs}}}" if words > 1 else outs

    @intrinsic
    def copy(typingctx, ring, word, arr, flat):
        sig = types.void(ring, word, arr, flat)

        def codegen(context, builder, sig, args):
            sp = pointer(context, builder, sig.args[0], args[0], args[1], 4)
            gp = pointer(context, builder, sig.args[2], args[2], args[3], itemsize)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p])
            text = to_shared % (0, f"cp.async.{level}.shared.global [sa32], [$1], {nbytes};")
            builder.call(ir.InlineAsm(fnty, text, "l,l,~{memory}", side_effect=True), [sp, gp])
            return context.get_dummy_value()

        return sig, codegen

    commit = ptx_statement("cp.async.commit_group;")
    wait = ptx_statement(f"cp.async.wait_group {stages - 2};")

    @intrinsic
    def read(typingctx, ring, word):
        sig = types.UniTuple(types.uint32, words)(ring, word)

        def codegen(context, builder, sig, args):
            sp = pointer(context, builder, sig.args[0], args[0], args[1], 4)
            ret = ir.LiteralStructType([i32] * words) if words > 1 else i32
            fnty = ir.FunctionType(ret, [i8p])
            text = to_shared % (words, f"ld.shared{vec}.u32 {dst}, [sa32];")
            cons = ",".join(["=r"] * words) + ",l,~{memory}"
            r = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), [sp])
            vals = [builder.extract_value(r, i) for i in range(words)] if words > 1 else [r]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return copy, commit, wait, read


@functools.lru_cache(maxsize=None)
def async_ring_ops(kind, vec, stages):
    """``(copy, commit, wait, read, word_type, words)`` for a warp's ring of rows.

    ``copy(ring, word, arr, flat)`` starts copying the ``vec`` elements at
    ``flat`` of a 16-bit array to ``ring[word:word + words]``; ``commit()``
    closes a group of copies; ``wait()`` waits until at most ``stages - 2``
    groups are in flight; ``read(ring, word)`` returns the ``words`` values.
    On a GPU a word is a uint32 holding two elements (``cp.async``, 16 bytes);
    the simulator copies at once, one float32 an element. ``vec``: 2, 4 or 8.
    """
    if SIMULATOR:
        load = _sim_loader(vec, kind)

        def copy(ring, word, arr, flat):
            vals = load(arr, flat)
            for i in range(vec):
                ring[word + i] = vals[i]

        def nothing():
            return None

        def read(ring, word):
            return tuple(ring[word + i] for i in range(vec))

        return copy, nothing, nothing, read, float32, vec
    if vec not in (2, 4, 8):
        raise ValueError(f"async rows: expected pieces of 2, 4 or 8 elements, got {vec}")
    per = 4 // ITEMSIZE[kind]  # elements a 32-bit word
    if vec % per:
        raise ValueError(f"async rows: {vec} elements of {kind} are not whole words")
    copy, commit, wait, read = _gpu_async_ops(stages, vec // per, ITEMSIZE[kind])
    return copy, commit, wait, read, uint32, vec // per


@functools.lru_cache(maxsize=None)
def packed_row_io(kind, vec):
    """``(load, elem, word_type, words)`` for rows kept packed in registers.

    ``load(arr, flat)`` reads ``vec`` 16-bit elements as ``words`` values of
    ``word_type``; ``elem(buf, i)`` is element ``i`` of a buffer of such words,
    as float32. On a GPU a word is a uint32 holding two elements (a row takes
    half the registers of its float32 form and is converted where it is used);
    the simulator keeps one float32 an element.
    """
    if SIMULATOR:
        def elem(buf, i):
            return buf[i]

        return _sim_loader(vec, kind), device_fn(elem), float32, vec
    unpack = _unpacker(kind)
    per = 4 // ITEMSIZE[kind]  # elements a 32-bit word

    def elem_gpu(buf, i):
        return unpack(buf[i // per])[i % per]

    return _raw_loader(vec // per, ITEMSIZE[kind]), device_fn(elem_gpu), uint32, vec // per


@functools.lru_cache(maxsize=None)
def load_row_vec(kind, n):
    """The vector loader for dtype ``kind`` (None: the array's) and width ``n``
    (see ``_vector_loader``)."""
    if SIMULATOR:
        return _sim_loader(n, kind)
    return _vector_loader(kind, n)


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------

def row_layout(head_dim, kind, lanes=WARP):
    """``(VEC, CH)``: elements per vector load and vector loads per lane per row,
    for rows spread over ``lanes`` lanes.

    The vector path needs ``D % (lanes*VEC) == 0`` (no predication); other head
    sizes use scalar loads (``VEC=1``, ``CH=ceil(D/lanes)``, predicated). 16-byte
    loads of 16-bit rows (``VEC=8``) are used when a row has fewer than 32 lanes.
    fp8 codes load whole 32-bit words (``VEC`` 4 or 8: ``_vector_loader``); a row
    that would split into pieces of 2 (D 32 over 16 lanes) takes the scalar path.
    """
    vecs = (8, 4, 2) if kind != "f32" and lanes < WARP else (4, 2)
    if kind in ("f8", "f8_e5m2"):
        vecs = tuple(v for v in vecs if v % 4 == 0)
    for vec in vecs:
        if head_dim % (lanes * vec) == 0:
            return vec, head_dim // (lanes * vec)
    return 1, (head_dim + lanes - 1) // lanes


def heads_per_block(group, per_lane):
    """Query heads of a kv group one block serves: the largest divisor of the
    group size that keeps ``heads * per_lane <= 32`` fp32 registers for q and acc."""
    best = 1
    for gb in range(1, group + 1):
        if group % gb == 0 and gb * per_lane <= 32:
            best = gb
    return best


@functools.lru_cache(maxsize=None)
def fast_decode_kernel(kind, vec, chunks, heads, group, warps=WARPS, unroll=4, lanes=WARP,
                       pipeline=False, scatter=True, stages=0, pdl=False, defect=None,
                       paging=None, t_q=1, scales="tensor"):
    """The split-KV, group-shared decode kernel.

    kind: 'f32' / 'f16' / 'bf16' (cache dtype), vec / chunks: ``row_layout``,
    heads: query heads per block (GB), group: query heads per kv head
    (``H // H_kv``, a multiple of GB; a constant of the kernel, so a block finds
    its heads without runtime division), warps: warps per block (NW),
    unroll: positions per lane group and warp step (U), lanes: lanes per row
    (LPR, a power of two <= 32), pipeline: 16-bit vector rows only (see below),
    scatter: with the pipeline, one score a lane where ``GB * U == LPR``,
    stages: with the pipeline, the stages of a warp's shared-memory ring (0:
    two register buffers; see below), pdl: every block releases the combine
    launched after it as it starts (``attention.core.pdl``; sm_90 and later),
    defect: None or a planted switch of ``DEFECTS`` (module docstring; the
    combine's own switches leave this kernel unchanged), paging: None (a
    pooled cache and a slot table) or a page layout, "HND" / "NHD" (a paged
    cache and a page table; below), t_q: queries a sequence (below),
    scales: fp8 caches ('f8') only, the scale mode (below).

    fp8 scales: the kernel takes two more arguments, ``k_sc`` and ``v_sc``.
    "tensor": float32 [1] each, every score multiplied by the K scale and the
    output by the V scale. "token_head": a scale a cached row, float32 in the
    cache's layout without D (pooled ``[KV_SLOTS, H_kv, max_seq]``, HND
    ``[num_pages, H_kv, P]``, NHD ``[num_pages, P, H_kv]``): each K and V row
    is dequantized in registers as it is used, code * its row's scale (one
    float32 rounding: the float32 value of the dequantized cache), then enters
    the scores and the P.V sum as any row (fp32 throughout). Rows past a
    length are never asked for their scales (a step's rows past the end
    re-read row ``end - 1``'s, whose weight is 0).

    Multi-token decode (``t_q = T > 1``): q holds T queries a sequence, the
    kernel's q / out / lse / partials carry ``T * H`` heads, query-major (q
    ``[M, T, H, D]`` viewed as ``[M, T * H, D]``), and query ``i`` of sequence
    ``m`` attends positions ``0 .. len_m - T + i`` (causal within the new
    tokens; the length counts them). A block serves one query of its kv
    group's heads: grid axis 1 is ``(head block, query)`` with the query
    fastest, so the T blocks that read the same K/V rows are neighbours and
    the repeats of a row come from L2, not from memory; the block's length is
    its query's, ``len_m - T + 1 + i``, so nothing else in the kernel changes.
    A length in ``1 .. T - 1`` cannot hold the new tokens: it is flagged as a
    bad length (``ERR_LENGTHS``) and attended as empty, as a length past the
    capacity is; a length of 0 is an empty sequence. ``t_q = 1`` compiles the
    single-query kernel unchanged.

    Paging: with ``paging`` the fifth argument is a page table ``[M,
    max_pages]`` int32 and the caches are ``[num_pages, H_kv, P, D]`` ("HND")
    or ``[num_pages, P, H_kv, D]`` ("NHD"), P the page size: position ``pos``
    of sequence ``m`` is row ``pos % P`` of page ``table[m, pos // P]`` (a
    shift and a mask when P is a power of two). Each row's address is formed
    from its own page, so pages may be shared and in any order. The pooled
    cache is the HND case with one page a sequence (P = max_seq), and keeps
    its own address form (``paging=None``: one base a block, rows a constant
    apart), so the pooled kernel is unchanged.

    A warp holds ``R = 32 / LPR`` rows at once: lane group ``g`` takes
    positions ``tile + R u + g``, so one butterfly of
    ``log2 LPR`` shuffles reduces ``R`` scores together; each group keeps its
    own softmax state, and the groups of a warp are merged by shuffles at the
    end, before the warps are merged through shared memory.

    ``pipeline``: rows stay packed (two 16-bit elements a 32-bit register)
    and a warp loads its next step's rows before it computes on the current
    ones (two register buffers, used in turn), so a warp's loads overlap its
    own arithmetic instead of waiting at the top of every step. Rows are
    converted to float32 where they are used, one row at a time, and the P.V
    update is ``acc * alpha + sum_u (p_u * beta) v_u``. With ``stages = S > 0``
    the rows arrive instead through a ring of ``S`` stages a warp in dynamic
    shared memory (``ring_bytes``): each lane starts copying its own 16-byte
    pieces of step ``t + S - 1`` (``cp.async``) before it computes step ``t``
    and reads them back itself after ``cp.async.wait_group S - 2`` (no barrier:
    nothing is shared between lanes), so ``S - 1`` steps are in flight a warp
    without holding registers (one register buffer, ~160 registers).

    ``scatter`` (where ``GB * U == LPR``, e.g. GQA 4 with 16 lanes and U 4):
    the ``GB * U`` partial dot products of a lane group are reduce-scattered
    (the butterfly's pairs, so each score is the same sum as ``group_sum``'s)
    so that lane ``j`` of a group holds the score of (head, position)
    ``divmod(j, U)``; the tile softmax and the running state of a head live in
    its ``U`` lanes (one exponential a lane instead of ``GB * U``), and the
    P.V step takes each head's ``alpha`` and ``p * beta`` by shuffles:
    fewer instructions a position than ``GB * U`` butterflies and softmaxes
    repeated in every lane. A step where no head's running max moved (every
    ``alpha`` is exactly 1, the usual case once a few steps are in) skips the
    rescale of ``acc`` (one vote instead of ``GB * E`` multiplies by 1).

    Grid ``(n_split, H_kv * (H // H_kv) // GB, M)``, block ``32*NW`` threads.
    Arguments: q [M, H, D], k_cache / v_cache [KV_SLOTS, H_kv, max_seq, D],
    seq_lens [M] int32, slot_table [M] int32, scale float32, chunk int32
    (positions per split), out [M, H, D] f32, lse [M, H] f32,
    part_acc [M, H, n_split, D] f32, part_ml [M, H, n_split, 2] f32 (written
    when ``n_split > 1``, else out / lse are), err [ERR_WORDS] int32 (the
    device range check's flag, ``clear_flag``).

    Device range check: a sequence whose length is outside
    ``[0, min(max_seq, n_split * chunk)]`` (past the cache's capacity, or past
    the positions the plan's splits cover) or whose slot is outside
    ``[0, KV_SLOTS)`` is attended as empty (zeros, LSE -inf; nothing is read)
    and counted in ``err`` by one thread of its first block:
    ``err[ERR_COUNT] += 1``, ``err[ERR_FIRST] = min(err[ERR_FIRST], seq)``,
    and ``err[ERR_SLOTS]`` or ``err[ERR_LENGTHS]`` += 1 (``raise_flagged``
    turns it into a ``RangeError``). Two comparisons a block, before any load.
    Paged: max_seq is ``max_pages * P``; the page entries of a block's own
    chunk (positions below the length only: entries past them are never read)
    are checked by the block's threads together before any row load, and a
    chunk holding a page outside ``[0, num_pages)`` is attended as empty and
    counted (``ERR_SLOTS``) by each head block 0 of such a chunk.
    """
    VEC, CH, GB, NW, U, LPR = vec, chunks, heads, warps, unroll, lanes
    R = WARP // LPR  # rows a warp holds at once
    if R * LPR != WARP:
        raise ValueError(f"lanes: expected a power of two <= {WARP}, got {lanes}")
    E = CH * VEC  # elements of a row per lane
    ROW = CH * LPR * VEC  # row length in the lane layout (>= D)
    STRIDE = LPR * VEC  # elements between a lane's vector loads in a row
    VECTOR = VEC > 1
    # local / shared array sizes must be plain closure constants
    N_HEAD_REG = GB * E
    N_ROW_REG = 1 if pipeline else U * E  # the one-buffer loop's rows
    N_SCORE = GB * U
    N_SH_ACC = NW * GB * ROW
    N_SH_ML = NW * GB * 2
    # how the cache's elements convert (the planted fp8_as_e5m2 decodes e4m3 codes as e5m2)
    ROWS = "f8_e5m2" if kind == "f8" and defect == "fp8_as_e5m2" else kind
    load = load_row_vec(ROWS, VEC) if VECTOR else None
    if kind == "f8" and not VECTOR:  # scalar loads of fp8 codes: decoded arithmetically
        from attention.cache.fp8 import e4m3_value

        code_value = e5m2_value if ROWS == "f8_e5m2" else e4m3_value
    else:
        code_value = None
    load_q = load_row_vec(None, VEC) if VECTOR else None  # q: fp32 or the cache's dtype
    GROUP = group
    if GROUP % GB:
        raise ValueError(f"heads: expected a divisor of the group size {GROUP}, got {GB}")
    BLOCKS_PER_GROUP = GROUP // GB
    TQ = int(t_q)
    if not 1 <= TQ <= MAX_T_Q:
        raise ValueError(f"t_q: expected 1..{MAX_T_Q} queries a sequence, got {t_q}")
    PIPE = bool(pipeline)
    # scores reduce-scattered: one (head, position) a lane (GB * U == LPR)
    SCATTER = PIPE and bool(scatter) and GB * U == LPR and (U & (U - 1)) == 0
    if PIPE and not (VECTOR and kind != "f32"):
        raise ValueError("pipeline: needs a 16-bit cache with vector rows")
    release_dependents, _ = grid_dependency_ops(bool(pdl))
    check_defect(defect)
    # planted switches: closure constants, so a kernel without one is unchanged
    GQA_MOD = defect == "gqa_mod"
    SLOT_OFF = defect == "slot_off_by_one"
    ONE_SHORT = defect == "one_short"
    P_FP16 = defect == "p_fp16"
    P_BF16 = defect == "p_bf16"
    ROUND_P = P_FP16 or P_BF16
    Q_BF16 = defect == "q_bf16"
    SCALE_FP16 = defect == "scale_fp16"
    MAX_FP16 = defect == "max_fp16"
    LSE_FP16 = defect == "lse_fp16"
    EXP_APPROX = defect == "exp_approx"
    SPLIT_OFF = defect == "split_off_by_one"
    RING_STALE = defect == "ring_stale"
    if paging not in (None, "HND", "NHD"):
        raise ValueError(f"paging: expected None, 'HND' or 'NHD', got {paging!r}")
    PAGED = paging is not None
    NHD = paging == "NHD"
    PAGE_OFF = defect == "page_off_by_one"
    PAGE_STRIDE = defect == "page_offset_stride"
    CAUSAL_OFF = defect == "causal_off_by_one"
    F8 = kind == "f8"  # e4m3 codes, with scales k_sc / v_sc
    if scales not in FP8_SCALES:
        raise ValueError(f"scales: expected one of {FP8_SCALES}, got {scales!r}")
    TOK = F8 and scales == "token_head"  # a scale a row: [.., .., ..] float32 arrays
    F8_TENSOR = F8 and not TOK  # float32 [1] scales: on the scores and the output
    if defect in FP8_TOKEN_DEFECTS and not TOK:
        raise ValueError(f"defect: {defect!r} needs an fp8 kernel with token_head scales")
    SCALE_TWICE = defect == "fp8_scale_twice"
    NO_K_SCALE = defect == "fp8_no_k_scale"
    WRONG_HEAD = defect == "fp8_scale_wrong_head"
    WRONG_TOKEN = defect == "fp8_scale_wrong_token"
    # fp8 scales the pipelined step reads, kept after the GB alphas of its
    # ``alpha_h`` (one array, so the steps' signatures are those of the other
    # kernels): tensor, alpha_h[GB] = the K scale; token_head, the step's rows'
    # K scales, then their V scales
    N_ALPHA = GB + 2 * U if TOK else (GB + 1 if F8_TENSOR else GB)
    K_SCALED = F8_TENSOR and not NO_K_SCALE  # tensor: each score times the K scale
    N_RSC = 2 * U if TOK else 1  # the one-buffer loop's row scales

    def page_entry(entry, n_pages):
        # the page a table entry names (the planted switch: the next one)
        pg = int64(entry)
        if PAGE_OFF:
            pg = (pg + 1) % n_pages
        return pg

    page_entry = device_fn(page_entry)

    def page_at(table, seq, pos, page, shift, n_pages):
        # (page index, row in the page) of position pos
        j, off = page_split(pos, page, shift)
        return page_entry(table[seq, j], n_pages), off

    page_at = device_fn(page_at)

    def row_in_page(pg, off, n_kv, kv_head, page):
        # row index (in rows of D elements) of row ``off`` of page ``pg``
        if NHD != PAGE_STRIDE:  # the planted switch takes the other layout's form
            return (pg * page + off) * n_kv + kv_head
        return (pg * n_kv + kv_head) * page + off

    row_in_page = device_fn(row_in_page)

    def page_row(table, seq, pos, n_kv, kv_head, page, shift, n_pages):
        # row index (in rows of D elements) of position pos
        pg, off = page_at(table, seq, pos, page, shift, n_pages)
        return row_in_page(pg, off, n_kv, kv_head, page)

    page_row = device_fn(page_row)

    def page_axes(off, kv_head, n_kv, page):
        # a row's indices on the page's two middle axes: (kv head, offset) for
        # HND, (offset, kv head) for NHD; the planted stride switch takes the
        # row-in-page number of the other layout's form, decoded in this one's
        # (so it stays inside the page)
        if PAGE_STRIDE:
            if NHD:
                r = kv_head * page + off
                return r // n_kv, r % n_kv
            r = off * n_kv + kv_head
            return r // page, r % page
        if NHD:
            return off, kv_head
        return kv_head, off

    page_axes = device_fn(page_axes)

    def row_of(table, seq, row0, pos, n_kv, kv_head, page, shift, n_pages):
        # the row of position pos: pooled, row0 + pos; paged, through the table
        if PAGED:
            return page_row(table, seq, pos, n_kv, kv_head, page, shift, n_pages)
        return row0 + pos

    row_of = device_fn(row_of)

    def scale_at(sc, table, seq, slot, pos, n_kv, kv_head, page, shift, n_pages):
        # token_head: position pos's scale in ``sc`` (the cache's layout without
        # D; pooled: [slot, kv head, pos]). A page entry outside [0, num_pages)
        # reads page 0 (the ring path meets one while streaming and discards
        # the chunk); the planted switches read another head's or the next
        # position's scale
        g = kv_head
        if WRONG_HEAD:
            g = (kv_head + 1) % n_kv
        if PAGED:
            j, off = page_split(pos, page, shift)
            entry = table[seq, j]
            if entry < 0 or entry >= n_pages:
                entry = 0
            pg = page_entry(entry, n_pages)
        else:
            pg = int64(slot)
            off = pos
        if WRONG_TOKEN:
            off = (off + 1) % page  # pooled: page is max_seq
        if NHD:
            return sc[pg, off, g]
        return sc[pg, g, off]

    scale_at = device_fn(scale_at)

    def load_scales(rs, at, k_sc, v_sc, table, seq, slot, tile, end, grp, n_kv, kv_head, page,
                    shift, n_pages):
        # token_head: the K and V scales of this lane group's U rows of the step
        # at ``tile`` into rs[at + u] and rs[at + U + u] (a row past the end:
        # row end - 1's, which its zero weight meets)
        for u in range(U):
            pos = min(tile + u * R + grp, end - 1)
            rs[at + u] = scale_at(k_sc, table, seq, slot, pos, n_kv, kv_head, page, shift,
                                  n_pages)
            rs[at + U + u] = scale_at(v_sc, table, seq, slot, pos, n_kv, kv_head, page, shift,
                                      n_pages)

    load_scales = device_fn(load_scales)

    def round_p(x):
        # a softmax weight as the p_fp16 / p_bf16 mutants hold it
        if P_FP16:
            return round_fp16(x)
        return round_bf16(x)

    round_p = device_fn(round_p)

    def tile_softmax(score, h, m_run, l_run):
        # head h's U scores score[h*U : h*U+U] -> exp(s - m_ref), merged into
        # m_run[h], l_run[h]; returns the merge's (alpha, beta)
        m_tile = score[h * U]
        for u in range(1, U):
            m_tile = max(m_tile, score[h * U + u])
        # with R > 1 rows a step, a lane group's U positions can all lie past
        # the end (m_tile = -inf): exponentiate against 0 then, so its weights
        # are exp(-inf) = 0, not exp(-inf + inf) = NaN
        m_ref = m_tile if m_tile > float32(-3.0e38) else float32(0.0)
        l_tile = float32(0.0)
        for u in range(U):
            if EXP_APPROX:
                p = chop_exp(score[h * U + u] - m_ref)
            else:
                p = math.exp(score[h * U + u] - m_ref)
            score[h * U + u] = p
            l_tile += p
        if EXP_APPROX:
            m_new, l_new, alpha, beta = merge_chop_exp(m_run[h], l_run[h], m_tile, l_tile)
        else:
            m_new, l_new, alpha, beta = online_softmax_merge(m_run[h], l_run[h], m_tile, l_tile)
        m_run[h] = m_new
        if MAX_FP16:
            m_run[h] = round_fp16(m_new)
        l_run[h] = l_new
        return alpha, beta

    tile_softmax = device_fn(tile_softmax)
    if PIPE:
        load_packed, elem, WORD, W = packed_row_io(ROWS, VEC)
        N_BUF = U * CH * W  # packed words of U rows a lane
        STEP = NW * R * U  # positions a block's warps cover in one step

        def load_row(kbuf, vbuf, k_cache, v_cache, flat, u):
            # row u of the step: CH vector loads of K and of V from element flat
            for c in range(CH):
                kt = load_packed(k_cache, flat + c * STRIDE)
                vt = load_packed(v_cache, flat + c * STRIDE)
                for w in range(W):
                    kbuf[(u * CH + c) * W + w] = kt[w]
                    vbuf[(u * CH + c) * W + w] = vt[w]

        def load_rows(kbuf, vbuf, k_cache, v_cache, row0, tile, end, grp, sub, table, seq,
                      n_kv, kv_head, page, shift, n_pages):
            # U rows of K and V per lane group, packed (a row is ROW == D elements)
            if PAGED:  # each row through its page
                for u in range(U):
                    pos = min(tile + u * R + grp, end - 1)
                    r = page_row(table, seq, pos, n_kv, kv_head, page, shift, n_pages)
                    load_row(kbuf, vbuf, k_cache, v_cache, r * ROW + sub * VEC, u)
            elif tile + U * R <= end:
                # every row of the step is in the chunk: one address, and each
                # row's a constant offset from it (loads with immediate offsets)
                base = (row0 + tile + grp) * ROW + sub * VEC
                for u in range(U):
                    load_row(kbuf, vbuf, k_cache, v_cache, base + u * R * ROW, u)
            else:
                # the chunk's last step: positions past the end re-read row end - 1
                for u in range(U):
                    pos = min(tile + u * R + grp, end - 1)
                    load_row(kbuf, vbuf, k_cache, v_cache, (row0 + pos) * ROW + sub * VEC, u)

        def tile_step(kbuf, vbuf, tile, end, grp, sub, q_reg, acc, m_run, l_run, score, row,
                      alpha_h):
            # scores: one K row converted at a time, GB heads against it
            for u in range(U):
                for e in range(E):
                    row[e] = elem(kbuf, u * E + e)
                if TOK:  # dequantized: code * the row's K scale (alpha_h[GB + u])
                    for e in range(E):
                        row[e] *= alpha_h[GB + u]
                for h in range(GB):
                    part = float32(0.0)
                    for e in range(E):
                        part += q_reg[h * E + e] * row[e]
                    s = group_sum(part, LPR)
                    if K_SCALED:  # the K scale (alpha_h[GB])
                        s = s * alpha_h[GB]
                    score[h * U + u] = s if tile + u * R + grp < end else float32(-math.inf)
            # tile softmax merged into the running state; score <- p * beta
            for h in range(GB):
                alpha, beta = tile_softmax(score, h, m_run, l_run)
                alpha_h[h] = alpha
                for u in range(U):
                    score[h * U + u] *= beta
                if ROUND_P:
                    for u in range(U):
                        score[h * U + u] = round_p(score[h * U + u])
            # P.V: one V row converted at a time
            for h in range(GB):
                for e in range(E):
                    acc[h * E + e] *= alpha_h[h]
            for u in range(U):
                for e in range(E):
                    row[e] = elem(vbuf, u * E + e)
                if TOK:  # dequantized: code * the row's V scale (alpha_h[GB + U + u])
                    for e in range(E):
                        row[e] *= alpha_h[GB + U + u]
                for h in range(GB):
                    for e in range(E):
                        acc[h * E + e] += score[h * U + u] * row[e]

        def tile_step_scattered(kbuf, vbuf, tile, end, grp, sub, q_reg, acc, m_run, l_run,
                                score, row, alpha_h):
            # the lane's share of each of the GB*U = LPR dot products
            for u in range(U):
                for e in range(E):
                    row[e] = elem(kbuf, u * E + e)
                if TOK:  # dequantized: code * the row's K scale
                    for e in range(E):
                        row[e] *= alpha_h[GB + u]
                for h in range(GB):
                    part = float32(0.0)
                    for e in range(E):
                        part += q_reg[h * E + e] * row[e]
                    score[h * U + u] = part
            # reduce-scatter over the lane group (group_sum's pairs, in its
            # order): at each level a lane keeps half of its values, adds its
            # partner's copy of them, and sends the other half; lane ``sub``
            # ends with the score of (h, u) = divmod(sub, U)
            half = LPR // 2
            while half > 0:
                upper = (sub & half) != 0
                for i in range(half):
                    send = score[i] if upper else score[i + half]
                    keep = score[i + half] if upper else score[i]
                    score[i] = keep + cuda.shfl_xor_sync(FULL, send, half)
                half //= 2
            u_mine = sub % U
            if K_SCALED:  # the K scale (alpha_h[GB])
                s = score[0] * alpha_h[GB] if tile + u_mine * R + grp < end else float32(
                    -math.inf)
            else:
                s = score[0] if tile + u_mine * R + grp < end else float32(-math.inf)
            # tile softmax over the U lanes of a head, merged into the lane's
            # running state (m_run[0], l_run[0]: the state of head sub // U)
            m_tile = s
            off = 1
            while off < U:
                m_tile = max(m_tile, cuda.shfl_xor_sync(FULL, m_tile, off))
                off *= 2
            m_ref = m_tile if m_tile > float32(-3.0e38) else float32(0.0)
            if EXP_APPROX:
                p = chop_exp(s - m_ref)
            else:
                p = math.exp(s - m_ref)
            l_tile = p
            off = 1
            while off < U:
                l_tile += cuda.shfl_xor_sync(FULL, l_tile, off)
                off *= 2
            if EXP_APPROX:
                m_new, l_new, alpha, beta = merge_chop_exp(m_run[0], l_run[0], m_tile, l_tile)
            else:
                m_new, l_new, alpha, beta = online_softmax_merge(m_run[0], l_run[0], m_tile,
                                                                 l_tile)
            m_run[0] = m_new
            if MAX_FP16:
                m_run[0] = round_fp16(m_new)
            l_run[0] = l_new
            pb = p * beta
            if ROUND_P:
                pb = round_p(pb)
            # P.V: each head's alpha and p * beta from the lanes that hold them
            base = grp * LPR
            if not cuda.all_sync(FULL, alpha == float32(1.0)):  # no max moved: skip
                for h in range(GB):
                    a = cuda.shfl_sync(FULL, alpha, base + h * U)
                    for e in range(E):
                        acc[h * E + e] *= a
            for u in range(U):
                for e in range(E):
                    row[e] = elem(vbuf, u * E + e)
                if TOK:  # dequantized: code * the row's V scale
                    for e in range(E):
                        row[e] *= alpha_h[GB + U + u]
                for h in range(GB):
                    w = cuda.shfl_sync(FULL, pb, base + h * U + u)
                    for e in range(E):
                        acc[h * E + e] += w * row[e]

        STG = int(stages)
        if STG == 1 or STG < 0:
            raise ValueError(f"stages: expected 0 or at least 2, got {stages}")
        if STG:
            copy, commit, wait, read_piece, _, _ = async_ring_ops(ROWS, VEC, STG)
        else:
            copy = commit = wait = read_piece = None
        PIECES = U * CH * WARP  # ring pieces (VEC elements) of K in one stage of a warp
        RING_STAGE = 2 * PIECES * W  # words of a stage: K pieces, then V pieces

        def issue_row(ring, at, k_cache, v_cache, flat, u, lane):
            # row u's pieces of this lane: ring word at + ((u CH + c) 32 + lane) W
            for c in range(CH):
                word = at + ((u * CH + c) * WARP + lane) * W
                copy(ring, word, k_cache, flat + c * STRIDE)
                copy(ring, word + PIECES * W, v_cache, flat + c * STRIDE)

        def fetch_pages(pgs, slot0, table, seq, tile, end, grp, page, shift, whole):
            # the page-table entries of the step at ``tile`` (this lane group's U
            # rows) into pgs[slot0 ...], loaded before issue_rows uses them:
            # nothing reads them until then, so the table's latency hides behind
            # other work. ``whole``: a step's R * U positions lie in one page
            # (pgs[slot0] only)
            if whole:
                j, _ = page_split(min(tile + grp, end - 1), page, shift)
                pgs[slot0] = table[seq, j]
            else:
                for u in range(U):
                    pos = min(tile + u * R + grp, end - 1)
                    j, _ = page_split(pos, page, shift)
                    pgs[slot0 + u] = table[seq, j]

        def checked_page(entry, n_pages, bad):
            # a table entry as a page index; one outside [0, num_pages) is never
            # dereferenced: page 0 is read instead and ``bad[0]`` set (the block
            # then discards its chunk: the merge below)
            if entry < 0 or entry >= n_pages:
                bad[0] = 1
                return page_entry(0, n_pages)
            return page_entry(entry, n_pages)

        def issue_rows(ring, at, k_cache, v_cache, row0, tile, end, grp, sub, lane, pgs,
                       slot0, n_kv, kv_head, page, shift, n_pages, whole, bad):
            # as load_rows, into the ring stage at word ``at``; paged: the rows'
            # table entries were fetched into pgs[slot0 ...] (fetch_pages)
            if PAGED and whole and tile + U * R <= end:
                # one page, rows a constant apart: the pooled path's address form
                _, off = page_split(tile + grp, page, shift)
                pg = checked_page(pgs[slot0], n_pages, bad)
                r = row_in_page(pg, off, n_kv, kv_head, page)
                base = r * ROW + sub * VEC
                apart = R * ROW if NHD == PAGE_STRIDE else R * n_kv * ROW
                for u in range(U):
                    issue_row(ring, at, k_cache, v_cache, base + u * apart, u, lane)
            elif PAGED:
                for u in range(U):
                    pos = min(tile + u * R + grp, end - 1)
                    _, off = page_split(pos, page, shift)
                    pg = checked_page(pgs[slot0] if whole else pgs[slot0 + u], n_pages, bad)
                    r = row_in_page(pg, off, n_kv, kv_head, page)
                    issue_row(ring, at, k_cache, v_cache, r * ROW + sub * VEC, u, lane)
            elif tile + U * R <= end:
                base = (row0 + tile + grp) * ROW + sub * VEC
                for u in range(U):
                    issue_row(ring, at, k_cache, v_cache, base + u * R * ROW, u, lane)
            else:
                for u in range(U):
                    pos = min(tile + u * R + grp, end - 1)
                    issue_row(ring, at, k_cache, v_cache, (row0 + pos) * ROW + sub * VEC, u,
                              lane)

        def read_rows(ring, at, kbuf, vbuf, lane):
            # this lane's pieces of the stage at word ``at`` into the register buffer
            for u in range(U):
                for c in range(CH):
                    word = at + ((u * CH + c) * WARP + lane) * W
                    kt = read_piece(ring, word)
                    vt = read_piece(ring, word + PIECES * W)
                    for w in range(W):
                        kbuf[(u * CH + c) * W + w] = kt[w]
                        vbuf[(u * CH + c) * W + w] = vt[w]

        issue_row = device_fn(issue_row)
        fetch_pages = device_fn(fetch_pages)
        checked_page = device_fn(checked_page)
        issue_rows = device_fn(issue_rows)
        read_rows = device_fn(read_rows)
        load_row = device_fn(load_row)
        load_rows = device_fn(load_rows)
        tile_step = device_fn(tile_step_scattered if SCATTER else tile_step)
    else:
        load_rows = tile_step = issue_rows = read_rows = commit = wait = fetch_pages = None
        N_BUF, WORD, STEP, STG, RING_STAGE = 1, float32, 1, 0, 0
    RING = PIPE and STG > 0  # rows through the shared-memory ring
    N_PGS = max(STG - 1, 1) * U  # paged ring: table entries a lane holds

    def body(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk,
             out, lse, part_acc, part_ml, err, k_sc, v_sc):
        release_dependents()  # the combine's blocks may be placed from now on
        qscale = scale
        # fp8 tensor: each score times the K scale (not folded into q's scale:
        # fl(scale * k_scale) would be one rounding shared by every score, a
        # bias of the LSE at large scores), the output times the V scale
        vscale = float32(1.0)
        kscale = float32(1.0)
        if F8_TENSOR:
            kscale = k_sc[0]
            vscale = v_sc[0]
            if SCALE_TWICE:
                vscale = vscale * v_sc[0]
        split = cuda.blockIdx.x
        head_block = cuda.blockIdx.y
        seq = cuda.blockIdx.z
        n_split = cuda.gridDim.x
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        grp = lane // LPR  # the lane group (row) within the warp
        sub = lane % LPR  # the lane within its row
        n_heads = q.shape[1]
        head_dim = q.shape[2]
        if NHD:
            n_kv = k_cache.shape[2]
            page = k_cache.shape[1]
        else:
            n_kv = k_cache.shape[1]
            page = k_cache.shape[2]
        max_seq = page  # pooled: one page a sequence
        n_pages = k_cache.shape[0]
        shift = -1
        # a warp step's R * U positions (aligned to R * U) lie in one page
        whole = PAGED and page % (R * U) == 0
        if PAGED:
            max_seq = slot_table.shape[1] * page
            if page & (page - 1) == 0:
                shift = 0
                while (1 << shift) < page:
                    shift += 1

        # -- which kv group, query heads, slot and chunk this block reads --
        t = 0  # the block's query (multi-token decode)
        if TQ > 1:
            t = head_block % TQ
            head_block = head_block // TQ
        kv_head = head_block // BLOCKS_PER_GROUP
        head0 = kv_head * GROUP + (head_block % BLOCKS_PER_GROUP) * GB
        if GQA_MOD:
            kv_head = head0 % n_kv
        qh0 = head0  # the block's first row of q / out (query-major with TQ > 1)
        if TQ > 1:
            qh0 = t * (n_heads // TQ) + head0
        slot = 0 if PAGED else slot_table[seq]
        length = seq_lens[seq]
        # -- the device range check: a length past the positions the grid covers
        # (or the capacity), or a slot outside the pool, makes the sequence
        # empty (nothing is read) and is counted in ``err`` (once a sequence) --
        if TQ > 1:
            if 0 < length < TQ:
                length = -1  # cannot hold the new tokens: a bad length (below)
        if (length < 0 or length > min(max_seq, n_split * chunk) or slot < 0
                or slot >= k_cache.shape[0]):
            if split == 0 and head_block == 0 and t == 0 and cuda.threadIdx.x == 0:
                cuda.atomic.add(err, ERR_COUNT, 1)
                cuda.atomic.min(err, ERR_FIRST, int32(seq))
                if slot < 0 or slot >= k_cache.shape[0]:
                    cuda.atomic.add(err, ERR_SLOTS, 1)
                else:
                    cuda.atomic.add(err, ERR_LENGTHS, 1)
            length = 0
            slot = 0
        if SLOT_OFF:
            slot = (slot + 1) % k_cache.shape[0]
        if ONE_SHORT:
            length = max(length - 1, 0)
        if TQ > 1 and length > 0:
            # query t sees positions 0 .. length - TQ + t (the planted switch: one more)
            extra = 1 if CAUSAL_OFF and t < TQ - 1 else 0
            length = length - TQ + 1 + t + extra
        start = split * chunk
        end = min(length, start + chunk)
        if SPLIT_OFF:
            end = min(length, start + chunk + 1)
        bad = cuda.local.array(1, int32)  # ring kernels: a bad page met while streaming
        bad[0] = 0
        if PAGED and not RING:
            # the chunk's page entries, checked by the block's threads together
            flagged = 0
            if end > start:
                j = start // page + cuda.threadIdx.x
                last = (end - 1) // page
                nb = cuda.blockDim.x
                while j + (CHECK_AHEAD - 1) * nb <= last:  # CHECK_AHEAD loads in flight
                    for a in range(CHECK_AHEAD):
                        pg = slot_table[seq, j + a * nb]
                        if pg < 0 or pg >= n_pages:
                            flagged = 1
                    j += CHECK_AHEAD * nb
                while j <= last:
                    pg = slot_table[seq, j]
                    if pg < 0 or pg >= n_pages:
                        flagged = 1
                    j += nb
            if cuda.syncthreads_or(flagged):
                if head_block == 0 and t == 0 and cuda.threadIdx.x == 0:
                    cuda.atomic.add(err, ERR_COUNT, 1)
                    cuda.atomic.min(err, ERR_FIRST, int32(seq))
                    cuda.atomic.add(err, ERR_SLOTS, 1)
                end = start

        # -- q of GB heads (pre-scaled) and the per-head running state --
        q_reg = cuda.local.array(N_HEAD_REG, float32)
        acc = cuda.local.array(N_HEAD_REG, float32)
        m_run = cuda.local.array(GB, float32)
        l_run = cuda.local.array(GB, float32)
        for h in range(GB):
            if VECTOR:  # a lane's VEC elements of a chunk in one vector load
                q_at = (int64(seq) * n_heads + qh0 + h) * head_dim + sub * VEC
                for c in range(CH):
                    qt = load_q(q, q_at + c * STRIDE)
                    for v in range(VEC):
                        acc[h * E + c * VEC + v] = float32(0.0)
                        q_reg[h * E + c * VEC + v] = qt[v] * qscale
                        if Q_BF16:
                            q_reg[h * E + c * VEC + v] = round_bf16(qt[v]) * qscale
                        if SCALE_FP16:
                            q_reg[h * E + c * VEC + v] = round_fp16(q_reg[h * E + c * VEC + v])
            else:
                for c in range(CH):
                    d = c * STRIDE + sub
                    acc[h * E + c] = float32(0.0)
                    q_reg[h * E + c] = float32(0.0)
                    if d < head_dim:
                        q_reg[h * E + c] = float32(q[seq, qh0 + h, d]) * qscale
                        if Q_BF16:
                            q_reg[h * E + c] = round_bf16(float32(q[seq, qh0 + h, d])) * qscale
                        if SCALE_FP16:
                            q_reg[h * E + c] = round_fp16(q_reg[h * E + c])
            m_run[h] = float32(-math.inf)
            l_run[h] = float32(0.0)

        score = cuda.local.array(N_SCORE, float32)
        row0 = (int64(slot) * n_kv + kv_head) * max_seq

        tile = start + warp * R * U
        if PIPE:
            ka = cuda.local.array(N_BUF, WORD)
            va = cuda.local.array(N_BUF, WORD)
            row = cuda.local.array(E, float32)
            alpha_h = cuda.local.array(N_ALPHA, float32)
            if F8_TENSOR:
                alpha_h[GB] = kscale
            if STG:
                # -- the warp's ring: steps t+1 .. t+S-1 in flight while t is computed --
                ring = cuda.shared.array(0, WORD)
                at0 = warp * STG * RING_STAGE
                # paged: the table entries of the prologue's steps (all loaded
                # before any is used), then of the next issue (slot 0)
                pgs = cuda.local.array(N_PGS, int32)
                if PAGED:
                    for i in range(STG - 1):
                        if tile + i * STEP < end:
                            fetch_pages(pgs, i * U, slot_table, seq, tile + i * STEP, end, grp,
                                        page, shift, whole)
                for i in range(STG - 1):
                    if tile + i * STEP < end:
                        issue_rows(ring, at0 + i * RING_STAGE, k_cache, v_cache, row0,
                                   tile + i * STEP, end, grp, sub, lane, pgs, i * U,
                                   n_kv, kv_head, page, shift, n_pages, whole, bad)
                    commit()  # one group a step, empty past the end: the wait counts steps
                if PAGED and tile + (STG - 1) * STEP < end:
                    fetch_pages(pgs, 0, slot_table, seq, tile + (STG - 1) * STEP, end, grp,
                                page, shift, whole)
                i = 0
                while tile < end:
                    ahead = tile + (STG - 1) * STEP
                    if ahead < end:
                        issue_rows(ring, at0 + ((i + STG - 1) % STG) * RING_STAGE, k_cache,
                                   v_cache, row0, ahead, end, grp, sub, lane, pgs, 0,
                                   n_kv, kv_head, page, shift, n_pages, whole, bad)
                        if PAGED and ahead + STEP < end:  # the next issue's entries, now
                            fetch_pages(pgs, 0, slot_table, seq, ahead + STEP, end, grp, page,
                                        shift, whole)
                    commit()
                    wait()  # step i's group has landed
                    read_rows(ring, at0 + (i % STG) * RING_STAGE, ka, va, lane)
                    if RING_STALE:
                        if i > 0 and tile + STEP >= end:  # the last step: the stage before
                            read_rows(ring, at0 + ((i - 1) % STG) * RING_STAGE, ka, va, lane)
                    if TOK:
                        load_scales(alpha_h, GB, k_sc, v_sc, slot_table, seq, slot, tile, end,
                                    grp, n_kv, kv_head, page, shift, n_pages)
                    tile_step(ka, va, tile, end, grp, sub, q_reg, acc, m_run, l_run, score, row,
                              alpha_h)
                    tile += STEP
                    i += 1
            else:
                # -- two packed buffers in turn: load step t+1, then compute step t --
                kb = cuda.local.array(N_BUF, WORD)
                vb = cuda.local.array(N_BUF, WORD)
                if tile < end:
                    load_rows(ka, va, k_cache, v_cache, row0, tile, end, grp, sub, slot_table,
                              seq, n_kv, kv_head, page, shift, n_pages)
                while tile < end:
                    nxt = tile + STEP
                    if nxt < end:
                        load_rows(kb, vb, k_cache, v_cache, row0, nxt, end, grp, sub,
                                  slot_table, seq, n_kv, kv_head, page, shift, n_pages)
                    if TOK:
                        load_scales(alpha_h, GB, k_sc, v_sc, slot_table, seq, slot, tile, end,
                                    grp, n_kv, kv_head, page, shift, n_pages)
                    tile_step(ka, va, tile, end, grp, sub, q_reg, acc, m_run, l_run, score, row,
                              alpha_h)
                    tile = nxt
                    if tile >= end:
                        break
                    nxt = tile + STEP
                    if nxt < end:
                        load_rows(ka, va, k_cache, v_cache, row0, nxt, end, grp, sub,
                                  slot_table, seq, n_kv, kv_head, page, shift, n_pages)
                    if TOK:
                        load_scales(alpha_h, GB, k_sc, v_sc, slot_table, seq, slot, tile, end,
                                    grp, n_kv, kv_head, page, shift, n_pages)
                    tile_step(kb, vb, tile, end, grp, sub, q_reg, acc, m_run, l_run, score, row,
                              alpha_h)
                    tile = nxt
            if SCATTER:
                # every lane takes every head's state from the lane that kept it
                m_mine = m_run[0]
                l_mine = l_run[0]
                for h in range(GB):
                    m_run[h] = cuda.shfl_sync(FULL, m_mine, grp * LPR + h * U)
                    l_run[h] = cuda.shfl_sync(FULL, l_mine, grp * LPR + h * U)

        k_reg = cuda.local.array(N_ROW_REG, float32)
        v_reg = cuda.local.array(N_ROW_REG, float32)
        if TOK:
            rsc = cuda.local.array(N_RSC, float32)  # the step's rows' K, then V scales
        while not PIPE and tile < end:
            # -- load U rows of K and V per lane group (all issued before any use) --
            if TOK:
                load_scales(rsc, 0, k_sc, v_sc, slot_table, seq, slot, tile, end, grp, n_kv,
                            kv_head, page, shift, n_pages)
            for u in range(U):
                pos = min(tile + u * R + grp, end - 1)  # past the end: re-read the last row
                if VECTOR:
                    base = (row_of(slot_table, seq, row0, pos, n_kv, kv_head, page, shift, n_pages)
                            * head_dim + sub * VEC)
                    for c in range(CH):
                        kt = load(k_cache, base + c * STRIDE)
                        vt = load(v_cache, base + c * STRIDE)
                        for v in range(VEC):
                            k_reg[u * E + c * VEC + v] = kt[v]
                            v_reg[u * E + c * VEC + v] = vt[v]
                else:
                    for c in range(CH):
                        d = c * LPR + sub
                        k_reg[u * E + c] = float32(0.0)
                        v_reg[u * E + c] = float32(0.0)
                        if d < head_dim and PAGED:
                            pg, off = page_at(slot_table, seq, pos, page, shift, n_pages)
                            a1, a2 = page_axes(off, kv_head, n_kv, page)
                            if F8:  # e4m3 codes
                                k_reg[u * E + c] = code_value(int32(k_cache[pg, a1, a2, d]))
                                v_reg[u * E + c] = code_value(int32(v_cache[pg, a1, a2, d]))
                            else:
                                k_reg[u * E + c] = float32(k_cache[pg, a1, a2, d])
                                v_reg[u * E + c] = float32(v_cache[pg, a1, a2, d])
                        elif d < head_dim:
                            if F8:
                                k_reg[u * E + c] = code_value(
                                    int32(k_cache[slot, kv_head, pos, d]))
                                v_reg[u * E + c] = code_value(
                                    int32(v_cache[slot, kv_head, pos, d]))
                            else:
                                k_reg[u * E + c] = float32(k_cache[slot, kv_head, pos, d])
                                v_reg[u * E + c] = float32(v_cache[slot, kv_head, pos, d])
                if TOK:  # dequantized: codes * the row's K / V scale
                    for e in range(E):
                        k_reg[u * E + e] *= rsc[u]
                        v_reg[u * E + e] *= rsc[U + u]

            # -- scores: U positions x GB heads, each reduced over its lane group --
            for h in range(GB):
                for u in range(U):
                    part = float32(0.0)
                    for e in range(E):
                        part += q_reg[h * E + e] * k_reg[u * E + e]
                    s = group_sum(part, LPR)
                    if K_SCALED:
                        s = s * kscale
                    score[h * U + u] = s if tile + u * R + grp < end else float32(-math.inf)

            # -- tile softmax, merged into the running state; P.V --
            for h in range(GB):
                alpha, beta = tile_softmax(score, h, m_run, l_run)
                if ROUND_P:
                    for u in range(U):
                        score[h * U + u] = round_p(score[h * U + u])
                for e in range(E):
                    pv = float32(0.0)
                    for u in range(U):
                        pv += score[h * U + u] * v_reg[u * E + e]
                    acc[h * E + e] = acc[h * E + e] * alpha + pv * beta
            tile += NW * R * U

        if PAGED and RING:
            # a page outside [0, num_pages) met while streaming (read as page 0,
            # never dereferenced): the chunk is attended as empty, and counted
            if cuda.syncthreads_or(bad[0]):
                for h in range(GB):
                    m_run[h] = float32(-math.inf)
                    l_run[h] = float32(0.0)
                    for e in range(E):
                        acc[h * E + e] = float32(0.0)
                if head_block == 0 and t == 0 and cuda.threadIdx.x == 0:
                    cuda.atomic.add(err, ERR_COUNT, 1)
                    cuda.atomic.min(err, ERR_FIRST, int32(seq))
                    cuda.atomic.add(err, ERR_SLOTS, 1)

        # -- merge the R lane groups of each warp (butterfly over groups) --
        off = WARP // 2
        while off >= LPR:
            for h in range(GB):
                m2 = cuda.shfl_xor_sync(FULL, m_run[h], off)
                l2 = cuda.shfl_xor_sync(FULL, l_run[h], off)
                if EXP_APPROX:
                    m_new, l_new, alpha, beta = merge_chop_exp(m_run[h], l_run[h], m2, l2)
                else:
                    m_new, l_new, alpha, beta = online_softmax_merge(m_run[h], l_run[h], m2, l2)
                for e in range(E):
                    a2 = cuda.shfl_xor_sync(FULL, acc[h * E + e], off)
                    acc[h * E + e] = acc[h * E + e] * alpha + a2 * beta
                m_run[h] = m_new
                if MAX_FP16:
                    m_run[h] = round_fp16(m_new)
                l_run[h] = l_new
            off //= 2

        # -- merge the NW warps' states through shared memory --
        sh_acc = cuda.shared.array(N_SH_ACC, float32)
        sh_ml = cuda.shared.array(N_SH_ML, float32)
        for h in range(GB):
            if grp == 0:
                for c in range(CH):
                    for v in range(VEC):
                        sh_acc[(warp * GB + h) * ROW + c * STRIDE + sub * VEC + v] = \
                            acc[h * E + c * VEC + v]
            if lane == 0:
                sh_ml[(warp * GB + h) * 2] = m_run[h]
                sh_ml[(warp * GB + h) * 2 + 1] = l_run[h]
        cuda.syncthreads()  # every warp's partial state is in shared memory

        for idx in range(cuda.threadIdx.x, GB * ROW, NW * WARP):
            h = idx // ROW
            d = idx % ROW
            if d < head_dim:
                # the NW states of head h as one batch: its max, then one weight a
                # warp (independent exponentials, not NW chained merges)
                m_all = sh_ml[h * 2]
                for w in range(1, NW):
                    m_all = max(m_all, sh_ml[(w * GB + h) * 2])
                m_ref = batch_reference(m_all)
                l_all = float32(0.0)
                a_all = float32(0.0)
                for w in range(NW):
                    if EXP_APPROX:
                        wt = chop_exp(sh_ml[(w * GB + h) * 2] - m_ref)
                    else:
                        wt = math.exp(sh_ml[(w * GB + h) * 2] - m_ref)
                    l_all += wt * sh_ml[(w * GB + h) * 2 + 1]
                    a_all += wt * sh_acc[(w * GB + h) * ROW + d]
                if F8_TENSOR:
                    a_all *= vscale
                head = qh0 + h
                if n_split == 1:
                    # -- one chunk: normalise; an empty sequence gives zeros, -inf --
                    inv, lse_h = softmax_finish(m_all, l_all)  # accurate 1 / l, log l
                    out[seq, head, d] = a_all * inv
                    if d == 0:
                        lse[seq, head] = lse_h
                        if LSE_FP16:
                            lse[seq, head] = round_fp16(lse[seq, head])
                else:
                    part_acc[seq, head, split, d] = a_all
                    if d == 0:
                        part_ml[seq, head, split, 0] = m_all
                        part_ml[seq, head, split, 1] = l_all

    body = device_fn(body)

    if F8:
        def kernel(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk,
                   out, lse, part_acc, part_ml, err, k_sc, v_sc):
            body(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk, out, lse, part_acc,
                 part_ml, err, k_sc, v_sc)
    else:
        def kernel(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk,
                   out, lse, part_acc, part_ml, err):
            body(q, k_cache, v_cache, seq_lens, slot_table, scale, chunk, out, lse, part_acc,
                 part_ml, err, 0, 0)

    kernel.__name__ = kernel.__qualname__ = (
        ("decode_fast_pdl_" if pdl else "decode_fast_") + f"{kind}_v{VEC}c{CH}g{GB}of{GROUP}w{NW}u{U}"
        + ("" if LPR == WARP else f"l{LPR}")
        + ("p" if PIPE else "") + ("s" if SCATTER else "") + (f"a{STG}" if STG else "")
        + ("" if paging is None else "_paged" + paging)
        + ("" if TQ == 1 else f"_t{TQ}") + ("_tok" if TOK else "")
        + ("" if defect is None else "_" + defect))
    return jit(kernel, fastmath=True)


# ---------------------------------------------------------------------------
# the device range check's flag
# ---------------------------------------------------------------------------



def clear_flag():
    """The host value of a clear flag: int32 [ERR_WORDS] (no bad sequence)."""
    flag = np.zeros(ERR_WORDS, np.int32)
    flag[ERR_FIRST] = NO_SEQUENCE
    return flag


_DEFAULT_FLAGS = {}  # device id (or "only" on a machine of one device) -> flag


def default_flag():
    """The flag ``launch`` passes when its caller gives none: one int32
    [ERR_WORDS] device array a device, allocated (cleared) at its first use
    and never read by this module (``read_flag(default_flag(), ...)`` does)."""
    only = _DEFAULT_FLAGS.get("only")
    if only is not None:  # one device: no device lookup once the flag exists
        return only
    key = 0 if SIMULATOR else cuda.get_current_device().id
    flag = _DEFAULT_FLAGS.get(key)
    if flag is None:
        flag = _DEFAULT_FLAGS[key] = cuda.to_device(clear_flag())
        if SIMULATOR or len(cuda.gpus) == 1:
            _DEFAULT_FLAGS["only"] = flag
    return flag


def range_limit(pl, max_seq):
    """The longest length plan ``pl`` serves on a cache of capacity
    ``max_seq``: the positions its splits cover, at most the capacity."""
    return min(int(max_seq), int(pl["n_split"]) * int(pl["chunk"]))


def raise_flagged(flag, seq_lens, slot_table, limit, n_slots, paged=False, t_q=1):
    """RangeError for a host copy ``flag`` of a set device flag, else nothing.

    flag:       int32 [ERR_WORDS] as the main kernel left it
    seq_lens:   [M] int, the lengths launched with (host or device; one element
                of it is read here)
    slot_table: [M] int, the slots launched with (None: ``arange(M)``)
    limit:      the longest valid length (``range_limit``), n_slots: KV_SLOTS
                (paged: the page count)
    paged:      ``slot_table`` is a page table [M, max_pages]
    t_q:        queries a sequence (a length of 1 .. t_q - 1 is flagged too)
    The message names ``slot_table`` or ``seq_lens``, the first flagged
    sequence, its value (as it is now) and the valid range, and how many
    sequences were flagged.
    """
    count = int(flag[ERR_COUNT])
    if count == 0:
        return
    m = int(flag[ERR_FIRST])
    more = "" if count == 1 else f" ({count} sequences flagged, this is the first)"
    if paged and int(flag[ERR_SLOTS]):
        length = _element(seq_lens, m)
        if (length == 0 or t_q <= length) and length <= limit:
            raise checks.RangeError(
                f"page_table: sequence {m} (length {length}) has a page index outside "
                f"[0, num_pages={n_slots}) among the entries of its first "
                f"ceil(length / page_size) pages; the splits holding it were attended as "
                f"empty{more}")
    slot = None if (slot_table is None or paged) else _element(slot_table, m)
    if slot is not None and not 0 <= slot < n_slots:
        raise checks.RangeError(
            f"slot_table: sequence {m} has slot {slot}, expected a slot in "
            f"[0, KV_SLOTS={n_slots}); it was attended as empty{more}")
    length = _element(seq_lens, m)
    if t_q > 1 and 0 < length < t_q:
        raise checks.RangeError(
            f"seq_lens: sequence {m} has length {length}, fewer than the t_q={t_q} new "
            f"tokens it must hold; expected 0 or a length in [{t_q}, {limit}]; it was "
            f"attended as empty{more}")
    raise checks.RangeError(
        f"seq_lens: sequence {m} has length {length}, expected a length in [0, {limit}] "
        f"(the cache's capacity, or the positions the plan's splits cover); it was "
        f"attended as empty{more}")


def _element(x, i):
    """``int(x[i])`` for a host or device integer array (device: one element copied)."""
    if is_host_array(x) or isinstance(x, (list, tuple)):
        return int(x[i])
    if hasattr(x, "data_ptr") and hasattr(x, "cpu"):  # torch
        return int(x[i].item())
    return int(np.asarray(to_host(as_device_view(x)[i:i + 1]))[0])


def read_flag(flag, seq_lens, slot_table, limit, n_slots, paged=False, t_q=1):
    """Synchronise, read device ``flag``, clear it, and ``raise_flagged``."""
    cuda.synchronize()
    host = to_host(flag)
    if int(host[ERR_COUNT]):
        flag.copy_to_device(clear_flag())
        raise_flagged(host, seq_lens, slot_table, limit, n_slots, paged, t_q)


COMBINE_BATCH = 8  # partials a warp loads together before it merges them
COMBINE_WARPS = 8  # most warps a combine block has (<= COMBINE_BATCH), each over a run


def combine_warps(n_split):
    """Warps of a combine block: one per ``COMBINE_BATCH`` splits, at most
    ``COMBINE_WARPS`` (one warp merges 8 or fewer splits with no barrier)."""
    return max(1, min(COMBINE_WARPS, -(-int(n_split) // COMBINE_BATCH)))


@functools.lru_cache(maxsize=None)
def combine_kernel(chunks, pdl=False, defect=None):
    """Merge split-KV partials: grid ``(H, M[, S])``, block ``32 * combine_warps(n_split)``.

    chunks: the columns of a block over 32 (lane ``j`` of a warp holds ``d = 32
    chunks z + 32 c + j``, ``z`` = ``blockIdx.z``): ``ceil(D / 32)`` with a 2-D
    grid; with a third grid axis of ``S = ceil(D / (32 chunks))`` slices each
    block merges its slice of the columns (the same bits: a column's arithmetic
    does not depend on the slicing; every slice reads the (max, sum) pairs, and
    slice 0 writes the lse). Wide rows take slices (MLA's D 512 at B 1: 16
    blocks of 256 KB of partials each took 37 us on the H200, notes/bench.md
    run 23).
    part_acc [M, H, n_split, D] f32, part_ml [M, H, n_split, 2] f32 (max, sum);
    out [M, H, D] f32, lse [M, H] f32. Empty partials (m=-inf, l=0) drop out;
    all empty gives zeros and -inf.

    Warp ``w`` of ``W`` takes the ``w``-th run of ``ceil(n_split / W)``
    consecutive splits, ``COMBINE_BATCH`` at a time: it loads a batch (all of
    its ``D`` values), takes the batch's softmax (its max, one weight a
    partial, weighted sums: the exponentials are independent of each other)
    and folds it into its running state with ``online_softmax_merge``
    (``fold``). With ``W > 1`` warp 0 then folds the warps' states, read back
    from shared memory, as one more batch. One thread per ``d`` walking all
    splits was load-latency bound (19 us for 128 splits at B 1, L 32768 on the
    H200, reports/bench/ncu of run 5); a warp now waits for
    ``ceil(n_split / (W * COMBINE_BATCH))`` rounds of loads, and a batch costs
    one exponential of latency where merging its partials one by one cost
    ``COMBINE_BATCH`` dependent merges.

    ``pdl``: the kernel waits for the main kernel's grid (``griddepcontrol.wait``)
    before it reads a partial, so it may be launched as a programmatic
    dependent (``attention.core.pdl``: its launch and ramp overlap the main kernel).

    ``defect``: None or a planted switch of ``DEFECTS`` (module docstring);
    ``combine_drops_split``, ``combine_no_max``, ``exp_approx`` and
    ``lse_fp16`` act here, the others leave this kernel unchanged.
    """
    NB, CW, CHD = COMBINE_BATCH, COMBINE_WARPS, chunks
    check_defect(defect)
    DROP_SPLIT = defect == "combine_drops_split"
    NO_MAX = defect == "combine_no_max"
    EXP_APPROX = defect == "exp_approx"
    LSE_FP16 = defect == "lse_fp16"
    if CW > NB:
        raise ValueError("COMBINE_WARPS: the warps' states are folded as one batch")
    N_BUF = NB * CHD
    ROW = CHD * WARP
    N_SH = CW * ROW
    N_SH_ML = 2 * CW  # array sizes must be plain closure constants
    _, wait_for_primary = grid_dependency_ops(bool(pdl))

    def fold(m_buf, l_buf, a_buf, m_all, l_all, acc):
        # the batch's softmax, folded into (m_all, l_all, acc); returns (m_all, l_all)
        m_b = m_buf[0]
        for j in range(1, NB):
            m_b = max(m_b, m_buf[j])
        m_ref = batch_reference(m_b)
        if NO_MAX:  # weights exp(m_j): the batch's state is taken relative to 0
            m_ref = float32(0.0)
            m_b = float32(0.0)
        l_b = float32(0.0)
        b_acc = cuda.local.array(CHD, float32)
        for c in range(CHD):
            b_acc[c] = float32(0.0)
        for j in range(NB):
            if EXP_APPROX:
                wt = chop_exp(m_buf[j] - m_ref)
            else:
                wt = math.exp(m_buf[j] - m_ref)
            l_b += wt * l_buf[j]
            for c in range(CHD):
                b_acc[c] += wt * a_buf[j * CHD + c]
        if EXP_APPROX:
            m_all, l_all, alpha, beta = merge_chop_exp(m_all, l_all, m_b, l_b)
        else:
            m_all, l_all, alpha, beta = online_softmax_merge(m_all, l_all, m_b, l_b)
        for c in range(CHD):
            acc[c] = acc[c] * alpha + b_acc[c] * beta
        return m_all, l_all

    fold = device_fn(fold)

    def kernel(part_acc, part_ml, out, lse):
        wait_for_primary()  # the partials are complete and visible past this
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        n_warps = cuda.blockDim.x // WARP  # <= CW
        n_split = part_acc.shape[2]
        if DROP_SPLIT:
            n_split -= 1
        head_dim = part_acc.shape[3]
        col0 = cuda.blockIdx.z * ROW  # this block's columns: col0 .. col0 + ROW
        per = (n_split + n_warps - 1) // n_warps
        first = warp * per
        last = min(first + per, n_split)
        m_buf = cuda.local.array(NB, float32)
        l_buf = cuda.local.array(NB, float32)
        a_buf = cuda.local.array(N_BUF, float32)
        acc = cuda.local.array(CHD, float32)
        for c in range(CHD):
            acc[c] = float32(0.0)
        m_all = float32(-math.inf)
        l_all = float32(0.0)
        for s0 in range(first, last, NB):
            # -- load NB partials (an empty state past the warp's last split) --
            for j in range(NB):
                m_buf[j] = float32(-math.inf)
                l_buf[j] = float32(0.0)
                for c in range(CHD):
                    a_buf[j * CHD + c] = float32(0.0)
                if s0 + j < last:
                    m_buf[j] = part_ml[seq, head, s0 + j, 0]
                    l_buf[j] = part_ml[seq, head, s0 + j, 1]
                    for c in range(CHD):
                        d = col0 + c * WARP + lane
                        if d < head_dim:
                            a_buf[j * CHD + c] = part_acc[seq, head, s0 + j, d]
            m_all, l_all = fold(m_buf, l_buf, a_buf, m_all, l_all, acc)

        # -- the warps' states, folded by warp 0 as one batch (block-uniform branch) --
        sh_acc = cuda.shared.array(N_SH, float32)
        sh_ml = cuda.shared.array(N_SH_ML, float32)
        if n_warps > 1:
            for c in range(CHD):
                sh_acc[warp * ROW + c * WARP + lane] = acc[c]
            if lane == 0:
                sh_ml[2 * warp] = m_all
                sh_ml[2 * warp + 1] = l_all
            cuda.syncthreads()
            if warp == 0:
                for j in range(NB):
                    m_buf[j] = float32(-math.inf)
                    l_buf[j] = float32(0.0)
                    for c in range(CHD):
                        a_buf[j * CHD + c] = float32(0.0)
                    if j < n_warps:
                        m_buf[j] = sh_ml[2 * j]
                        l_buf[j] = sh_ml[2 * j + 1]
                        for c in range(CHD):
                            a_buf[j * CHD + c] = sh_acc[j * ROW + c * WARP + lane]
                for c in range(CHD):
                    acc[c] = float32(0.0)
                m_all, l_all = fold(m_buf, l_buf, a_buf, float32(-math.inf), float32(0.0),
                                    acc)
        if warp == 0:
            inv, lse_h = softmax_finish(m_all, l_all)  # accurate 1 / l and log l
            for c in range(CHD):
                d = col0 + c * WARP + lane
                if d < head_dim:
                    out[seq, head, d] = acc[c] * inv
            if lane == 0 and col0 == 0:
                lse[seq, head] = lse_h
                if LSE_FP16:
                    lse[seq, head] = round_fp16(lse[seq, head])

    kernel.__name__ = kernel.__qualname__ = f"decode_fast_combine_c{CHD}" + (
        "_pdl" if pdl else "") + ("" if defect is None else "_" + defect)
    return jit(kernel, fastmath=True)


# ---------------------------------------------------------------------------
# launch planning and launcher
# ---------------------------------------------------------------------------

def fp8_capable():
    """True where the fp8 kernels' ``cvt.rn.f16x2.e4m3x2`` exists (sm_89 and
    later; the simulator decodes in Python; with no GPU, compile-only, True)."""
    if SIMULATOR or not gpu_available():
        return True
    return tuple(cuda.get_current_device().compute_capability) >= (8, 9)


def async_capable():
    """True where the pipelined kernel may use ``cp.async`` (sm_80 and later; the
    simulator emulates it; with no GPU, compile-only, True)."""
    if SIMULATOR or not gpu_available():
        return True
    return tuple(cuda.get_current_device().compute_capability) >= (8, 0)


def ring_bytes(warps, stages, unroll, chunks, kind, vec):
    """Dynamic shared memory of a block's rings: ``warps * stages`` stages of
    ``2 * unroll * chunks * 32`` pieces of ``vec`` elements (16 bytes at vec 8;
    the simulator stores a float32 an element). 0 without a ring."""
    if not stages:
        return 0
    piece = 4 * vec if SIMULATOR else ITEMSIZE[kind] * vec
    return warps * stages * 2 * unroll * chunks * WARP * piece


def _allow_shared(pl, args):
    """Let plan ``pl``'s kernel (for ``args``' types) take its dynamic shared
    memory (``ensure_dynamic_shared``, once a kernel, q dtype and device). The
    plan keeps what it has set up, so a launch through a kept plan does no
    device lookup: a plan belongs to the device it was first launched on
    (make one a device)."""
    ensure_dynamic_shared(pl["kernel"], args, pl["dyn_smem"], pl["static_smem"],
                          str(args[0].dtype), pl.setdefault("smem_ready", set()))


def split_count(pairs, max_len, resident=RESIDENT_BLOCKS[False]):
    """Default ``n_split`` for ``pairs = M * head_blocks`` blocks per split.

    Blocks run in waves of ``resident * N_SMS`` (``resident`` blocks a SM,
    ``RESIDENT_BLOCKS``). For the fewest
    waves ``k`` that can be filled to at least ``WAVE_FILL``, the most splits
    that fit in them: ``n_split = floor(k * wave / pairs)``. Fewer waves of
    longer blocks cost less (per-block set-up, partials, the combine), and a
    last wave of a few blocks costs as much as a full one. No split is shorter
    than ``MIN_CHUNK`` positions (that many splits are taken when no count up
    to it fills a wave that well). H200 sweep (notes/bench.md, run 7), fp16:
    B 1, L 32768: 1024 blocks (the earlier rule, ~16 blocks a SM) 74.3 us,
    792 blocks 66.9 us, 392 blocks 59.4 us; B 32, L 1024: 1024 -> 768 blocks,
    72.1 -> 65.0 us.
    """
    pairs = max(1, int(pairs))
    wave = int(resident) * N_SMS
    most = max(1, -(-max(int(max_len), 1) // MIN_CHUNK))
    waves = 1
    while True:
        n_split = (waves * wave) // pairs
        if n_split >= most:
            return most
        if n_split >= 1 and pairs * n_split >= WAVE_FILL * waves * wave:
            return n_split
        waves += 1


def split_chunk(max_len, step, pairs, resident, *, n_split=None, chunk=None):
    """``(chunk, n_split)`` of a split-KV plan over ``max_len`` positions whose
    chunks are whole multiples of ``step`` (the tensor-core kernels' rounds of
    tiles): a fixed ``chunk`` (a batch-invariant plan's; not with ``n_split``)
    rounded up to ``step``; else ``n_split`` (default ``split_count(pairs,
    max_len, resident)``) turned into a chunk. ``n_split`` is then trimmed to
    the chunks that hold a position."""
    step = int(step)
    if chunk is not None:
        if n_split is not None:
            raise ValueError("chunk, n_split: give one (a fixed chunk sets the split count)")
        chunk = -(-max(int(chunk), 1) // step) * step
    else:
        if n_split is None:
            n_split = split_count(pairs, max_len, resident)
        n_split = max(1, int(n_split))
        chunk = -(-max(int(max_len), 1) // n_split)
        chunk = -(-chunk // step) * step
    return chunk, -(-max(int(max_len), 1) // chunk)


def plan(m_count, n_heads, n_kv, head_dim, max_len, kind, *, n_split=None,
         warps=WARPS, unroll=UNROLL, lanes=None, pipeline=None, stages=None, pdl=None,
         defect=None, paging=None, chunk=None, t_q=1, fp8_scales="tensor"):
    """Launch plan: dict with kernel, grid, block, chunk, n_split.

    ``lanes``: lanes per row (default ``LANES[kind]``). ``pipeline``: packed,
    double-buffered rows (``fast_decode_kernel``); default ``PIPELINE`` for
    16-bit caches with vector rows, never for fp32. ``stages``: the pipelined
    kernel's shared-memory ring (default ``ASYNC_STAGES`` where ``cp.async``
    exists, ``async_capable``; 0: two register buffers). ``dyn_smem``: the
    ring's bytes, passed with the launch.

    ``n_split`` (default: ``split_count``) cuts each sequence into that many
    chunks of whole warp steps; a default count is then lowered to the chunks
    that hold a position (rounding chunks up to whole steps can leave the last
    splits empty). ``pdl`` (default ``attention.core.pdl.capable()``): a split plan's
    combine is launched as a programmatic dependent of the main kernel.
    ``defect``: None or a planted switch of ``DEFECTS`` for both kernels (kept
    in the plan: ``launch`` builds the combine with it). ``paging``: None (a
    pooled cache and slot table) or "HND" / "NHD" (a paged cache and page
    table; ``fast_decode_kernel``).

    ``chunk`` (batch-invariant plans): the positions a split covers, fixed
    by the caller (rounded up to whole warp steps); ``n_split`` is then the
    chunks ``max_len`` needs, and nothing in the plan depends on ``m_count``
    but the grid's last axis, so a sequence's result does not depend on the
    batch it is decoded in (``invariant_chunk``).

    ``t_q`` (1 .. ``MAX_T_Q``): queries a sequence (``fast_decode_kernel``'s
    multi-token decode); the grid's middle axis has ``t_q`` blocks a head
    block, and the split count counts them.

    ``fp8_scales`` (``kind`` "f8" only): "tensor" or "token_head" (the
    kernel's ``k_sc`` / ``v_sc``, ``fast_decode_kernel``).
    """
    check_defect(defect)
    if fp8_scales not in FP8_SCALES or (fp8_scales != "tensor" and kind != "f8"):
        raise checks.AttentionInputError(
            f"fp8_scales: expected one of {FP8_SCALES} ('token_head' with an fp8 cache only), "
            f"got {fp8_scales!r}")
    t_q = int(t_q)
    if not 1 <= t_q <= MAX_T_Q:
        raise checks.RangeError(f"t_q: expected 1..{MAX_T_Q} queries a sequence, got {t_q}")
    lanes = LANES[kind] if lanes is None else int(lanes)
    vec, chunks = row_layout(head_dim, kind, lanes)
    group = n_heads // n_kv
    gb = heads_per_block(group, vec * chunks)
    head_blocks = n_kv * (group // gb)
    packed = kind != "f32" and vec > 1
    pipeline = (PIPELINE and packed) if pipeline is None else bool(pipeline)
    if stages is None:
        stages = ASYNC_STAGES if async_capable() else 0
        per_stage = ring_bytes(warps, 1, 4 if unroll is None else unroll, chunks, kind, vec)
        stages = min(stages, RING_LIMIT // max(per_stage, 1))
        stages = stages if stages >= 2 else 0
    stages = int(stages) if pipeline else 0
    if chunk is not None and n_split is not None:
        raise ValueError("plan: give n_split or chunk, not both")
    trim = n_split is None and chunk is None
    if trim:
        n_split = split_count(m_count * head_blocks * t_q, max_len, RESIDENT_BLOCKS[pipeline])
    if chunk is not None:
        chunk = max(1, int(chunk))
        n_split = -(-max(max_len, 1) // chunk)
    n_split = max(1, int(n_split))
    fixed = chunk is not None
    chunk = -(-max(max_len, 1) // n_split) if chunk is None else chunk
    if unroll is None:
        unroll = 8 if chunk >= LONG_CHUNK and lanes == WARP else 4
    step = warps * unroll * (WARP // lanes)
    chunk = -(-chunk // step) * step  # whole warp steps
    if trim or fixed:  # no split left without a position
        n_split = -(-max(max_len, 1) // chunk)
    pdl = pdl_capable() if pdl is None else bool(pdl)
    return {
        # a switch that acts in the combine only leaves the main kernel the
        # production one: the same compiled kernel, not a copy compiled again
        # (each main kernel takes seconds to compile; the validation runs every
        # precision mutant on every geometry)
        "kernel": fast_decode_kernel(kind, vec, chunks, gb, group, warps, unroll, lanes,
                                     pipeline, SCATTERED, stages, pdl,
                                     None if defect in COMBINE_DEFECTS else defect, paging,
                                     t_q, fp8_scales),
        "paging": paging,
        "fp8_scales": fp8_scales,
        "t_q": t_q,
        "kind": kind,
        "group": group,
        "pdl": pdl,
        "stages": stages,
        "dyn_smem": ring_bytes(warps, stages, unroll, chunks, kind, vec),
        "static_smem": 4 * warps * gb * (2 + lanes * vec * chunks),
        "grid": (n_split, head_blocks * t_q, m_count),
        "block": warps * WARP,
        "chunk": int(chunk),
        "n_split": n_split,
        "heads_per_block": gb,
        "vec": vec,
        "unroll": unroll,
        "lanes": lanes,
        "pipeline": pipeline,
        "defect": defect,
    }


def invariant_chunk(n_heads, n_kv, head_dim, max_len, kind):
    """The split length of a batch-invariant plan (``plan(chunk=...)``): the
    chunk the default plan gives a lone sequence of ``max_len`` positions, so
    that one sequence still fills the GPU. It depends on the geometry, the
    capacity and the GPU, never on the batch."""
    return plan(1, n_heads, n_kv, head_dim, max_len, kind)["chunk"]


def check_fast(q, k_cache, v_cache, seq_lens, slot_table, fp8=False):
    """Validate a call; returns (M, H, H_kv, max_seq, D, kind, lens, slots).
    ``fp8``: the caches are fp8 e4m3 codes (uint8), q float32, float16 or
    bfloat16 (the caller checks the scales)."""
    cache_dtypes = (FP8_DTYPE,) if fp8 else CACHE_DTYPES
    n_slots, n_kv, max_seq, head_dim = checks.check_array(
        "k_cache", k_cache,
        (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", None)),
        dtypes=cache_dtypes)
    kind = dtype_kind(checks._dtype(k_cache), fp8)
    checks.check_head_dim("k_cache", head_dim)
    checks.check_array(
        "v_cache", v_cache,
        (("KV_SLOTS", n_slots), ("H_kv", n_kv), ("max_seq", max_seq), ("D", head_dim)),
        dtypes=cache_dtypes)
    checks.check_same_dtype([("k_cache", k_cache), ("v_cache", v_cache)])
    q_dtypes = CACHE_DTYPES if fp8 else (np.dtype(np.float32),) + (
        () if kind == "f32" else (checks._dtype(k_cache),))
    m_count, n_heads, q_dim = checks.check_array(
        "q", q, (("M", None), ("H", None), ("D", None)), dtypes=q_dtypes)
    checks.check_head_dim("q", q_dim)
    if q_dim != head_dim:
        raise checks.ShapeError(
            f"q: expected head_dim D={head_dim} (k_cache's), got D={q_dim}")
    checks.check_heads(n_heads, n_kv)
    if n_slots < m_count:
        raise checks.ShapeError(f"k_cache: expected KV_SLOTS >= M={m_count} slots, got {n_slots}")
    # with vector rows (the default layout's, which the entry points plan)
    # q and the caches are read in loads of up to 16 bytes: device arrays must
    # start on 16 bytes (any allocation does, and any view from a row start
    # where rows are vectors)
    if row_layout(head_dim, kind, LANES[kind])[0] > 1:
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            checks.check_aligned(name, x, 16)
    lens = checks.check_lengths("seq_lens", None if seq_lens is None else host_ints(seq_lens),
                                max_seq, count=m_count)
    slots = checks.check_slot_table(
        None if slot_table is None else host_ints(slot_table), m_count, n_slots)
    return m_count, n_heads, n_kv, max_seq, head_dim, kind, lens, slots


def _query_rows(x, rank):
    """A multi-token array ``[M, T, H, ...]`` of ``rank`` dimensions as ``[M, T
    * H, ...]`` (a view); one already of rank ``rank - 1`` is returned as is."""
    if x.ndim != rank:
        return x
    sh = tuple(int(x.shape[i]) for i in range(x.ndim))
    return x.reshape(sh[0], sh[1] * sh[2], *sh[3:])


def launch(pl, d_q, d_k, d_v, d_lens, d_slots, scale, d_out, d_lse, d_part_acc, d_part_ml,
           stream, *, err=None, scales=None):
    """Enqueue a planned decode (one or two launches) on ``stream`` (a numba
    stream, 0, or a cuda.core stream / graph builder). Buffers must be device
    arrays. With ``pl["pdl"]`` the combine is a programmatic dependent of the
    main kernel (``attention.core.pdl``), except in a graph capture, where it is
    launched plainly. The combine carries the plan's ``defect``.

    ``scales``: fp8 plans (``kind`` "f8"): ``(k_scale, v_scale)`` device arrays
    (the cache holds e4m3 codes; K = code * k_scale): float32 [1] with
    ``pl["fp8_scales"]`` "tensor", float32 in the cache's layout without D with
    "token_head" (``fast_decode_kernel``; shapes are the caller's to check).
    ``err``: the device range check's flag, int32 [ERR_WORDS] device array
    (``clear_flag``); default ``default_flag()``. A bad length or slot makes
    its sequence empty and is counted there (``read_flag`` raises it).

    Multi-token plans (``pl["t_q"] = T > 1``): q ``[M, T, H, D]``, out ``[M, T,
    H, D]``, lse ``[M, T, H]`` (or their ``[M, T * H, ...]`` views), the scratch
    from ``scratch(M, T * H, D, n_split)``."""
    tq = pl.get("t_q", 1)
    if tq > 1:  # [M, T, H, ...] as [M, T * H, ...]
        d_q, d_out, d_lse = _query_rows(d_q, 4), _query_rows(d_out, 4), _query_rows(d_lse, 3)
    n_kv = d_k.shape[2 if pl.get("paging") == "NHD" else 1]
    if d_q.shape[1] != tq * pl["group"] * n_kv:  # the kernel's group is a constant
        raise checks.ShapeError(
            f"q: expected H = {pl['group']} * H_kv = {pl['group'] * n_kv} heads "
            f"(the plan's group size) for each of {tq} queries, got {d_q.shape[1]} rows")
    args = (d_q, d_k, d_v, d_lens, d_slots, np.float32(scale), np.int32(pl["chunk"]),
            d_out, d_lse, d_part_acc, d_part_ml, default_flag() if err is None else err)
    if pl.get("kind") == "f8":
        if scales is None:
            raise checks.AttentionInputError(
                "scales: an fp8 plan needs (k_scale, v_scale) float32 device arrays")
        args = args + tuple(scales)
    _allow_shared(pl, args)
    pl["kernel"][pl["grid"], pl["block"], stream, pl["dyn_smem"]](*args)
    if pl["n_split"] > 1:
        m_count, n_heads = d_out.shape[0], d_out.shape[1]
        kern = combine_kernel(-(-int(d_out.shape[2]) // WARP), pl["pdl"],
                              combine_switch(pl.get("defect")))
        grid, block = (n_heads, m_count), combine_warps(pl["n_split"]) * WARP
        cargs = (d_part_acc, d_part_ml, d_out, d_lse)
        if pl["pdl"] and not is_graph_builder(stream):
            launch_dependent(kern, grid, block, stream, cargs)
        else:
            kern[grid, block, stream](*cargs)


def scratch(m_count, n_heads, head_dim, n_split, stream=None):
    """Split-KV scratch buffers (a 1-split placeholder when unused)."""
    ns = max(1, n_split)
    return (device_empty((m_count, n_heads, ns, head_dim), np.float32, stream),
            device_empty((m_count, n_heads, ns, 2), np.float32, stream))


def batched_decode_attention_fast(q, k_cache, v_cache, seq_lens, slot_table=None, *,
                                  scale=None, out=None, lse=None, stream=None,
                                  return_lse=False, n_split=None, defect=None):
    """Fast decode attention for M sequences over a pooled KV cache.

    q:          [M, H, D] float32 (or the cache's dtype)
    k_cache:    [KV_SLOTS, H_kv, max_seq, D] float32, float16 or bfloat16
                (numpy bf16 arrays are ``ml_dtypes.bfloat16``), KV_SLOTS >= M
    v_cache:    [KV_SLOTS, H_kv, max_seq, D] same dtype as k_cache
    seq_lens:   [M] int: positions 0..seq_lens[m]-1 of the slot are attended;
                0 gives zeros (LSE -inf)
    slot_table: [M] int, the cache slot of sequence m (default ``arange(M)``);
                slots not in the table, and positions past a length, are never read
    scale:      default 1/sqrt(D)
    out, lse:   optional output buffers [M, H, D] and [M, H] float32
    stream:     numba stream; None synchronises before returning
    n_split:    KV chunks per sequence (default: sized to fill the GPU)
    defect:     None, or a planted switch of ``DEFECTS`` (falsification and
                precision tests only; module docstring)
    Returns out [M, H, D] float32 (and lse [M, H] with ``return_lse``): numpy
    when q is numpy, else device arrays. Accumulation is fp32 for every dtype.
    """
    m_count, n_heads, n_kv, _, head_dim, kind, lens, slots = check_fast(
        q, k_cache, v_cache, seq_lens, slot_table)
    scale = checks.check_scale(scale, head_dim)
    check_defect(defect)
    if n_split is not None:
        checks.check_range("n_split", int(n_split), 1, 1 << 16, what="split count")
    host = is_host_array(q)
    if m_count == 0:
        o, s = np.zeros((0, n_heads, head_dim), np.float32), np.zeros((0, n_heads), np.float32)
        return (o, s) if return_lse else o
    pl = plan(m_count, n_heads, n_kv, head_dim, int(lens.max()), kind, n_split=n_split,
              defect=defect)
    st = launch_stream(stream)
    d_q, d_k = to_device(q, stream), to_device(k_cache, stream)
    d_v = to_device(v_cache, stream)
    d_lens, d_slots = to_device(lens, stream), to_device(slots, stream)
    d_out = output_array("out", out, (m_count, n_heads, head_dim), stream)
    d_lse = output_array("lse", lse, (m_count, n_heads), stream)
    d_pa, d_pm = scratch(m_count, n_heads, head_dim, pl["n_split"], stream)
    launch(pl, d_q, d_k, d_v, d_lens, d_slots, scale, d_out, d_lse, d_pa, d_pm, st)
    result = (d_out, d_lse)
    if host:
        result = (to_host(d_out, stream), to_host(d_lse, stream))
    finish(stream)
    return result if return_lse else result[0]
