"""Same-precision baselines: the oracle's arithmetic in float32, in a kernel family's order.

A kernel is held to what plain float32 arithmetic achieves on its inputs
(``validation.tolerance``). Which float32 arithmetic: the oracle's, with the
q.k scores (and MLA's absorbed query ``q_lat``) summed **in the order the
kernel family documents**, with FMA where the kernel uses FMA, and the softmax
scale applied where the kernel applies it. One order per kernel, named in the
registry (``validation.registry.KernelSpec.baseline``), so the factor 2 of the
rule is the only allowance for the kernel's other differences (online softmax,
``ex2.approx``, its position sums).

An order's label is ``"SUM/SCALE/NORM"``:

SUM (how the products of a dot product are added, ``dot``)
    ``matmul``       the oracle as written (BLAS's blocked order through ``@`` /
                     ``einsum``): no kernel documents it; the reports show it as
                     context.
    ``fma``          one running sum, one rounding a product (a fused
                     multiply-add): the fused prefill's and the GEMM prefill's
                     per-thread loops over the head dimension.
    ``lanesLxV``     the warp layout of the decode kernels: element ``d`` is in
                     lane ``(d // V) % L``; each lane runs an FMA sum over its
                     elements in increasing ``d``; then a butterfly over the
                     ``L`` lanes (``attention.core.warp.group_sum``; the shuffle-down
                     tree of ``warp_sum_down`` adds the same pairs). The warp
                     kernels are ``lanes32x1``; the fast decode's layout
                     depends on the cache dtype and D (``decode_fast``, below).
    ``interleaved4`` four FMA sums over ``d = 0, 4, ..`` / ``1, 5, ..`` / ..
                     up to ``W`` rounded down to 4, the tail added to the first,
                     then ``(a0 + a1) + (a2 + a3)``: the MLA tiled kernels
                     (``mla.kernels``).
    ``blockedP``     two levels: running FMA sums of ``P`` consecutive products
                     (a fresh partial each), added one after the other into the
                     total: the MLA GEMM path (``attention.gemm.tgemm``:
                     16-k partials; ``attention.gemm.sgemm``: 64-k partials). In MLA
                     every GEMM of the path is summed so (absorb, scores, P.V,
                     decompress: ``blocked_matmul``), since the path runs each
                     of them through the same GEMM.
    ``tcP``          ``blockedP`` as the tensor cores sum it (``attention.gemm.tgemm``):
                     both operands split in tf32 halves (``hi = tf32(x)``,
                     ``lo = tf32(x - hi)``), and per k8 step three mma terms
                     ``lo_a hi_b``, ``hi_a lo_b``, ``hi_a hi_b`` in that order,
                     each adding 8 exact products to the partial with one
                     rounding **towards zero** (the mma's fp32 sum truncates;
                     ``bench.tgemm_emu`` showed this model reproduces the
                     H200's errors, notes/validation.md). The partials are
                     added to the total with round to nearest, as in
                     ``blockedP``.
    ``decode_fast``  resolved per case (``resolve``) to the fast decode's
                     ``lanesLxV`` (``attention.decode.fast.row_layout``).
    ``lanesLxVc``    ``lanesLxV`` over an fp8 cache with one scale per tensor,
                     in the fast decode's order (``attention.decode.fast``,
                     ``F8_TENSOR``): q summed against the K codes' values, each
                     score times the K scale (one rounding), and
                     ``out = ((e @ V_codes) * vs) * fl(1 / l)``: the scales
                     stay out of the sums (``decode_order(..., k_scale=,
                     v_scale=)``). ``decode_fast_c`` resolves to it. Before,
                     the registry's ``decode_fp8`` took ``decode_fast`` over
                     the dequantized rows (``fl32(code * s)`` in the sums),
                     another order: a changed criterion (notes/validation.md,
                     the case that needed it). Decode cases quantized per
                     tensor only.
    ``mla_gemm``     resolved per case to ``tc16`` where the attention GEMMs
                     run on tensor cores (more heads than half a tile,
                     ``attention.gemm.tgemm``), else ``blocked64`` (``attention.gemm.sgemm``).
    ``mma16_pT``     the 16-bit tensor-core kernels (``attention.decode.mma``,
                     ``attention.prefill.mma``): S accumulated as
                     ``mma.m16n8k16`` does in this model (``mma16_scores``:
                     16-wide k steps, each added to the fp32 sum with
                     truncation), and P rounded to the 16-bit type ``T``
                     (``f16``, ``bf16``) before P.V: ``decode_rounded_p(...,
                     sums="mma16")`` and ``prefill_rounded_p`` (below).
                     ``T = 16`` names the case's dtype and is resolved per case
                     (``resolve``); ``T = f32`` (P kept in float32, no
                     rounding) is the order of a float32 case, which these
                     kernels do not take (the sweep reports it unsupported).
                     P is rounded by design, as in FlashAttention and FlashMLA:
                     the rule is unchanged, only its baseline rounds P too. q
                     and K are 16-bit, so every product of S is exact in
                     float32; the baseline sees the case's 16-bit values
                     exactly, as every baseline does. For kind ``mla``
                     (``mla.mma``, ``mla_decode(method="mma")``) the query
                     is formed first: ``q_lat = q_nope W_UK`` in float32,
                     ``[q_lat | q_pe]`` rounded to ``T`` (the kernel's
                     rounding of q), then the rounded-P attention over the
                     latent rows and ``o_lat W_UV^T`` in float32
                     (``mla_rounded_p``, below).
    ``mma16_pvT``    ``mma16_pT`` for the tensor-core decode over an fp8 cache
                     with a scale a row (``attention.decode.mma``, token_head):
                     the V scales cannot leave P.V (they vary along its k), so
                     the kernel rounds ``w / u`` to ``T``, with ``w = P vs``
                     and ``u`` a row's max of ``w``, and multiplies by ``u``
                     after (``decode_rounded_p(..., v_scales=)``). The same
                     precision as rounding P (weights in [0, 1] rounded to
                     ``T``), other roundings: a changed criterion,
                     notes/validation.md gives the case that needed it. Its
                     scores are the kernel's too: q summed against the K
                     codes' values, times the scale, times the row's K scale
                     (``k_scales=``; a second changed criterion: at |score|
                     near 1e4 an ulp of the score is 1e-3 of a weight, and the
                     sum over the dequantized rows drew other ulps,
                     notes/validation.md). Decode cases quantized per (token,
                     kv head) only.
    ``mma16_pcT``    ``mma16_pT`` for the tensor-core MLA decode over an fp8
                     latent cache with one scale per tensor (``mla.mma``,
                     ``fp8="tensor"``): the kernel's tile holds the codes'
                     values (exact in f16), so the c_kv part of each score
                     is summed over the codes, multiplied by the scale (one
                     rounding), and the k_pe part's k steps are added to it;
                     ``o_lat = ((p16 @ codes) * scale) / l``
                     (``mla_rounded_p(..., code_scale=)``). Before, the kernel
                     rounded ``fl32(e4m3(c) s)`` to f16 into its tile and the
                     baseline ``mma16_pT`` did the same: a changed criterion
                     (notes/validation.md). The tensor-core decode over an
                     fp8 cache with one scale per tensor (``attention.decode.
                     mma``) works the same way: s = ((K_codes q) * scale) *
                     ks, out = ((p16 @ V_codes) * vs) / l
                     (``decode_rounded_p(..., k_scales=, v_scale=)``); before,
                     its baseline summed over the dequantized rows (a second
                     changed criterion, notes/validation.md). Decode and MLA
                     cases quantized per tensor only.
    ``matmul_pT``    the same with S as numpy's float32 ``@``
                     (``decode_rounded_p``'s default; decode only). Not the
                     registry's: at the 'large' fixture (|score| 1e4) the
                     tensor-core decode's LSE is 3x this baseline's mean error
                     (truncated sums), and within 1.5x of ``mma16_pT``'s.
                     The rounded-P orders take SCALE ``after``, NORM ``divide``
                     (``(p16 @ v) / l``, ``l`` the sum of the unrounded P) or,
                     for decode, ``recip_after`` (``(p16 @ v) * fl(1 / l)``,
                     the tensor-core decode's epilogue: the registry's decode
                     entries since a changed criterion, notes/validation.md),
                     and EXP ``exp``, or for the prefill ``ex2fma`` (below).

SCALE
    ``after``        the scores are multiplied by the scale (the oracle's choice,
                     the GEMM paths' ``alpha``).
    ``before``       q is multiplied by the scale first, in float32 (the fused
                     and warp kernels' pre-scaled q).

NORM (how the weighted sum is normalised, ``attend``)
    ``divide``       ``(e @ v) / sum(e)``: the oracle (the default when omitted).
    ``recip_after``  ``(e @ v) * fl(1 / sum(e))``: the online-softmax kernels'
                     epilogue (a reciprocal, then one multiply an element).
    ``recip_first``  ``P = e * fl(1 / sum(e))`` written, then ``P @ v``: the
                     kernels whose softmax writes probabilities for a GEMM
                     (the GEMM prefill paths, the MLA GEMM path).

EXP (the exponential of the softmax)
    ``exp``          numpy's (correctly rounded; the default when omitted).
    ``ex2``          ``2 ** fl32(x * log2 e)``: what fast-math kernels evaluate
                     (``math.exp`` under ``fastmath=True`` is one multiply by
                     log2 e, rounded, then ``ex2.approx``); the argument's
                     rounding costs up to |x| units of float32 in a weight, which
                     numpy's exp does not. ``ex2.approx``'s own error (~2 ulps)
                     is left to the factor 2.
    ``ex2fma``       FlashAttention-2's weights, the tensor-core prefill's
                     (``mma16_pT`` only): ``2 ** fl32(fma(r, c, -fl(m c)))``
                     with r the raw scores, m their max and c = fl(scale log2 e):
                     the argument rounded at the size of the scaled scores (at
                     |score| 1e4, ~1e-3 of relative error in every weight but
                     the largest; the H200's prefill out mean error at the
                     'large' fixture is this, not P's rounding).
    ``ex2lg2``       ``ex2`` and the LSE as fast-math kernels form it:
                     ``m + log(l)`` is ``lg2.approx(l)`` times fl32(ln 2) added
                     to ``m`` in one fused multiply-add (the PTX of
                     ``x + math.log(y)`` under ``fastmath=True``). No kernel
                     forms it so now: the fast-math epilogues take an accurate
                     reciprocal and log (``attention.core.warp.softmax_finish``).

The FMA is emulated in float64 (``a * b`` of two float32 values is exact
there, the add is rounded once to float64 and then to float32; a double
rounding that differs from one fused rounding needs an exact float64 tie and
is not seen in practice).

Everything after the scores is the oracle's float32 code
(``attention.oracle.softmax_attend_rows``; MLA's decompression through
``W_UV`` by ``einsum``): the position sums (softmax denominator, P.V) are held
to numpy's order, so a kernel whose long sums drift fails instead of being
excused.

``baseline(kind, inputs, label, dtype)`` returns ``{output: array}``;
``MATMUL`` is exactly the oracle code run in float32.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from attention.oracle import (decode_attention_ref, kv_head_of, prefill_attention_ref,
                              softmax_attend_rows)

F32 = np.float32
F64 = np.float64
SCALES = ("after", "before")
NORMS = ("divide", "recip_after", "recip_first")
EXPS = ("exp", "ex2", "ex2lg2")
LN2 = F32(0.6931471805599453)
LOG2E = F32(1.4426950408889634)
MATMUL = "matmul/after"
_LANES = re.compile(r"^lanes(\d+)x(\d+)(c?)$")  # c: fp8 codes, scales outside
_BLOCKED = re.compile(r"^(blocked|tc)(\d+)$")
# SUM_pT (P rounded to T), SUM_pvT (P times each row's V scale, normalised, rounded)
# or SUM_pcT (MLA over fp8 codes, the tensor's scale on the c_kv part of S and on O)
_ROUNDED_P = re.compile(r"^(matmul|mma16)_p(v|c|)(16|f16|bf16|f32)$")


def parse(label):
    """(sum, scale, norm, exp) of an order label ``SUM/SCALE[/NORM[/EXP]]`` (NORM
    defaults to ``divide``, EXP to ``exp``); ValueError naming the label when
    malformed."""
    parts = str(label).split("/")
    how, where = parts[0], parts[1] if len(parts) > 1 else ""
    norm = parts[2] if len(parts) > 2 else "divide"
    exp = parts[3] if len(parts) > 3 else "exp"
    ok_how = (how in ("matmul", "fma", "interleaved4", "decode_fast", "decode_fast_c",
                      "mla_gemm")
              or _LANES.match(how) or _BLOCKED.match(how) or _ROUNDED_P.match(how))
    if (not ok_how or where not in SCALES or norm not in NORMS
            or exp not in EXPS + ("ex2fma",) or len(parts) > 4):
        raise ValueError(f"baseline order: expected 'SUM/SCALE[/NORM[/EXP]]' with SUM in "
                         f"matmul, fma, lanesLxV[c], interleaved4, blockedP, tcP, "
                         f"decode_fast[_c], mla_gemm, matmul_pT, mma16_pT, mma16_pvT, mma16_pcT, "
                         f"SCALE in {SCALES}, NORM in {NORMS} and EXP in {EXPS}, got {label!r}")
    if _ROUNDED_P.match(how) and (where != "after" or norm not in ("divide", "recip_after")
                                  or exp not in ("exp", "ex2fma")
                                  or (norm == "recip_after" and exp != "exp")):
        raise ValueError(f"baseline order: the rounded-P orders scale after the sum and "
                         f"take NORM divide and EXP exp or ex2fma (decode_rounded_p, "
                         f"prefill_rounded_p), or NORM recip_after and EXP exp (decode), "
                         f"got {label!r}")
    if exp == "ex2fma" and not (_ROUNDED_P.match(how) and how.startswith("mma16")):
        raise ValueError(f"baseline order: EXP ex2fma (FlashAttention-2's weights) is the "
                         f"rounded-P prefill's only (mma16_pT), got {label!r}")
    if how == "matmul" and (norm != "divide" or exp != "exp"):
        raise ValueError(f"baseline order: matmul is the oracle as written (NORM divide, "
                         f"EXP exp), got {label!r}")
    return how, where, norm, exp


def resolve(label, inputs, dtype):
    """The concrete order of ``label`` for a case: ``decode_fast`` becomes the
    fast decode's lane layout for the case's head size and cache dtype
    (``decode_fast_c``: that layout over fp8 codes, ``lanesLxVc``),
    ``mla_gemm`` the GEMM path's partials, and the rounded-P orders' ``p16``
    the case's 16-bit dtype (``pf16`` / ``pbf16``)."""
    how, where, norm, exp = parse(label)
    tail = f"{norm}/{exp}" if exp != "exp" else norm
    rounded = _ROUNDED_P.match(how)
    if rounded and rounded.group(3) == "16":  # P rounded to the case's 16-bit dtype
        return f"{rounded.group(1)}_p{rounded.group(2)}{rounded_kind(dtype)}/{where}" + (
            f"/{norm}/{exp}" if exp != "exp" else f"/{norm}" if norm != "divide" else "")
    if how == "mla_gemm":
        from attention.gemm import sgemm
        from attention.gemm import tgemm

        # the attention GEMMs (scores, P.V) take the tensor cores when the heads fill
        # more than half a block tile (``attention.gemm.tgemm.usable``), else sgemm's sums
        tensor = int(inputs["q_nope"].shape[1]) > tgemm.tile_shape()[0] // 2
        part = 8 * tgemm.PART_STEPS if tensor else sgemm.PART_K  # k8 mma steps a partial
        return f"{'tc' if tensor else 'blocked'}{part}/{where}/{tail}"
    if how not in ("decode_fast", "decode_fast_c"):
        return label
    from attention.decode.fast import LANES, dtype_kind, row_layout

    kind = dtype_kind(np.dtype(dtype), fp8=True)  # uint8: fp8 e4m3 codes
    lanes = LANES[kind]
    vec, _ = row_layout(int(inputs["q"].shape[-1]), kind, lanes)
    codes = "c" if how == "decode_fast_c" else ""
    return f"lanes{lanes}x{vec}{codes}/{where}/{tail}"


def _fma_sum(a_t, b_t, total=None):
    """Running FMA sum over the leading axis of the (broadcastable) operands,
    float32 result: ``total = fl32(total + a_i * b_i)`` for i in order."""
    for i in range(max(a_t.shape[0], b_t.shape[0])):
        prod = a_t[i % a_t.shape[0]].astype(F64) * b_t[i % b_t.shape[0]].astype(F64)
        total = prod.astype(F32) if total is None else (total.astype(F64) + prod).astype(F32)
    return total


def dot(a, b, how):
    """float32 sum over the last axis of ``a * b`` (broadcast), summed ``how``.

    a: [..., n], b: [..., n] (broadcastable), float32. Returns [...] float32.
    ``how``: ``fma``, ``lanesLxV``, ``interleaved4``, ``blockedP``, ``tcP`` or
    ``pairwise`` (numpy's ``sum`` of the rounded products; a test reference).
    """
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    shape = np.broadcast_shapes(a.shape, b.shape)
    n = shape[-1]
    if n == 0:
        return np.zeros(shape[:-1], F32)
    if how == "pairwise":
        return np.ascontiguousarray(np.broadcast_to(a, shape) * b, dtype=F32).sum(-1, dtype=F32)
    # the summed axis first, so each step's operands are contiguous
    a_t, b_t = (np.ascontiguousarray(np.moveaxis(x, -1, 0)) for x in (a, b))
    if how == "fma":
        return np.broadcast_to(_fma_sum(a_t, b_t), shape[:-1]).astype(F32)
    lanes = _LANES.match(how)
    if lanes:
        n_lanes, vec = int(lanes.group(1)), int(lanes.group(2))
        lane_of = (np.arange(n) // vec) % n_lanes
        parts = np.zeros((n_lanes,) + shape[:-1], F32)
        for j in range(n_lanes):
            idx = np.flatnonzero(lane_of == j)
            if idx.size:
                parts[j] = _fma_sum(a_t[idx % a_t.shape[0]] if a_t.shape[0] > 1 else a_t,
                                    b_t[idx % b_t.shape[0]] if b_t.shape[0] > 1 else b_t)
        off = n_lanes // 2  # butterfly: lane j adds lane j ^ off, level by level
        while off:
            parts = (parts + parts[np.arange(n_lanes) ^ off]).astype(F32)
            off //= 2
        return parts[0]
    if how == "interleaved4":
        w4 = n - n % 4
        acc = [_fma_sum(a_t[i:w4:4] if a_t.shape[0] > 1 else a_t,
                        b_t[i:w4:4] if b_t.shape[0] > 1 else b_t) if w4 else None
               for i in range(4)]
        if w4 == 0:
            acc = [np.zeros(shape[:-1], F32) for _ in range(4)]
        if n > w4:
            acc[0] = _fma_sum(a_t[w4:] if a_t.shape[0] > 1 else a_t,
                              b_t[w4:] if b_t.shape[0] > 1 else b_t, acc[0])
        return np.broadcast_to(((acc[0] + acc[1]) + (acc[2] + acc[3])).astype(F32),
                               shape[:-1]).astype(F32)
    blocked = _BLOCKED.match(how)
    if blocked and blocked.group(1) == "tc":
        return blocked_matmul(np.broadcast_to(a, shape)[..., None, :],
                              np.broadcast_to(b, shape)[..., :, None], int(blocked.group(2)),
                              tensor=True)[..., 0, 0]
    if blocked:
        part = int(blocked.group(2))
        total = None
        for k0 in range(0, n, part):
            sl = slice(k0, min(n, k0 + part))
            p = _fma_sum(a_t[sl] if a_t.shape[0] > 1 else a_t, b_t[sl] if b_t.shape[0] > 1
                         else b_t)
            total = p if total is None else (total + p).astype(F32)
        return np.broadcast_to(total, shape[:-1]).astype(F32)
    raise ValueError(f"dot: how must be fma, lanesLxV, interleaved4, blockedP, tcP or pairwise, "
                     f"got {how!r}")


def attend(scores, values, norm, exp="exp", weights_only=False, v_scale=None):
    """``attention.oracle.softmax_attend_rows`` in float32 with the kernel's
    normalisation: ``divide`` (the oracle's ``(e @ v) / sum``), ``recip_after``
    (``(e @ v) * fl(1 / sum)``: the online-softmax kernels' epilogue) or
    ``recip_first`` (``P = e * fl(1 / sum)``, then ``P @ v``: the kernels that
    write probabilities and multiply them in a GEMM). scores [R, S] float32
    (-inf: masked), values [S, Dv]; returns (out [R, Dv], lse [R]).
    ``weights_only`` (``recip_first``): returns (P [R, S], lse [R]) instead,
    for a caller that multiplies P in its own order. ``v_scale`` (NORM
    ``recip_after``; values the fp8 codes' values): ``((e @ v) * v_scale) *
    fl(1 / sum)``, the per-tensor fp8 decode's epilogue. ``exp``: ``exp`` (numpy's),
    ``ex2`` (fast-math: ``2 ** fl(x * log2 e)``, the argument rounded to
    float32 as ``ex2.approx`` takes it) or ``ex2lg2`` (that, and the LSE as
    ``fma(lg2(l), fl(ln 2), m)``)."""
    if v_scale is not None and norm != "recip_after":
        raise ValueError(f"attend: v_scale takes NORM recip_after, got {norm!r}")
    if norm == "divide" and exp == "exp":
        return softmax_attend_rows(scores, values)
    m = scores.max(axis=1, keepdims=True)  # [R, 1]
    if exp != "exp":
        with np.errstate(invalid="ignore"):
            arg = ((scores - m).astype(F32) * LOG2E).astype(F32)
        e = np.exp2(arg.astype(F64)).astype(F32)  # [R, S]
    else:
        e = np.exp(scores - m)  # [R, S]
    denom = e.sum(axis=1)  # [R]
    inv = (F32(1.0) / denom).astype(F32)
    if exp == "ex2lg2":  # m + lg2(l) * ln2, one rounding (the fused multiply-add)
        with np.errstate(divide="ignore"):
            lg2 = np.log2(denom.astype(F32)).astype(F32)
        lse = (m[:, 0].astype(F64) + lg2.astype(F64) * F64(LN2)).astype(F32)
    else:
        lse = (m[:, 0] + np.log(denom)).astype(F32)
    if norm == "divide":
        return ((e @ values) / denom[:, None]).astype(F32), lse
    if norm == "recip_after":
        acc = (e @ values).astype(F32)
        if v_scale is not None:
            acc = (acc * F32(v_scale)).astype(F32)
        return (acc * inv[:, None]).astype(F32), lse
    probs = (e * inv[:, None]).astype(F32)
    if weights_only:
        return probs, lse
    return (probs @ values).astype(F32), lse


def _fold(q, scale):
    """q with the softmax scale folded in, in float32: (q * scale) rounded, scale 1."""
    return np.asarray(q, F32) * F32(scale), 1.0


def decode_order(q, k_cache, v_cache, seq_lens, slot_table, label, k_scale=None,
                 v_scale=None):
    """``attention.oracle.decode_attention_ref`` in float32 with the scores in
    order ``label``. Shapes as the oracle's batched form: q [M, H, D], caches
    [KV_SLOTS, H_kv, max_seq, D], seq_lens [M], slot_table [M]; returns
    (out [M, H, D], lse [M, H]) float32. ``k_scale`` / ``v_scale`` (float32
    scalars; order ``lanesLxVc`` only, and required there): the caches hold
    fp8 codes' values, each score is multiplied by ``k_scale`` after its sum
    and the scale, and the P.V sum by ``v_scale`` before ``fl(1 / l)``."""
    how, where, norm, exp = parse(label)
    lanes = _LANES.match(how)
    codes = bool(lanes and lanes.group(3))
    if codes != (k_scale is not None and v_scale is not None) or (
            codes and norm != "recip_after"):
        raise ValueError(f"decode_order: order {label!r} takes k_scale and v_scale "
                         f"{'and NORM recip_after' if codes else 'not'} (lanesLxVc: the fp8 "
                         f"codes' values with the tensor's scales)")
    q = np.asarray(q, F32)
    scale = 1.0 / np.sqrt(q.shape[-1])
    if where == "before":
        q, scale = _fold(q, scale)
    if how == "matmul":
        return decode_attention_ref(q, k_cache, v_cache, seq_lens, slot_table, scale=scale,
                                    dtype=F32)
    k_cache, v_cache = np.asarray(k_cache, F32), np.asarray(v_cache, F32)
    m_count, n_heads, _ = q.shape
    n_kv = k_cache.shape[1]
    if slot_table is None:
        slot_table = np.arange(m_count)
    out = np.zeros((m_count, n_heads, v_cache.shape[-1]), F32)
    lse = np.full((m_count, n_heads), -np.inf, F32)
    heads_of = {}
    for h in range(n_heads):
        heads_of.setdefault(kv_head_of(h, n_heads, n_kv), []).append(h)
    for m in range(m_count):
        slot, length = int(slot_table[m]), int(seq_lens[m])
        if length == 0:
            continue
        for g, heads in heads_of.items():
            # scores [len(heads), L]: each head's q against the group's rows
            scores = dot(k_cache[slot, g, :length][None], q[m, heads][:, None, :], how)
            scores = (scores * F32(scale)).astype(F32)
            if codes:  # the K scale on each score, one rounding
                scores = (scores * F32(k_scale)).astype(F32)
            out[m, heads], lse[m, heads] = attend(scores, v_cache[slot, g, :length], norm, exp,
                                                  v_scale=v_scale)
    return out, lse


def prefill_order(q, k, v, n_heads, n_kv_heads, causal, label):
    """``attention.oracle.prefill_attention_ref`` in float32 with the scores in
    order ``label``. q [T, H*D], k and v [T, H_kv*D]; returns (out [T, H*D],
    lse [H, T]) float32."""
    how, where, norm, exp = parse(label)
    q = np.asarray(q, F32)
    head_dim = q.shape[1] // n_heads if n_heads else 0
    scale = 1.0 / np.sqrt(head_dim) if head_dim else 1.0
    if where == "before":
        q, scale = _fold(q, scale)
    if how == "matmul":
        return prefill_attention_ref(q, k, v, n_heads, n_kv_heads, causal=causal,
                                     scale=scale, dtype=F32)
    k, v = np.asarray(k, F32), np.asarray(v, F32)
    t_len = q.shape[0]
    out = np.zeros((t_len, n_heads * head_dim), F32)
    lse = np.full((n_heads, t_len), -np.inf, F32)
    cols = lambda i: slice(i * head_dim, (i + 1) * head_dim)  # noqa: E731
    for h in range(n_heads):
        g = kv_head_of(h, n_heads, n_kv_heads)
        if how == "fma":  # one running FMA sum over d: the compiled loop, one partial
            scores = blocked_matmul(q[:, cols(h)], k[:, cols(g)].T, max(head_dim, 1))
        else:
            scores = dot(q[:, None, cols(h)], k[None, :, cols(g)], how)  # [T, T]
        scores = (scores * F32(scale)).astype(F32)
        if causal:
            scores[np.arange(t_len)[None, :] > np.arange(t_len)[:, None]] = -np.inf
        if t_len:
            out[:, cols(h)], lse[h] = attend(scores, v[:, cols(g)], norm, exp)
    return out, lse


def mla_order(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, label):
    """``mla.oracle.mla_attend_float32`` with q_lat and the scores summed in order
    ``label``. q_nope [t_q, nh, d_nope], q_pe [t_q, nh, d_rope], c_kv [t_kv, r],
    k_pe [t_kv, d_rope], w_uk [nh, d_nope, r], w_uv [nh, d_v, r]; returns
    out [t_q, nh, d_v] float32."""
    from mla.oracle import default_scale, mla_attend_float32, visible_positions

    how, where, norm, exp = parse(label)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (np.asarray(a, F32) for a in
                                            (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    t_q, n_head, _ = q_nope.shape
    scale = default_scale(q_nope.shape[2], q_pe.shape[2])
    if how == "matmul":
        if where == "before":
            (q_nope, scale), (q_pe, _) = _fold(q_nope, scale), _fold(q_pe, scale)
        return mla_attend_float32(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=scale)
    t_kv = c_kv.shape[0]
    blocked = _BLOCKED.match(how)
    if blocked:  # the GEMM path: every product of it in two-level sums (blocked_matmul):
        # the attention GEMMs with the label's partials, absorb and decompress with
        # sgemm's (they never take the tensor cores)
        part, tensor = int(blocked.group(2)), blocked.group(1) == "tc"
        from attention.gemm.sgemm import PART_K as other
        q_lat = blocked_matmul(q_nope[:, :, None, :], w_uk[None], other)[:, :, 0]  # [t_q, nh, r]
    else:
        # q_lat[t, h, l] = sum_p w_uk[h, p, l] q_nope[t, h, p]: the sum over p last
        q_lat = dot(np.swapaxes(w_uk, 1, 2)[None], q_nope[:, :, None, :], how)  # [t_q, nh, r]
    lat = np.concatenate([q_lat, q_pe], axis=-1)  # [t_q, nh, r + d_rope]
    if where == "before":  # the kernels scale the absorbed query
        lat, scale = _fold(lat, scale)
    rows = np.concatenate([c_kv, k_pe], axis=-1)  # [t_kv, r + d_rope]
    out = np.zeros((t_q, n_head, w_uv.shape[1]), F32)
    for i in range(t_q):
        vis = visible_positions(t_q, t_kv, i)
        if vis == 0:
            continue
        if blocked:
            scores = blocked_matmul(lat[i], rows[:vis].T, part, tensor)  # [nh, vis]
        else:
            scores = dot(rows[None, :vis], lat[i][:, None, :], how)  # [nh, vis]
        scores = (scores * F32(scale)).astype(F32)
        if blocked:
            p, _ = attend(scores, None, norm, exp, weights_only=True)  # [nh, vis]
            o_lat = blocked_matmul(p, c_kv[:vis], part, tensor)  # [nh, r]
            out[i] = blocked_matmul(w_uv, o_lat[:, :, None], other)[:, :, 0]  # [nh, d_v]
            continue
        o_lat, _ = attend(scores, c_kv[:vis], norm, exp)  # [nh, r]
        out[i] = np.einsum("hjl,hl->hj", w_uv, o_lat)  # [nh, d_v]
    return out


def blocked_matmul(a, b, part, tensor=False):
    """``a @ b`` in float32 as the GEMM path sums: for each output, running FMA
    sums over ``part`` consecutive k (a fresh partial each), each partial added
    to the total in turn (``blockedP``); ``tensor``: the partials summed as the
    tensor cores do (``tcP``: split tf32 halves, three mma terms a k8 step,
    each rounded towards zero). a [..., M, K], b [..., K, N] (leading axes
    broadcast); returns [..., M, N] float32. Compiled for the CPU (numba),
    since a Python loop over k is too slow at the MLA shapes."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if min(m, k, n) == 0 or 0 in lead:
        return np.zeros(lead + (m, n), F32)
    a3 = np.ascontiguousarray(np.broadcast_to(a, lead + (m, k))).reshape(-1, m, k)
    b3 = np.ascontiguousarray(np.broadcast_to(b, lead + (k, n))).reshape(-1, k, n)
    out = (_tc_blocked() if tensor else _fma_blocked())(a3, b3, int(part))
    return out.reshape(lead + (m, n))


@functools.lru_cache(maxsize=None)
def _fma_blocked():
    """The compiled loop of ``blocked_matmul``: a [Z, M, K], b [Z, K, N] float32
    -> [Z, M, N] float32. The n loop is innermost (each output's sum still runs
    over k in order), so the compiler can vectorise across outputs. (Serial:
    the validation's worker processes already fill the cores; ``prange`` rows
    oversubscribed them and made the 128-head growth runs 6x slower on the
    H200's 16-core host.)"""
    from numba import njit

    @njit(cache=False)
    def run(a, b, part):
        nz, m, k = a.shape
        n = b.shape[2]
        out = np.zeros((nz, m, n), np.float32)
        for zi in range(nz * m):
            z, i = zi // m, zi % m
            acc = np.zeros(n, np.float32)
            total = out[z, i]
            for k0 in range(0, k, part):
                acc[:] = np.float32(0.0)
                for kk in range(k0, min(k, k0 + part)):
                    x = np.float64(a[z, i, kk])
                    row = b[z, kk]
                    for j in range(n):
                        # one fused multiply-add: the exact product, one rounding
                        acc[j] = np.float32(np.float64(acc[j]) + x * np.float64(row[j]))
                if k0 == 0:
                    total[:] = acc
                else:
                    for j in range(n):
                        total[j] = np.float32(total[j] + acc[j])
        return out

    return run


def tf32_halves(x):
    """(hi, lo) float64 arrays of float32 ``x``: ``hi = tf32(x)``, ``lo =
    tf32(x - hi)``, each rounded to 11 significant bits half away from zero
    (``attention.gemm.tgemm.split``: ``(bits + 0x1000) & 0xFFFFE000``)."""
    x = np.asarray(x, F32)

    def tf32(v):
        bits = np.ascontiguousarray(v, dtype=F32).view(np.uint32)
        return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(F32)

    hi = tf32(x)
    return hi.astype(F64), tf32((x - hi).astype(F32)).astype(F64)


@functools.lru_cache(maxsize=None)
def _tc_blocked():
    """The compiled loop of ``blocked_matmul(tensor=True)``: a [Z, M, K], b
    [Z, K, N] float32 -> [Z, M, N] float32, summed as ``tcP``."""
    from numba import njit

    @njit(cache=False)
    def round_rz(s):
        # float64 s to float32, truncated towards zero
        f = np.float32(s)
        if abs(np.float64(f)) > abs(s):
            f = np.nextafter(f, np.float32(0.0))
        return f

    @njit(cache=False)
    def run(a_hi, a_lo, b_hi, b_lo, part):
        nz, m, k = a_hi.shape
        n = b_hi.shape[2]
        out = np.zeros((nz, m, n), np.float32)
        acc = np.zeros(n, np.float32)
        s = np.zeros(n, np.float64)
        s_bits = s.view(np.uint64)
        cut = np.zeros(n, np.uint64)
        cut_f = cut.view(np.float64)
        # truncating a float64 to float32 towards zero = dropping its 29 low
        # significand bits, exact when the result is a normal float32; zeros,
        # subnormals, overflow and NaN take round_rz
        low29 = np.uint64(0xFFFFFFFFE0000000)
        normal_lo, normal_hi = 2.0 ** -126, 2.0 ** 128
        for zi in range(nz * m):
            z, i = zi // m, zi % m
            total = out[z, i]
            for k0 in range(0, k, part):
                acc[:] = np.float32(0.0)
                for k8 in range(k0, min(k, k0 + part), 8):
                    k8_end = min(k, k8 + 8)
                    for term in range(3):  # lo hi, hi lo, hi hi: small terms first
                        xa = a_lo[z, i] if term == 0 else a_hi[z, i]
                        xb = b_lo[z] if term == 1 else b_hi[z]
                        for j in range(n):
                            s[j] = np.float64(acc[j])
                        for kk in range(k8, k8_end):
                            x = xa[kk]
                            row = xb[kk]
                            for j in range(n):
                                s[j] += x * row[j]  # exact: 11 x 11 bits
                        # separate loops, so that the common case vectorises
                        for j in range(n):
                            cut[j] = s_bits[j] & low29
                        for j in range(n):
                            acc[j] = np.float32(cut_f[j])
                        for j in range(n):
                            if not (normal_lo <= abs(s[j]) < normal_hi):
                                acc[j] = round_rz(s[j])
                for j in range(n):
                    total[j] = np.float32(total[j] + acc[j])
        return out

    def call(a, b, part):
        if part % 8:
            raise ValueError(f"tcP: the partial must be whole k8 steps, got {part}")
        (a_hi, a_lo), (b_hi, b_lo) = tf32_halves(a), tf32_halves(b)
        return run(a_hi, a_lo, b_hi, b_lo, part)

    return call


ROUNDED_KINDS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def rounded_kind(dtype):
    """"f16" / "bf16" / "f32": the rounded-P orders' name of the case's dtype,
    the type P is rounded to before P.V ("f32": kept; ValueError for others)."""
    name = str(np.dtype(dtype))
    if name not in ROUNDED_KINDS:
        raise ValueError(f"rounded-P baseline: P is rounded to the case's dtype (float16, "
                         f"bfloat16, float32), got {name}")
    return ROUNDED_KINDS[name]


def _rounded_dtype(kind):
    """The numpy dtype of a rounded-P type name ("f16", "bf16", "f32")."""
    from validation.fixtures import resolve_dtype

    return resolve_dtype({v: k for k, v in ROUNDED_KINDS.items()}[kind])


def rounded_p_baseline(kind, inputs, label):
    """{"out", "lse"} ({"out"} for mla): the rounded-P baseline of a sweep
    case's inputs, in the registry's layouts (``label`` resolved:
    ``mma16_pT/after``, or ``matmul_pT/after`` for decode and mla).

    decode: q [M, H, D], caches [KV_SLOTS, H_kv, max_seq, D], seq_lens [M],
    slot_table [M] -> out [M, H, D], lse [M, H], through ``decode_rounded_p``
    (its [M, T, H, D] with T = 1, the rows of each sequence gathered by its
    slot). prefill: q [T, H*D], k / v [T, H_kv*D] -> out [T, H*D], lse [H, T],
    through ``prefill_rounded_p``. Scale 1 / sqrt(D), as the kernels' default.
    mla: the ``mla.oracle`` layouts (``registry.MLA_ARGS``) -> out [t_q, nh,
    d_v], through ``mla_rounded_p``, scale 1 / sqrt(d_nope + d_rope)."""
    how, _, norm, exp = parse(label)
    rounded = _ROUNDED_P.match(how)
    if rounded is None or rounded.group(3) == "16":
        raise ValueError(f"rounded_p_baseline: expected a resolved rounded-P order, got "
                         f"{label!r}")
    if norm != "divide" and kind != "decode":
        raise ValueError(f"rounded_p_baseline: NORM {norm} is a decode order, got {label!r} "
                         f"for a {kind} case")
    sums, dtype = rounded.group(1), _rounded_dtype(rounded.group(3))
    if rounded.group(2) == "v" and (kind != "decode"
                                    or inputs.get("fp8_scales") != "token_head"):
        raise ValueError(f"rounded_p_baseline: {label!r} (V scales into P) takes a decode "
                         f"case quantized per (token, kv head), got a {kind} case")
    if rounded.group(2) == "c" and (kind not in ("decode", "mla") or sums != "mma16"
                                    or inputs.get("fp8_scales") != "tensor"):
        raise ValueError(f"rounded_p_baseline: {label!r} (fp8 codes, the tensor's scale "
                         f"out of the sums) takes a decode or mla case quantized per "
                         f"tensor, with SUM mma16, got a {kind} case")
    if kind == "decode" and exp == "exp":
        q = np.asarray(inputs["q"], F32)  # [M, H, D]
        slots = np.asarray(inputs["slot_table"])
        k_rows = np.asarray(inputs["k_cache"], F32)[slots]  # [M, H_kv, max_seq, D]
        v_rows = np.asarray(inputs["v_cache"], F32)[slots]
        v_scales = k_scales = v_scale = None
        if rounded.group(2):  # the codes' values, K's and V's
            k_rows, v_rows = (c[slots] for c in code_values(inputs))
            if rounded.group(2) == "v":  # the rows' scales
                k_scales = np.asarray(inputs["k_scale"], F32)[slots]
                v_scales = np.asarray(inputs["v_scale"], F32)[slots]
            else:  # "c": the tensor's, on each score and on the output
                k_scales = np.full(k_rows.shape[:3],
                                   np.asarray(inputs["k_scale"], F32).reshape(-1)[0], F32)
                v_scale = np.asarray(inputs["v_scale"], F32).reshape(-1)[0]
        scale = 1.0 / np.sqrt(q.shape[-1])
        out, lse = decode_rounded_p(q[:, None], k_rows, v_rows,
                                    np.asarray(inputs["seq_lens"]), scale, dtype, sums,
                                    v_scales=v_scales, k_scales=k_scales, v_scale=v_scale,
                                    norm=norm)
        return {"out": out[:, 0], "lse": lse[:, 0]}
    if kind == "prefill" and sums == "mma16":
        q = np.asarray(inputs["q"], F32)
        n_heads = int(inputs["n_heads"])
        head_dim = q.shape[1] // n_heads if n_heads else 0
        scale = 1.0 / np.sqrt(head_dim) if head_dim else 1.0
        out, lse = prefill_rounded_p(q, np.asarray(inputs["k"], F32),
                                     np.asarray(inputs["v"], F32), n_heads,
                                     int(inputs["n_kv_heads"]), bool(inputs["causal"]), scale,
                                     dtype, exp=exp)
        return {"out": out, "lse": lse}
    if kind == "mla" and exp == "exp":
        from validation.registry import MLA_ARGS

        args = [np.asarray(inputs[n], F32) for n in MLA_ARGS]
        scale = 1.0 / np.sqrt(args[0].shape[2] + args[1].shape[2])
        code_scale = None
        if rounded.group(2) == "c":  # c_kv: the codes' values, the scale apart
            from attention.cache.fp8 import decode_e4m3

            args[MLA_ARGS.index("c_kv")] = decode_e4m3(
                np.asarray(inputs["latent_codes"])).astype(F32)
            code_scale = float(np.asarray(inputs["latent_scale"], F32).reshape(-1)[0])
        return {"out": mla_rounded_p(*args, scale, dtype, sums, code_scale=code_scale)}
    raise ValueError(f"rounded_p_baseline: {label!r} has no {kind} form (decode and mla: "
                     f"mma16_pT or matmul_pT, EXP exp; prefill: mma16_pT, EXP exp or ex2fma)")


def code_values(inputs):
    """(k, v): the fp8 codes of a quantized decode case (``k_codes`` /
    ``v_codes``, [KV_SLOTS, H_kv, max_seq, D]) as their e4m3 values in
    float32 (exact; NaN where a row is unused)."""
    from attention.cache.fp8 import decode_e4m3

    with np.errstate(invalid="ignore"):
        return tuple(decode_e4m3(np.asarray(inputs[f"{n}_codes"])).astype(F32)
                     for n in ("k", "v"))


def fp8_tensor_codes(inputs, label):
    """(q, k, v, seq_lens, slot_table) of a decode case quantized per tensor
    (``fixtures.fp8_quantize(..., "tensor")``) with the caches as the codes'
    values (float32, NaN where a row is unused): ``decode_order``'s
    positional arguments for order ``label`` (``lanesLxVc``); ValueError
    naming the label for another case."""
    if inputs.get("fp8_scales") != "tensor" or "k_codes" not in inputs:
        raise ValueError(f"baseline: {label!r} (fp8 codes, the tensor's scales outside the "
                         f"sums) takes a decode case quantized per tensor, got "
                         f"fp8_scales={inputs.get('fp8_scales')!r}")
    k, v = code_values(inputs)
    return inputs["q"], k, v, inputs["seq_lens"], inputs["slot_table"]


def baseline(kind, inputs, label, plain=None):
    """{output name: float32 array}: the case's baseline in order ``label``
    (already ``resolve``d) for a sweep case's inputs (the registry's input dict
    of ``kind`` decode | prefill | mla). ``plain``: the oracle's float32 outputs
    when already computed, returned for ``MATMUL``."""
    if kind not in ("decode", "prefill", "mla"):
        raise ValueError(f"baseline: kind must be decode, prefill or mla, got {kind!r}")
    if label == MATMUL and plain is not None:
        return dict(plain)
    if _ROUNDED_P.match(parse(label)[0]):
        return rounded_p_baseline(kind, inputs, label)
    if kind == "decode":
        lanes = _LANES.match(parse(label)[0])
        if lanes and lanes.group(3):  # fp8 codes' values, the tensor's scales outside
            o, lse = decode_order(*fp8_tensor_codes(inputs, label), label=label,
                                  k_scale=np.asarray(inputs["k_scale"], F32).reshape(-1)[0],
                                  v_scale=np.asarray(inputs["v_scale"], F32).reshape(-1)[0])
            return {"out": o, "lse": lse}
        o, lse = decode_order(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                              inputs["seq_lens"], inputs["slot_table"], label)
        return {"out": o, "lse": lse}
    if kind == "prefill":
        o, lse = prefill_order(inputs["q"], inputs["k"], inputs["v"], inputs["n_heads"],
                               inputs["n_kv_heads"], inputs["causal"], label)
        return {"out": o, "lse": lse}
    from validation.registry import MLA_ARGS

    return {"out": mla_order(*(inputs[n] for n in MLA_ARGS), label)}


# ---------------------------------------------------------------------------
# 16-bit tensor-core kernels (attention.decode.mma, attention.prefill.mma): P is
# rounded to the 16-bit type before P.V, so the same-precision baseline applies
# that rounding too (16-bit q and K: every product of S is exact in fp32)
# ---------------------------------------------------------------------------

def _truncate32(x):
    """float64 ``x`` to float32, toward zero."""
    y = x.astype(F32)
    over = np.abs(y.astype(F64)) > np.abs(x)
    y[over] = np.nextafter(y[over], F32(0))
    return y


def mma16_scores(qh, kh, rule="exact_rz", acc=None):
    """``qh @ kh.T`` ([R, D] @ [D, S] -> [R, S] float32) accumulated as
    ``mma.m16n8k16`` does it, one 16-wide k step at a time, under ``rule``:

    * "exact_rz" (the judge's, every tensor-core verdict so far): the step's
      products summed exactly and added to the fp32 accumulator, the sum
      truncated;
    * "ops_e2" (the rule fitted to every H200 output of
      ``validation.mma_accum_probe``, notes/validation.md): each product
      aligned by its operands' exponent sum and the accumulator by its own,
      every term truncated toward zero 2 bits below fp32's last place at the
      largest of those exponents, the kept terms added exactly, the sum
      truncated. Not the registry's rule yet: changing it is a criterion
      change, to be made beside a GPU run that reports each case it moves.

    ``acc`` [R, S] float32: the sum the k steps are added to (default zeros;
    ``mla_rounded_p``'s per-tensor fp8 order starts k_pe's steps from the
    scaled c_kv part)."""
    if rule not in ("exact_rz", "ops_e2"):
        raise ValueError(f"rule: expected 'exact_rz' or 'ops_e2', got {rule!r}")
    acc = (np.zeros((qh.shape[0], kh.shape[0]), F32) if acc is None
           else np.array(acc, F32, copy=True))
    for k0 in range(0, qh.shape[1], 16):
        qs, ks = qh[:, k0:k0 + 16].astype(F64), kh[:, k0:k0 + 16].astype(F64)
        if rule == "exact_rz":
            acc = _truncate32(acc.astype(F64) + qs @ ks.T)
        else:
            acc = _ops_e2_step(acc, qs, ks)
    return acc


def _exponent(x):
    """floor(log2 |x|) of float64 ``x`` elementwise, -inf for zeros."""
    _, e = np.frexp(np.where(x != 0, x, 1.0))
    return np.where(x != 0, e - 1.0, -np.inf)


def _ops_e2_step(acc, qs, ks, rows=64):
    """One k step of ``mma16_scores``' "ops_e2": acc [R, S] float32, qs [R, k],
    ks [S, k] float64 (16-bit values) -> [R, S] float32 (``rows`` rows at a
    time, to bound the [rows, S, k] products)."""
    out = np.empty_like(acc)
    e_k = _exponent(ks)  # [S, k]
    for r0 in range(0, qs.shape[0], rows):
        q, c = qs[r0:r0 + rows], acc[r0:r0 + rows].astype(F64)
        prods = q[:, None, :] * ks[None, :, :]  # [r, S, k], exact
        leads = _exponent(q)[:, None, :] + e_k[None, :, :]
        top = np.maximum(leads.max(axis=-1), _exponent(c))
        grid = np.exp2(np.where(np.isfinite(top), top, 0.0) - 25)
        kept = np.trunc(prods / grid[..., None]).sum(axis=-1) + np.trunc(c / grid)
        out[r0:r0 + rows] = _truncate32(kept * grid)
    return out


def prefill_rounded_p(q, k, v, n_heads, n_kv, causal, scale, dtype, row_block=256,
                      exp="exp"):
    """float32 prefill with the tensor-core kernel's roundings.

    q [T, H*D], k / v [T, H_kv*D] (16-bit values). Per row t of head h (kv head
    g = h * H_kv // H): s = (K_g q_t) accumulated as the mma does (``mma16_scores``)
    times scale in float32, over the keys it sees; p = exp(s - max s), l = sum p,
    out = (p rounded to ``dtype``) V_g / l, lse = max s + log l. Returns (out
    [T, H*D], lse [H, T]) float32.

    ``exp="ex2fma"``: the weights as FlashAttention-2's form takes them (the
    kernel's): with r the raw (unscaled) scores, m their max and c = fl(scale
    log2 e), p = 2^fl(fma(r, c, -fl(m c))): the argument is rounded once at the
    size of the scaled scores, not of their difference from the max, so at
    |score| 1e4 every weight but the largest carries ~1e-3 of relative error
    (the exponential itself exact). ``exp="exp"``: numpy's exp of the scaled
    differences (the tests' default)."""
    if exp not in ("exp", "ex2fma"):
        raise ValueError(f"exp: expected 'exp' or 'ex2fma', got {exp!r}")
    scale2 = F32(F32(scale) * LOG2E)
    t_len = q.shape[0]
    head_dim = q.shape[1] // n_heads
    out = np.zeros((t_len, n_heads * head_dim), F32)
    lse = np.full((n_heads, t_len), -np.inf, F32)
    for h in range(n_heads):
        g = h * n_kv // n_heads
        qh = q[:, h * head_dim:(h + 1) * head_dim].astype(F32)  # [T, D]
        kh = k[:, g * head_dim:(g + 1) * head_dim].astype(F32)  # [T, D]
        vh = v[:, g * head_dim:(g + 1) * head_dim].astype(F32)  # [T, D]
        for lo in range(0, t_len, row_block):
            rows = np.arange(lo, min(lo + row_block, t_len))  # [R]
            raw = mma16_scores(qh[rows], kh)  # [R, T]
            if causal:
                raw[np.arange(t_len)[None, :] > rows[:, None]] = -np.inf
            s = raw * F32(scale)  # [R, T]
            top = s.max(axis=1, keepdims=True)  # [R, 1]
            if exp == "ex2fma":
                ref = (raw.max(axis=1, keepdims=True) * scale2).astype(F32)  # [R, 1]
                with np.errstate(invalid="ignore"):  # -inf - -inf: a row that sees nothing
                    arg = (raw.astype(F64) * F64(scale2) - ref.astype(F64)).astype(F32)
                p = np.exp2(arg.astype(F64)).astype(F32)  # [R, T]
            else:
                p = np.exp(s - top)  # [R, T] float32
            total = p.sum(axis=1, dtype=F32)  # [R]
            p16 = p.astype(dtype).astype(F32)  # P as the mma takes it
            out[rows, h * head_dim:(h + 1) * head_dim] = (p16 @ vh) / total[:, None]
            lse[h, rows] = top[:, 0] + np.log(total)
    return out, lse


def decode_rounded_p(q, k_rows, v_rows, lens, scale, dtype, sums="matmul", v_scales=None,
                     k_scales=None, v_scale=None, norm="divide"):
    """float32 decode with the tensor-core kernel's roundings.

    q [M, T, H, D], k_rows / v_rows [M, H_kv, L, D] (16-bit values), lens [M]:
    query i of sequence m sees positions 0 .. lens[m] - T + i. Per row:
    s = (K q) * scale in float32, p = exp(s - max s), l = sum p, out = (p
    rounded to ``dtype``) V / l, lse = max s + log l. Returns (out [M, T, H, D],
    lse [M, T, H]) float32; zeros and -inf for a row that sees nothing.
    ``sums``: how K q is summed: "matmul" (numpy's float32 ``@``) or "mma16"
    (``mma16_scores``: 16-wide k steps added to the fp32 sum with truncation,
    as the kernel's mma sums them; the validation registry's order).
    ``v_scales`` [M, H_kv, L] float32 (the order ``SUM_pvT``: an fp8 cache with
    a scale a row, ``v_rows`` then the codes' values): the weights are ``w = p
    vs`` (float32), and ``u = max w`` a row: out = u ((w / u) rounded to
    ``dtype``) V / l, the tensor-core decode's weights (``attention.decode.mma``,
    token_head: V scales into P, normalised a row so that the rounded weights
    lie in [0, 1] whatever the scales' range; its running ``u`` is this one
    when a row's largest weight comes first).
    ``k_scales`` [M, H_kv, L] float32 (with ``k_rows`` the codes' values): the
    scores in the tensor-core decode's order, ``s = ((K q) * scale) * ks`` in
    float32 (the sum over the codes, then the scale, then the row's K scale:
    three roundings), instead of the sum over the dequantized rows.
    ``v_scale`` float (with ``v_rows`` the codes' values; not with ``v_scales``):
    one V scale for the tensor, applied after P.V as the per-tensor fp8 kernel
    applies it, out = ((P rounded to ``dtype``) V_codes vs) / l.
    ``norm``: "divide" (the sum over l, as above) or "recip_after" (the sum
    times fl(1 / l), the tensor-core decode's epilogue, ``softmax_finish``:
    ``out = (... V vs) * fl(1 / l)`` and per row scale ``(u (p16 V)) * fl(1 /
    l)``)."""
    if sums not in ("matmul", "mma16"):
        raise ValueError(f"sums: expected 'matmul' or 'mma16', got {sums!r}")
    if norm not in ("divide", "recip_after"):
        raise ValueError(f"norm: expected 'divide' or 'recip_after', got {norm!r}")
    recip = norm == "recip_after"
    if v_scale is not None and v_scales is not None:
        raise ValueError("v_scale (one V scale, after P.V) and v_scales (a V scale a row, "
                         "into P) exclude each other")
    m_count, t_q, n_heads, head_dim = q.shape
    group = n_heads // k_rows.shape[1]
    out = np.zeros(q.shape, F32)
    lse = np.full(q.shape[:3], -np.inf, F32)
    for m in range(m_count):
        for i in range(t_q):
            seen = 0 if lens[m] == 0 else int(lens[m]) - t_q + 1 + i
            if seen == 0:
                continue
            for h in range(n_heads):
                keys = k_rows[m, h // group, :seen].astype(F32)  # [n, D]
                vals = v_rows[m, h // group, :seen].astype(F32)  # [n, D]
                qh = q[m, i, h].astype(F32)  # [D]
                if sums == "mma16":
                    s = mma16_scores(qh[None], keys)[0] * F32(scale)  # [n]
                else:
                    s = (keys @ qh) * F32(scale)  # [n]
                if k_scales is not None:
                    s = s * k_scales[m, h // group, :seen].astype(F32)
                top = s.max()
                p = np.exp(s - top)  # [n] float32
                total = p.sum(dtype=F32)
                if v_scales is None:
                    p16 = p.astype(dtype).astype(F32)  # P as the mma takes it
                    pv = p16 @ vals
                    if v_scale is not None:
                        pv = pv * F32(v_scale)
                    out[m, i, h] = pv * (F32(1.0) / total) if recip else pv / total
                else:
                    w = p * v_scales[m, h // group, :seen].astype(F32)
                    u = w.max()
                    if u > 0:
                        p16 = (w / u).astype(dtype).astype(F32)
                        pv = u * (p16 @ vals)
                        out[m, i, h] = pv * (F32(1.0) / total) if recip else pv / total
                lse[m, i, h] = top + np.log(total)
    return out, lse


def mla_rounded_p(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, dtype, sums="mma16",
                  code_scale=None):
    """float32 MLA attention of one sequence with the tensor-core kernel's roundings
    (``mla.mma``, ``mla_decode(method="mma")``).

    q_nope [t_q, nh, d_nope], q_pe [t_q, nh, d_rope], c_kv [t_kv, r], k_pe
    [t_kv, d_rope], w_uk [nh, d_nope, r], w_uv [nh, d_v, r];
    query i attends positions 0 .. t_kv - t_q + i (the queries are the last
    t_q positions). Per query row:

    * q_lat = q_nope W_UK in float32, summed as the pipeline's absorb GEMM
      sums it (``attention.gemm.sgemm``: running FMA sums of ``PART_K``
      products, ``blocked_matmul``); the row [q_lat | q_pe] rounded to
      ``dtype`` (the kernel rounds q to the cache's type);
    * the cache rows [c_kv | k_pe] taken as float32 and rounded to ``dtype``:
      for a 16-bit cache a no-op (its values are ``dtype`` values); for an fp8
      cache (``mla.fp8``, the entry ``mla_fp8``) whose dequantized values
      ``fl32(e4m3(c) s)`` come in, the rounding the kernel applies to them
      into its 16-bit tile;
    * s = (row . [c_kv | k_pe]) * scale in float32, summed as ``sums`` says:
      "mma16" (``mma16_scores``: 16-wide k steps added to the fp32 sum with
      truncation, the registry's) or "matmul" (numpy's float32 ``@``);
    * p = exp(s - max s), l = sum p (unrounded), o_lat = (p rounded to
      ``dtype``) c_kv / l;
    * out = o_lat W_UV^T in float32, summed as the decompress GEMM (sgemm,
      ``blocked_matmul``) sums it.

    ``code_scale`` (the order ``mma16_pcT``: an fp8 cache with one scale per
    tensor, ``c_kv`` then the codes' values, exact in ``dtype``): the c_kv
    part of s summed over the codes (``mma16_scores``), times ``code_scale``
    in float32, then k_pe's k steps added to that sum, then ``* scale``; and
    o_lat = ((p16 @ codes) * code_scale) / l: ``mla.mma``'s per-tensor fp8
    order. "mma16" sums only.

    The absorb and the decompress are summed in sgemm's order for either
    ``sums``: with numpy's einsum there instead, the tensor-core entry's out
    mean error was 1.6x the baseline's at the 'large' fixture (one-hot
    weights: o_lat exact, only the decompress's sum order left;
    notes/validation.md).

    Returns out [t_q, nh, d_v] float32 (zeros for a query that sees nothing)."""
    if sums not in ("matmul", "mma16"):
        raise ValueError(f"sums: expected 'matmul' or 'mma16', got {sums!r}")
    if code_scale is not None and sums != "mma16":
        raise ValueError(f"code_scale: the per-tensor fp8 order sums as the mma does "
                         f"(sums 'mma16'), got {sums!r}")
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (np.asarray(a, F32) for a in
                                            (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    from attention.gemm.sgemm import PART_K

    t_q, n_heads, _ = q_nope.shape
    t_kv = c_kv.shape[0]
    q_lat = blocked_matmul(q_nope[:, :, None, :], w_uk[None], PART_K)[:, :, 0]  # [t_q, nh, r]
    rows_q = np.concatenate([q_lat, q_pe], axis=-1).astype(dtype).astype(F32)  # [t_q, nh, W]
    with np.errstate(over="ignore"):
        keys = np.concatenate([c_kv, k_pe], axis=-1).astype(dtype).astype(F32)  # [t_kv, W]
    rank = c_kv.shape[1]
    c_kv = keys[:, :rank]
    out = np.zeros((t_q, n_heads, w_uv.shape[1]), F32)
    for i in range(t_q):
        seen = t_kv - t_q + 1 + i
        if seen <= 0:
            continue
        if code_scale is not None:  # the c_kv part times the scale, then k_pe's steps
            part = mma16_scores(rows_q[i][:, :rank], c_kv[:seen]) * F32(code_scale)
            s = mma16_scores(rows_q[i][:, rank:], keys[:seen, rank:], acc=part) * F32(scale)
        elif sums == "mma16":
            s = mma16_scores(rows_q[i], keys[:seen]) * F32(scale)  # [nh, seen]
        else:
            s = (rows_q[i] @ keys[:seen].T) * F32(scale)  # [nh, seen]
        top = s.max(axis=1, keepdims=True)  # [nh, 1]
        p = np.exp(s - top)  # [nh, seen] float32
        total = p.sum(axis=1, dtype=F32)  # [nh]
        p16 = p.astype(dtype).astype(F32)  # P as the mma takes it
        if code_scale is not None:
            o_lat = (((p16 @ c_kv[:seen]) * F32(code_scale)) / total[:, None]).astype(F32)
        else:
            o_lat = ((p16 @ c_kv[:seen]) / total[:, None]).astype(F32)  # [nh, r]
        out[i] = blocked_matmul(w_uv, o_lat[:, :, None], PART_K)[:, :, 0]  # [nh, d_v]
    return out
