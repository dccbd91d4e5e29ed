"""MLA attention as GEMMs: the fast path of ``mla.pipeline`` (``method="gemm"``).

For queries ``q < Q`` over latent rows ``[c_kv | k_pe]`` (width ``W = r +
d_rope``) of cache slot ``slot[q]``, attending the first ``vis[q] = len[q] -
tail[q]`` rows (decode: ``tail = 0``), the whole attention is five launches,
four of them ``attention.gemm.sgemm`` (register-tiled, two-level fp32 sums):

1. absorb   ``qc[q, h, :r] = q_nope[q, h, :] @ W_UK[h]``   (batch over heads)
   pack     ``qc[q, h, r:] = q_pe[q, h, :]``
2. scores   ``S[q, h, t] = scale * qc[q, h, :] . row_t``    (M = heads, N = vis[q], K = W)
3. softmax  ``S[q, h, t] <- exp(S - max) / sum``, ``lse[q, h]`` (a block a row,
            held in registers; one warp a row past 8192 positions)
4. P.V      ``o_lat[q, h, :] = S[q, h, :vis] @ c_kv rows``  (M = heads, N = r, K = vis[q])
5. decompress ``out[q, h, :] = W_UV[h] o_lat[q, h, :]``     (batch over heads)

Workspace: ``qc [Q, nh, W]`` and ``S [Q, nh, max vis]`` float32 (rows of ``S``
padded to a multiple of 4 words)
(``workspace_bytes``); at B 64, 128 heads, L 4096 that is 134 MB, written and
read a few times, against about 73 GFLOP of GEMM work: the path is compute
bound, and the round trip of ``S`` through memory costs ~0.1 ms.

The heads of one query are the M side of both attention GEMMs, so every latent
row staged in shared memory serves all 128 heads (the tiled online-softmax
kernel of ``mla.kernels`` re-reads it per group of 4 heads and spends two
shared loads per FMA).

Paged latent caches (``prepare``'s ``page_table``; ``mla.paged``): the score
and P.V GEMMs on tensor cores look rows up through the page table as they
stage them (``tgemm_kernel(..., page_size=P)``); where ``sgemm`` runs them
(``tensor=False``, or ``tgemm`` not usable), which has no paged addressing, a
first launch gathers each query's visible rows into a contiguous scratch
(``Workspace.rows``; ``workspace_bytes``' ``row_bytes``). Same GEMMs, same
sums: the bits of a contiguous cache holding the same rows.

Multi-token decode (``prepare``'s ``s_q``; ``mla.pipeline.mla_decode`` with q
``[B, s_q, nh, .]``): the ``B * s_q`` queries are absorbed and decompressed as
above, and the score and P.V GEMMs batch over the B sequences with the ``s_q *
nh`` (query, head) rows of a sequence as their M side: the sequence's latent
rows are staged once for all its queries, and 128 heads at s_q 2 fill the
tensor-core tiles twice over. The score GEMM runs to the sequence's length for
every row; the softmax (compiled for ``s_q``) gives query i its causal end
``len - (s_q - 1 - i)`` and writes zeros past it, so the P.V GEMM over the
sequence's length adds exact zeros for those positions: each query's output
and LSE are those of a one-query decode over its prefix, bit for bit, where
both run the same GEMM kernel (``tgemm.usable`` counts the GEMM's rows:
``s_q * nh`` here, ``nh`` for one query). ``s_q = 1`` builds and launches
exactly the kernels above.

Planted defects (falsification suite only): ``w_uk_transposed`` (W_UK's
``[d_nope, r]`` plane read as ``[r, d_nope]``), ``causal_offset_off_by_one``
(one row past the causal bound), ``k_pe_ignored`` (the score GEMM stops at
``r``). ``stuck_rescale`` has no counterpart: this path keeps no running
softmax state. With s_q > 1: ``mla_causal_off_by_one`` (``kernels.MULTI_DEFECTS``;
the softmax gives query i one position past its end).

Planted kernel switches (``defect=``, compile-time, none in a production
build): the gross ``GROSS_DEFECTS`` (``tgemm.GROSS_DEFECTS``,
``sgemm.GROSS_DEFECTS``, ``SOFTMAX_DEFECTS``: ``softmax_not_normalised``, P
written without the division by the row sum) and the ``PRECISION_MUTANTS``:

    tf32_single, no_partials, ring_stale   the attention GEMMs' kernel
                                           (``attention.gemm.tgemm`` / ``sgemm``)
    p_fp16, p_bf16    each probability written to S rounded to fp16 / bf16
    exp_approx        the softmax's ``exp`` is ``attention.core.rounding.chop_exp``
    scale_fp16        each scaled score rounded to fp16 as the softmax reads it
    q_bf16            qc (absorbed query and packed q_pe) rounded to bf16
                      before the score GEMM

Routing (``mutant_applies``): a GEMM kernel's switch goes to the kernel that
``method`` runs. "gemm": ``tgemm``'s (``tf32_single``, ``no_partials``,
``ring_stale``, ``k_slice_dropped``) to the score and P.V GEMMs where
``tgemm.usable`` takes them (more heads than half a tile, 16-byte rows;
elsewhere they change nothing). "gemm_fma": ``sgemm``'s (``no_partials``,
``k_tail_dropped``) to every ``sgemm`` launch (absorb, scores, P.V,
decompress). So ``no_partials`` is tgemm's under "gemm" and sgemm's under
"gemm_fma". The softmax switches and ``q_bf16`` apply under both.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from attention.gemm import sgemm, skinny

from attention.gemm import tgemm
from attention.core import checks
from attention.core.device import SIMULATOR, device_empty, jit, launch_stream, to_device
from attention.core.rounding import chop_exp, round_bf16, round_fp16
from attention.core.warp import block_max, block_sum, warp_max, warp_sum

from . import paged as PG
from .kernels import MULTI_DEFECTS

GEMM_DEFECTS = ("w_uk_transposed", "causal_offset_off_by_one", "k_pe_ignored")
SOFTMAX_MUTANTS = ("p_fp16", "p_bf16", "exp_approx", "scale_fp16")
SOFTMAX_DEFECTS = ("softmax_not_normalised",)
SOFTMAX_SWITCHES = SOFTMAX_MUTANTS + SOFTMAX_DEFECTS
PRECISION_MUTANTS = tuple(dict.fromkeys(
    tgemm.PRECISION_MUTANTS + sgemm.PRECISION_MUTANTS + SOFTMAX_MUTANTS + ("q_bf16",)))
GROSS_DEFECTS = tgemm.GROSS_DEFECTS + sgemm.GROSS_DEFECTS + SOFTMAX_DEFECTS
# the names only this path's kernels carry (``prepare``'s ``defect`` besides GEMM_DEFECTS)
KERNEL_SWITCHES = GROSS_DEFECTS + PRECISION_MUTANTS
METHODS = ("gemm", "gemm_fma")
ROWS_PER_BLOCK = 4  # softmax: one warp per (query, head) row
WARP = 32


# qc's extent in the workspace is rounded up to this many words, so S starts
# 128-byte aligned whatever the number of queries (tgemm takes S as its ``a``
# only when it is 16-byte aligned: without the pad a chunk of the batch could
# take another kernel than the whole batch, and other bits)
QC_PAD_WORDS = 32


def s_columns(max_visible):
    """Words in a row of ``S``: ``max_visible`` (at least 1) rounded up to 4."""
    return -(-max(int(max_visible), 1) // 4) * 4


def workspace_bytes(n_q, n_head, width, max_visible, row_bytes=0):
    """Device scratch of the GEMM path for ``n_q`` queries: qc [Q, nh, W]
    (its extent padded to ``QC_PAD_WORDS``) and S [Q, nh, ``s_columns``]
    float32; with ``row_bytes`` (a paged cache read through the row gather,
    ``paged_gathers``: bytes of one latent row) also the gathered rows [Q,
    max_visible, W]. Multi-token decode (``prepare``'s ``s_q``): pass the
    sequences as ``n_q`` and ``s_q * nh`` as ``n_head`` (rows are gathered
    once a sequence)."""
    n_qc = -(-int(n_q) * n_head * width // QC_PAD_WORDS) * QC_PAD_WORDS
    rows = int(n_q) * max(int(max_visible), 1) * int(row_bytes)
    return 4 * (n_qc + int(n_q) * n_head * s_columns(max_visible)) + rows


def paged_gathers(tensor, n_head, latent):
    """Whether the GEMM path over the paged cache ``latent`` [num_pages, P, W]
    gathers the visible rows first (``prepare``): the score and P.V GEMMs run
    on ``sgemm`` (``tensor`` False, or ``tgemm`` would not take them: no more
    heads than half its tile, rows of W words not in whole 16-byte copies, or
    ``latent`` not 16-byte aligned; ``tgemm.usable``'s conditions as they fall
    on the MLA operands). Sizes the plan (``workspace_bytes``' ``row_bytes``);
    ``prepare`` decides on the operands themselves."""
    if not tensor:
        return True
    width = int(latent.shape[2])
    per_copy = 8 if np.dtype(latent.dtype) == np.float16 else 4
    address = checks.device_address(latent)  # None: a host array, copied to aligned memory
    aligned = SIMULATOR or address is None or address % 16 == 0
    return not (n_head > tgemm.tile_shape()[0] // 2 and width % 4 == 0
                and width % per_copy == 0 and aligned)


class Workspace:
    """Reusable scratch of the GEMM path (``qc`` and ``S``), grown on demand.

    Pass one to ``mla.pipeline.mla_decode(..., workspace=ws)`` in a decode
    loop to keep device allocations out of every step; the chunks of one
    chunked call (``enqueue``'s ``chunk``) run over it one after another on
    one stream. Not for concurrent use: two launches in flight on different
    streams must not share one. ``nbytes``: the size held (0 before first use),
    the gathered rows of a paged cache (``rows``) included.
    """

    def __init__(self):
        self._buf = None
        self._rows = None  # gathered latent rows of a paged cache (``rows``)
        self._k = None  # the weight GEMMs' K-split partials (``k_scratch``)

    @property
    def nbytes(self):
        total = 0 if self._buf is None else 4 * int(self._buf.shape[0])
        if self._rows is not None:
            total += int(self._rows.shape[0]) * np.dtype(self._rows.dtype).itemsize
        if self._k is not None:
            total += 4 * int(self._k.shape[0])
        return total

    def k_scratch(self, n, stream=None):
        """A float32 device array of at least ``n`` elements: the K-split partials
        of the absorb and decompress GEMMs (``weight_gemm_scratch``; they run one
        after the other on one stream, so they share it)."""
        if self._k is None or int(self._k.shape[0]) < n:
            self._k = device_empty(max(int(n), 1), np.float32, stream)
        return self._k

    def rows(self, shape, dtype, stream=None):
        """A device array of ``shape`` and ``dtype`` (the latent rows [Q, L,
        W] gathered from a paged cache), over a buffer of its own."""
        n = max(int(np.prod(shape)), 1)
        if (self._rows is None or np.dtype(self._rows.dtype) != np.dtype(dtype)
                or int(self._rows.shape[0]) < n):
            self._rows = device_empty(n, dtype, stream)
        return self._rows[:int(np.prod(shape))].reshape(tuple(shape))

    def views(self, qc_shape, s_shape, stream=None):
        """(qc, S) float32 device arrays of these shapes over one buffer; S
        starts ``QC_PAD_WORDS`` aligned past the buffer's start."""
        n_qc, n_s = int(np.prod(qc_shape)), int(np.prod(s_shape))
        s0 = -(-n_qc // QC_PAD_WORDS) * QC_PAD_WORDS
        if self._buf is None or int(self._buf.shape[0]) < s0 + n_s:
            self._buf = device_empty(s0 + n_s, np.float32, stream)
        return (self._buf[:n_qc].reshape(tuple(qc_shape)),
                self._buf[s0:s0 + n_s].reshape(tuple(s_shape)))


def _pack_q_pe(q_pe, qc, rank):
    """qc[q, h, rank + d] = q_pe[q, h, d].

    q_pe: [Q, nh, d_rope] float32;  qc: [Q, nh, rank + d_rope] float32.
    Grid-stride over Q * nh * d_rope elements.
    """
    n_q, n_head, d_rope = q_pe.shape
    total = n_q * n_head * d_rope
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        d = i % d_rope
        h = (i // d_rope) % n_head
        q = i // (d_rope * n_head)
        qc[q, h, rank + d] = q_pe[q, h, d]


pack_q_pe_kernel = jit(_pack_q_pe)


def _round_bf16_rows(x):
    """x[q, h, j] <- bf16(x[q, h, j]) (the ``q_bf16`` mutant's step).

    x: [Q, nh, W] float32. Grid-stride over Q * nh * W elements.
    """
    n_q, n_head, width = x.shape
    total = n_q * n_head * width
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
        j = i % width
        h = (i // width) % n_head
        q = i // (width * n_head)
        x[q, h, j] = round_bf16(x[q, h, j])


round_bf16_kernel = jit(_round_bf16_rows)


def _check_switch(defect, allowed):
    if defect is not None and defect not in allowed:
        raise ValueError(f"defect: expected one of {allowed} or None, got {defect!r}")


def _softmax_switch(defect, s_q):
    """Check a softmax kernel's switch: ``SOFTMAX_SWITCHES``, and with ``s_q``
    > 1 also ``MULTI_DEFECTS``; returns (S_Q, MULTI, LEAK_Q) for the factory."""
    _check_switch(defect, SOFTMAX_SWITCHES + (MULTI_DEFECTS if int(s_q) > 1 else ()))
    if int(s_q) < 1:
        raise ValueError(f"s_q: expected queries a sequence >= 1, got {s_q}")
    return int(s_q), int(s_q) > 1, 1 if defect in MULTI_DEFECTS else 0


@functools.lru_cache(maxsize=None)
def softmax_rows_kernel(defect=None, s_q=1):
    """In-place softmax of each score row over its visible positions.

    s:   [Q, nh, Lw] float32: scaled scores in, probabilities out (entries
         ``t >= vis[q]`` are neither read nor written)
    vis: [Q] int32   visible positions of query q (0: nothing, lse -inf)
    lse: [Q, nh] float32 (out)  natural-log sum of exp of the scaled scores
    Grid ``(ceil(nh / 4), Q)``, block 128: warp w of block (x, q) owns head
    ``4 x + w``. The sum of exponentials is Kahan-compensated per lane (up to
    L / 32 positive terms) before the warp's butterfly. ``defect``: one of
    ``SOFTMAX_SWITCHES`` compiled in (module docstring), or None.

    ``s_q`` > 1 (compile-time; 1 builds the kernel above unchanged):
    multi-token decode. ``s`` [B * s_q, nh, Lw] holds s_q queries a
    sequence and ``vis`` [B] is per sequence: query ``i = q % s_q`` of
    sequence ``q // s_q`` takes positions ``< vis - (s_q - 1 - i)`` and
    writes zeros at its positions up to ``vis`` (the P.V GEMM's K runs to
    the sequence's ``vis`` for all its rows). ``defect``
    "mla_causal_off_by_one" (``MULTI_DEFECTS``): one position more.
    """
    S_Q, MULTI, LEAK_Q = _softmax_switch(defect, s_q)
    P_FP16, P_BF16 = defect == "p_fp16", defect == "p_bf16"
    EXP_APPROX, SCALE_FP16 = defect == "exp_approx", defect == "scale_fp16"
    NOT_NORMALISED = defect == "softmax_not_normalised"

    def kernel(s, vis, lse):
        q = cuda.blockIdx.y
        head = cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        if head >= s.shape[1]:
            return  # a whole warp: the collectives below are per warp
        if MULTI:
            end = vis[q // S_Q]
            n = min(end, max(end - (S_Q - 1 - q % S_Q) + LEAK_Q, 0))
            for t in range(n + lane, end, WARP):
                s[q, head, t] = float32(0.0)  # past this query's end: no weight
        else:
            n = vis[q]
        m = float32(-math.inf)
        for t in range(lane, n, WARP):
            v = s[q, head, t]
            if SCALE_FP16:
                v = round_fp16(v)
            m = max(m, v)
        m = warp_max(m)
        total = float32(0.0)
        comp = float32(0.0)
        for t in range(lane, n, WARP):
            v = s[q, head, t]
            if SCALE_FP16:
                v = round_fp16(v)
            if EXP_APPROX:
                e = chop_exp(v - m)
            else:
                e = math.exp(v - m)
            y = e - comp
            nxt = total + y
            comp = (nxt - total) - y
            total = nxt
        total = warp_sum(total)
        inv = float32(1.0) / total if n > 0 else float32(0.0)
        if NOT_NORMALISED:
            inv = float32(1.0)
        for t in range(lane, n, WARP):
            v = s[q, head, t]
            if SCALE_FP16:
                v = round_fp16(v)
            if EXP_APPROX:
                e = chop_exp(v - m)
            else:
                e = math.exp(v - m)
            prob = e * inv
            if P_FP16:
                prob = round_fp16(prob)
            if P_BF16:
                prob = round_bf16(prob)
            s[q, head, t] = prob
        if lane == 0:
            lse[q, head] = m + math.log(total) if n > 0 else float32(-math.inf)

    kernel.__name__ = kernel.__qualname__ = "mla_softmax_rows" + (
        f"_sq{S_Q}" if MULTI else "") + (f"_{defect}" if defect else "")
    # no fastmath: it would fold the Kahan compensation away and assume no -inf
    return jit(kernel, fastmath=False)


# a row of up to RESIDENT_VALS * RESIDENT_THREADS scores is held in registers by
# one block (read once, written once); longer rows take the warp-a-row kernel
GPU_RESIDENT_THREADS = 256
RESIDENT_THREADS = 64 if SIMULATOR else GPU_RESIDENT_THREADS
RESIDENT_VALS = (1, 2, 4, 8, 16, 32)  # scores a thread, compiled per row width


def resident_vals(width, threads=RESIDENT_THREADS):
    """Scores a thread of a ``threads`` block holds for rows of ``width``
    (None: too long to hold)."""
    for vals in RESIDENT_VALS:
        if vals * threads >= width:
            return vals
    return None


@functools.lru_cache(maxsize=None)
def softmax_resident_kernel(vals, defect=None, threads=RESIDENT_THREADS, s_q=1):
    """In-place softmax of each score row, the row held in registers.

    Same arguments and results as ``softmax_rows_kernel`` (s [Q, nh, Lw],
    vis [Q], lse [Q, nh]) for ``Lw <= vals * threads``. Grid ``(nh, Q)``,
    block ``threads`` (default ``RESIDENT_THREADS``; a multiple of 32): thread
    ``j`` of block ``(h, q)`` holds positions ``j + threads i`` (``i < vals``,
    coalesced). The row is read once and written once (the warp-a-row kernel
    reads it three times). The row's max and sum are
    ``attention.core.warp.block_max`` / ``block_sum`` (warp butterflies, then the
    warps' values in warp order). Each thread's sum of its ``vals``
    exponentials is Kahan-compensated. ``defect``: one of ``SOFTMAX_SWITCHES``
    compiled in (module docstring), or None. ``s_q`` > 1: multi-token decode,
    as ``softmax_rows_kernel``'s (``s`` [B * s_q, nh, Lw], ``vis`` [B]; zeros
    written past each query's end up to its sequence's ``vis``).
    """
    S_Q, MULTI, LEAK_Q = _softmax_switch(defect, s_q)
    if threads % WARP:
        raise ValueError(f"threads: expected a multiple of {WARP}, got {threads}")
    P_FP16, P_BF16 = defect == "p_fp16", defect == "p_bf16"
    EXP_APPROX, SCALE_FP16 = defect == "exp_approx", defect == "scale_fp16"
    NOT_NORMALISED = defect == "softmax_not_normalised"
    VALS, THREADS = vals, threads
    NW = THREADS // WARP

    def kernel(s, vis, lse):
        head = cuda.blockIdx.x
        q = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        if MULTI:
            end = vis[q // S_Q]
            n = min(end, max(end - (S_Q - 1 - q % S_Q) + LEAK_Q, 0))
            for t in range(n + tid, end, THREADS):
                s[q, head, t] = float32(0.0)  # past this query's end: no weight
        else:
            n = vis[q]
        x = cuda.local.array(VALS, float32)
        red = cuda.shared.array(NW, float32)
        m = float32(-math.inf)
        for i in range(VALS):
            t = tid + i * THREADS
            x[i] = float32(-math.inf)
            if t < n:
                x[i] = s[q, head, t]
                if SCALE_FP16:
                    x[i] = round_fp16(x[i])
            m = max(m, x[i])
        m = block_max(m, red)
        total = float32(0.0)
        comp = float32(0.0)
        for i in range(VALS):
            if tid + i * THREADS < n:  # (an empty row has m = -inf: no exp of NaN)
                if EXP_APPROX:
                    p = chop_exp(x[i] - m)
                else:
                    p = math.exp(x[i] - m)
                x[i] = p
                y = p - comp
                nxt = total + y
                comp = (nxt - total) - y
                total = nxt
        total = block_sum(total, red)
        inv = float32(1.0) / total if n > 0 else float32(0.0)
        if NOT_NORMALISED:
            inv = float32(1.0)
        for i in range(VALS):
            t = tid + i * THREADS
            if t < n:
                prob = x[i] * inv
                if P_FP16:
                    prob = round_fp16(prob)
                if P_BF16:
                    prob = round_bf16(prob)
                s[q, head, t] = prob
        if tid == 0:
            lse[q, head] = m + math.log(total) if n > 0 else float32(-math.inf)

    kernel.__name__ = kernel.__qualname__ = (
        f"mla_softmax_resident_{VALS}" + (f"_t{THREADS}" if THREADS != RESIDENT_THREADS else "")
        + (f"_sq{S_Q}" if MULTI else "") + (f"_{defect}" if defect else ""))
    # no fastmath: it would fold the Kahan compensation away and assume no -inf
    return jit(kernel, fastmath=False)


def mutant_applies(defect, method):
    """True when ``method`` ("gemm" or "gemm_fma") runs a kernel that carries
    ``defect`` (a name of ``KERNEL_SWITCHES`` or ``GEMM_DEFECTS``).

    ``tgemm``'s switches (``tf32_single``, ``ring_stale``, ``k_slice_dropped``,
    and ``no_partials``) apply to "gemm"; ``sgemm``'s (``no_partials``,
    ``k_tail_dropped``) to "gemm_fma"; the softmax switches, ``q_bf16`` and
    ``GEMM_DEFECTS`` to both. Under "gemm" a tgemm switch changes something
    only where ``tgemm.usable`` takes the score or P.V GEMM (more heads than
    half a tile, ``tgemm.tile_shape()[0] // 2``).
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    _check_switch(defect, KERNEL_SWITCHES + GEMM_DEFECTS)
    if defect in tgemm.DEFECTS and method == "gemm":
        return True
    if defect in sgemm.DEFECTS and method == "gemm_fma":
        return True
    return defect in SOFTMAX_SWITCHES + ("q_bf16",) + GEMM_DEFECTS


def _kernel_switches(defect, tensor):
    """{kernel: its switch or None} for ``tgemm``, ``sgemm``, ``softmax`` and
    ``q_bf16`` (a bool), routed as ``mutant_applies`` (``tensor``: "gemm")."""
    if defect in MULTI_DEFECTS:  # multi-token decode's: the softmax's per-row end
        return {"tgemm": None, "sgemm": None, "softmax": defect, "q_bf16": False}
    method = "gemm" if tensor else "gemm_fma"
    known = defect is not None and defect in KERNEL_SWITCHES
    on = known and mutant_applies(defect, method)
    return {"tgemm": defect if on and tensor and defect in tgemm.DEFECTS else None,
            "sgemm": defect if on and not tensor and defect in sgemm.DEFECTS else None,
            "softmax": defect if on and defect in SOFTMAX_SWITCHES else None,
            "q_bf16": on and defect == "q_bf16"}


def visible_rows(lens, tails, defect=None):
    """vis[q] = len - tail (one more with the off-by-one defect, never past len)."""
    leak = 1 if defect == "causal_offset_off_by_one" else 0
    lens = np.asarray(lens, np.int64)
    return np.minimum(lens, lens - np.asarray(tails, np.int64) + leak).astype(np.int32)


def prepare(d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale, *, d_rope,
            w_uk_layout, stream, defect=None, workspace=None, d_vis=None, tensor=True,
            max_vis=None, out=None, o_lat=None, lse=None, page_table=None, page_defect=None,
            s_q=1):
    """Allocate and fill everything the five launches read (validated by the caller).

    d_q_nope [Q, nh, d_nope], d_q_pe [Q, nh, d_rope] (anything if d_rope = 0),
    d_w_uk [nh, d_nope, r] ("mla") or [nh, r, d_nope] ("checkpoint"),
    d_w_uv [nh, d_v, r], d_latent [S, max_seq, r + d_rope] float32/float16,
    slots / vis: host int32 [Q]; workspace: a ``Workspace`` (default: fresh
    scratch). ``d_vis`` (device int32 [Q], optional): read by the kernels in
    place of ``vis``, which then only sizes the launches (its entries must be
    upper bounds of ``d_vis``'s). ``tensor``: the score and P.V GEMMs on tensor
    cores (``attention.gemm.tgemm``, split tf32) where ``tgemm.usable``; False:
    ``attention.gemm.sgemm`` (fp32 FMAs) throughout. ``defect``: one of
    ``GEMM_DEFECTS`` or ``KERNEL_SWITCHES`` (routed to its kernel as
    ``mutant_applies``), or None. ``max_vis`` (default ``vis.max()``; not
    less): the visible rows the launches are sized for (S's row width, the
    score GEMM's grid), so a chunk of a batch can run exactly the launches of
    the whole batch (``enqueue``'s ``chunk``). ``out`` [Q, nh, d_v], ``o_lat``
    [Q, nh, r], ``lse`` [Q, nh] (device float32, C-contiguous, e.g. row views
    of a whole batch's arrays): written in place (default: allocated here).
    Returns a dict for ``launch_prepared``; its ``out``, ``o_lat`` and ``lse``
    are written by each launch of it.

    Paged cache (``page_table``: device int32 [Q, max_pages], C-contiguous;
    ``mla.paged``): ``d_latent`` is ``[num_pages, P, W]`` and query q's row t
    is row ``t % P`` of page ``page_table[q, t // P]`` (``slots`` is then not
    read). When ``tensor`` and ``tgemm`` takes both attention GEMMs, they look
    the rows up as they stage them (``tgemm_kernel(..., page_size=P)``);
    otherwise the first launch gathers every query's visible rows into a
    contiguous ``[Q, max_vis, W]`` scratch (``Workspace.rows``,
    ``paged.gather_rows_kernel``) that the GEMMs read as a cache with slots
    ``0..Q-1``. Either way the GEMMs, their tiling and their sums are those
    of a contiguous cache holding the same rows: the same bits.
    ``page_defect``: ``paged.READ_DEFECTS`` or None.

    Multi-token decode (``s_q`` > 1): the ``Q = B * s_q`` queries are s_q
    consecutive queries of each of B sequences (d_q_nope [B * s_q, nh,
    d_nope], out [B * s_q, nh, d_v], ...), and ``slots``, ``vis``, ``d_vis``
    and ``page_table`` are per sequence ([B]; ``vis``: the sequence's length,
    which its last query attends). The absorb and decompress GEMMs run over
    the Q queries; the score and P.V GEMMs over the B sequences, the ``s_q *
    nh`` (query, head) rows of a sequence being the M side of one GEMM over
    its ``vis`` latent rows (read once a sequence, not once a query); the
    softmax (``s_q``) gives query i its own end ``vis - (s_q - 1 - i)`` and
    zeros past it. ``defect`` may then also be "mla_causal_off_by_one"
    (``MULTI_DEFECTS``, in the softmax).
    """
    s_q = int(s_q)
    _check_switch(defect, GEMM_DEFECTS + KERNEL_SWITCHES + (MULTI_DEFECTS if s_q > 1 else ()))
    _check_switch(page_defect, PG.READ_DEFECTS)
    n_q, nh, d_nope = (int(x) for x in d_q_nope.shape)
    if s_q < 1 or n_q % s_q:
        raise ValueError(f"s_q: expected a divisor of the {n_q} queries, got {s_q}")
    n_seq = n_q // s_q
    width = int(d_latent.shape[2])
    rank = width - d_rope
    d_v = int(d_w_uv.shape[1])
    p = {"n_q": n_q, "n_seq": n_seq, "s_q": s_q, "nh": nh, "rank": rank, "d_rope": d_rope,
         "d_v": d_v, "scale": scale,
         "out": out if out is not None else device_empty((n_q, nh, d_v), np.float32, stream),
         "o_lat": (o_lat if o_lat is not None
                   else device_empty((n_q, nh, rank), np.float32, stream)),
         "lse": lse if lse is not None else device_empty((n_q, nh), np.float32, stream)}
    if n_q == 0:
        return p
    # -- every index table of the five launches, in one host-to-device copy --
    vis_max = int(vis.max()) if vis.size else 0
    if max_vis is None:
        max_vis = vis_max
    elif int(max_vis) < vis_max:
        raise ValueError(f"max_vis: expected at least vis.max()={vis_max}, got {max_vis}")
    max_vis = int(max_vis)
    k_score = rank if defect == "k_pe_ignored" else width
    if page_table is not None:  # gathered rows are read as slots 0..B-1
        slots = np.arange(n_seq)
    # per sequence (the attention GEMMs' batch; a query each when s_q = 1)
    per_head = (np.arange(nh), np.full(nh, rank), np.full(nh, d_nope), np.full(nh, d_v))
    per_seq = (np.asarray(slots), np.asarray(vis), np.full(n_seq, k_score),
               np.full(n_seq, rank))
    table = to_device(np.concatenate(per_head + per_seq).astype(np.int32), stream)
    p["heads"], p["h_rank"], p["h_nope"], p["h_dv"] = (table[i * nh:(i + 1) * nh]
                                                       for i in range(4))
    q0 = 4 * nh
    p["slots"], p["vis"], p["q_score"], p["q_rank"] = (
        table[q0 + i * n_seq:q0 + (i + 1) * n_seq] for i in range(4))
    if d_vis is not None:
        p["vis"] = d_vis
    p["table"] = table  # keeps the slices' memory alive with the dict
    p["max_vis"] = max_vis
    p["smem_ready"] = set()  # GEMM kernels given their dynamic shared memory
    p["tensor"] = bool(tensor)
    p["defect"] = defect
    p["switches"] = _kernel_switches(defect, p["tensor"])
    # S rows padded to 4 words: 16-byte aligned rows for tgemm's copies
    p["qc"], p["s"] = (workspace or Workspace()).views(
        (n_q, nh, width), (n_q, nh, s_columns(max_vis)), stream)
    # the attention GEMMs' operands: a sequence's s_q * nh rows (the same arrays at s_q = 1)
    p["qc_rows"], p["s_rows"], p["o_lat_rows"] = p["qc"], p["s"], p["o_lat"]
    if s_q > 1:
        p["qc_rows"] = p["qc"].reshape((n_seq, s_q * nh, width))
        p["s_rows"] = p["s"].reshape((n_seq, s_q * nh, s_columns(max_vis)))
        p["o_lat_rows"] = p["o_lat"].reshape((n_seq, s_q * nh, rank))
    w_uk, b_order = d_w_uk, ("zkn" if w_uk_layout == "mla" else "znk")
    if defect == "w_uk_transposed":  # the same words, read as the other layout
        flipped = (nh, rank, d_nope) if w_uk_layout == "mla" else (nh, d_nope, rank)
        w_uk, b_order = d_w_uk.reshape(flipped), ("znk" if w_uk_layout == "mla" else "zkn")
    p.update(q_nope=d_q_nope, q_pe=d_q_pe, w_uk=w_uk, uk_order=b_order, w_uv=d_w_uv,
             latent=d_latent, paging=None)
    if page_table is not None:
        p.update(pages=d_latent, page_table=page_table, page_size=int(d_latent.shape[1]),
                 page_defect=page_defect)
        if (p["tensor"] and tgemm.usable(p["qc_rows"], d_latent, a_order="zmk", b_order="znk")
                and tgemm.usable(p["s_rows"], d_latent, a_order="zmk", b_order="zkn")):
            p["paging"] = "tgemm"  # the tensor-core GEMMs read the pages themselves
        else:
            p["paging"] = "gather"
            p["latent"] = (workspace or Workspace()).rows((n_seq, max(max_vis, 1), width),
                                                         np.dtype(d_latent.dtype), stream)
    return weight_gemm_scratch(p, stream, workspace=workspace)


def launch_softmax(p, stream, defect=None, threads=RESIDENT_THREADS):
    """Softmax of ``p["s"]`` [Q, nh, Lw] in place over ``p["vis"]``, ``p["lse"]``
    written: a block of ``threads`` a row held in registers when ``Lw`` fits
    (``resident_vals``), else a warp a row. ``defect``: one of
    ``SOFTMAX_SWITCHES`` or None; ``threads``: the resident kernel's block
    (default ``RESIDENT_THREADS``; 256, the GPU's, runs on the simulator too)."""
    n_q, nh = p["n_q"], p["nh"]
    vals = resident_vals(int(p["s"].shape[2]), threads)
    s_q = p.get("s_q", 1)
    if vals is not None:
        kernel = (softmax_resident_kernel(vals, defect, threads, s_q) if s_q > 1
                  else softmax_resident_kernel(vals, defect, threads))
        kernel[(nh, n_q), threads, stream](p["s"], p["vis"], p["lse"])
    else:
        kernel = softmax_rows_kernel(defect, s_q) if s_q > 1 else softmax_rows_kernel(defect)
        kernel[((nh + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK, n_q), ROWS_PER_BLOCK * WARP,
               stream](p["s"], p["vis"], p["lse"])


def _attention_gemm(p, a, b, c, n_ext, k_ext, alpha, *, b_order, max_n, stream,
                    switches=None):
    """c[q] = alpha a[q] @ op(latent[slot[q]]) for every query (a, c "zmk" /
    "zmn"): ``tgemm`` when the plan asks for it and the call is ``usable``,
    else ``sgemm``. ``switches``: ``_kernel_switches``' dict (the defect each
    GEMM kernel is built with), or None."""
    if p.get("paging") == "tgemm":  # b: the pages; slots: the page table
        tgemm.launch(a, p["pages"], c, p["page_table"], n_ext, k_ext, alpha, a_order="zmk",
                     b_order=b_order, c_order="zmn", max_n=max_n, n_batch=p["n_seq"],
                     stream=stream, ready=p["smem_ready"],
                     defect=(switches or {}).get("tgemm"), page_size=p["page_size"],
                     page_defect=p["page_defect"])
        return
    gemm, defect = sgemm, (switches or {}).get("sgemm")
    if p["tensor"] and tgemm.usable(a, b, a_order="zmk", b_order=b_order):
        gemm, defect = tgemm, (switches or {}).get("tgemm")
    gemm.launch(a, b, c, p["slots"], n_ext, k_ext, alpha, a_order="zmk", b_order=b_order,
                c_order="zmn", max_n=max_n, n_batch=p["n_seq"], stream=stream,
                ready=p["smem_ready"], defect=defect)


def weight_gemm_method(m_len, n_len, k_len, nh, sms, tensor=False):
    """``("tgemm", plan)``, ``("skinny", 1)``, ``("sgemm", S)`` (S > 1: its K
    split, ``sgemm.k_splits``) or ``("sgemm", 1)``: how a weight GEMM of
    ``m_len`` rows a head runs on a GPU of ``sms`` SMs (0: the simulator's, no
    K split). ``tensor`` (the 16-bit tensor-core MLA, ``mla.mma``): split-tf32
    tensor cores (``attention.gemm.tgemm``, ``weight_plan``'s tile) where ``M``
    is more than half the tile's rows and the grid fills the SMs once (on the
    simulator: the rows alone); else as without."""
    if tensor:
        plan = tgemm.weight_plan(n_len, nh, sms)
        if (m_len > tgemm.tile_shape(plan)[0] // 2
                and tgemm.weight_blocks(m_len, n_len, nh, plan) >= int(sms)):
            return "tgemm", plan
    if skinny.use_skinny(m_len, n_len, k_len, nh):
        return "skinny", 1
    return "sgemm", (sgemm.k_splits(m_len, n_len, k_len, nh, sms) if sms else 1)


WEIGHT_GEMMS = ("absorb", "decompress")


def weight_operands(p, name):
    """``(a, b, c, n_ext, k_ext, n_len, k_len, b_order)`` of weight GEMM ``name``
    of a ``prepare`` dict: "absorb" (qc[:, :, :r] = q_nope W_UK) or
    "decompress" (out = o_lat W_UV^T), a [M, nh, K] and c [M, nh, >= N]."""
    if name == "absorb":
        return (p["q_nope"], p["w_uk"], p["qc"], p["h_rank"], p["h_nope"], p["rank"],
                int(p["q_nope"].shape[2]), p["uk_order"])
    if name == "decompress":
        return (p["o_lat"], p["w_uv"], p["out"], p["h_dv"], p["h_rank"], p["d_v"], p["rank"],
                "znk")
    raise ValueError(f"weight GEMM: expected one of {WEIGHT_GEMMS}, got {name!r}")


def weight_gemm_scratch(p, stream, sms=None, workspace=None):
    """The absorb and decompress GEMMs' ways on this GPU, ``p["weight_way"]``
    ({name: ``weight_gemm_method``'s, with ``p["weight_tensor"]`` (False when
    absent) as its ``tensor``; ``tgemm`` only where ``tgemm.usable`` takes the
    operands}), and their K-split scratch, kept in ``p``
    (``p["k_split"]``: {"absorb" / "decompress": (S, float32 device array)}
    for each that splits on this GPU; ``sms`` default ``sgemm.sm_count()``).
    One buffer for both (they run one after the other on one stream), from
    ``workspace`` when one is given (``Workspace.k_scratch``: reused by every
    call over it), else allocated here. Either way it exists before the
    launches, so they (and a graph capture of them) allocate nothing."""
    sms = sgemm.sm_count() if sms is None else int(sms)
    n_q, nh = p["n_q"], p["nh"]
    planned, p["weight_way"] = {}, {}
    for name in WEIGHT_GEMMS:
        a, b, _, _, _, n_len, k_len, b_order = weight_operands(p, name)
        way = weight_gemm_method(n_q, n_len, k_len, nh, sms, p.get("weight_tensor", False))
        if way[0] == "tgemm" and not tgemm.usable(a, b, a_order="mzk", b_order=b_order,
                                                   plan=way[1]):
            way = weight_gemm_method(n_q, n_len, k_len, nh, sms)
        p["weight_way"][name] = way
        method, k_split = way
        if method == "sgemm" and k_split > 1:
            planned[name] = (k_split, sgemm.k_scratch_size(nh, k_split, n_q, n_len))
    p["k_split"] = {}
    if planned:
        need = max(size for _, size in planned.values())
        buf = (workspace.k_scratch(need, stream) if workspace is not None
               else device_empty(need, np.float32, stream))
        p["k_split"] = {name: (k_split, buf) for name, (k_split, _) in planned.items()}
    return p


def weight_gemm(p, name, stream, defect=None, way=None, k_scratch=None):
    """Weight GEMM ``name`` (``weight_operands``) batched over heads, one weight
    a head (``p["heads"]`` is ``arange(nh)``, N and K the same for every head).
    ``way`` None: the call's plan, ``p["weight_way"]`` (``weight_gemm_scratch``;
    where it is absent, ``weight_gemm_method`` without ``tensor``): ``tgemm``
    (split-tf32 tensor cores, the 16-bit MLA's), ``skinny`` (few rows a head
    and a small ``sgemm`` grid; ``sgemm``'s bits), else ``sgemm``, which also
    carries the planted switches (``defect``: ``sgemm`` in one launch), with
    the K split ``weight_gemm_scratch`` planned (the same bits, two launches).
    ``way`` ("tgemm", plan), ("skinny", 1) or ("sgemm", S) forces one
    (``bench.mla_probe``; a forced split takes ``k_scratch``)."""
    a, b, c, n_ext, k_ext, n_len, k_len, b_order = weight_operands(p, name)
    nh = p["nh"]
    if way is None:
        way = ("sgemm", 1)
        if defect is None:
            way = ((p.get("weight_way") or {}).get(name)
                   or weight_gemm_method(int(a.shape[0]), n_len, k_len, nh, 0))
            if way[0] == "sgemm":
                k_split, k_scratch = (p.get("k_split") or {}).get(name, (1, None))
                way = ("sgemm", k_split)
    if way[0] == "tgemm":
        tgemm.launch(a, b, c, p["heads"], n_ext, k_ext, 1.0, a_order="mzk", b_order=b_order,
                     c_order="mzn", max_n=n_len, n_batch=nh, stream=stream,
                     ready=p["smem_ready"], plan=way[1])
        return
    if way[0] == "skinny":
        skinny.launch(a, b, c, 1.0, a_order="mzk", b_order=b_order, c_order="mzn",
                      n_len=n_len, k_len=k_len, n_batch=nh, stream=stream,
                      ready=p["smem_ready"])
        return
    sgemm.launch(a, b, c, p["heads"], n_ext, k_ext, 1.0, a_order="mzk", b_order=b_order,
                 c_order="mzn", max_n=n_len, n_batch=nh, stream=stream,
                 ready=p["smem_ready"], defect=defect, k_split=way[1], k_scratch=k_scratch)


def launch_absorb(p, stream, defect=None):
    """qc[:, :, :r] = q_nope W_UK (an fp32 GEMM batched over heads: ``weight_gemm``) and
    qc[:, :, r:] = q_pe: the ``p`` keys q_nope, w_uk, uk_order, qc, heads,
    h_rank, h_nope, q_pe, n_q, nh, rank, d_rope, smem_ready (``prepare``'s).
    ``defect``: the sgemm switch or None."""
    n_q, nh, rank, d_rope = p["n_q"], p["nh"], p["rank"], p["d_rope"]
    weight_gemm(p, "absorb", stream, defect)
    if d_rope:
        total = n_q * nh * d_rope
        pack_q_pe_kernel[min((total + 255) // 256, 1024), 256, stream](p["q_pe"], p["qc"], rank)


def launch_decompress(p, stream, defect=None):
    """out = o_lat W_UV^T (batched over heads): the ``p`` keys o_lat, w_uv, out,
    heads, h_dv, h_rank, d_v, nh, rank, smem_ready."""
    weight_gemm(p, "decompress", stream, defect)


def launch_prepared(p, stream):
    """Enqueue the five launches of a ``prepare`` dict on ``stream`` (a numba
    stream, 0, or a cuda.core graph builder)."""
    n_q, nh, rank, d_rope = p["n_q"], p["nh"], p["rank"], p["d_rope"]
    if n_q == 0:
        return
    sw = p.get("switches") or _kernel_switches(None, p["tensor"])
    # -- 0. a paged cache read by sgemm: each query's visible rows, gathered --
    if p.get("paging") == "gather":
        PG.launch_gather(p["pages"], p["page_table"], p["vis"], p["latent"], stream,
                         p["page_defect"])
    # -- 1. absorb into qc[:, :, :r], pack q_pe into qc[:, :, r:] --
    launch_absorb(p, stream, sw["sgemm"])
    if sw["q_bf16"]:
        total = n_q * nh * (rank + d_rope)
        round_bf16_kernel[min((total + 255) // 256, 1024), 256, stream](p["qc"])

    # -- 2. scores over each query's visible rows --
    _attention_gemm(p, p["qc_rows"], p["latent"], p["s_rows"], p["vis"], p["q_score"],
                    p["scale"], b_order="znk", max_n=p["max_vis"], stream=stream, switches=sw)

    # -- 3. softmax rows in place, LSE --
    launch_softmax(p, stream, sw["softmax"])

    # -- 4. P . c_kv: every query's r latent columns (K = its visible rows) --
    _attention_gemm(p, p["s_rows"], p["latent"], p["o_lat_rows"], p["q_rank"], p["vis"], 1.0,
                    b_order="zkn", max_n=rank, stream=stream, switches=sw)

    # -- 5. decompress through W_UV (batch over heads) --
    launch_decompress(p, stream, sw["sgemm"])


def chunk_bounds(n_q, chunk=None):
    """[(q0, q1), ...]: ``n_q`` queries in consecutive chunks of at most
    ``chunk`` (one chunk when ``chunk`` is None or at least ``n_q``)."""
    if chunk is None or chunk >= n_q:
        return [(0, n_q)]
    if chunk < 1:
        raise ValueError(f"chunk: expected at least 1 query, got {chunk}")
    return [(q0, min(q0 + chunk, n_q)) for q0 in range(0, n_q, chunk)]


def prepare_chunks(d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale, *, d_rope,
                   w_uk_layout, stream, chunk=None, defect=None, workspace=None, d_vis=None,
                   tensor=True, max_vis=None, page_table=None, page_defect=None, s_q=1):
    """``prepare`` for each chunk of at most ``chunk`` consecutive queries
    (``chunk_bounds``; arguments as ``prepare``, ``slots`` / ``vis`` / ``d_vis``
    for all ``Q`` queries).

    Every chunk is sized as the whole batch (S's row width and the score
    grid from the whole batch's ``max_vis``), runs over the same
    ``workspace`` (scratch for one chunk: ``workspace_bytes(chunk, ...)``) and
    writes its rows of one ``out`` [Q, nh, d_v], ``o_lat`` [Q, nh, r] and
    ``lse`` [Q, nh]. A query's launches differ from those of the unchunked
    batch only in the batch extent of the grid, and each output element's sum
    order depends on its own operands only: the results are the unchunked
    ones bit for bit. Chunks must run in order on one stream (they share the
    scratch). ``page_table`` [Q, max_pages] (a paged cache, ``prepare``): each
    chunk reads its rows of it. Returns (list of ``prepare`` dicts, out,
    o_lat, lse).

    ``s_q`` > 1 (``prepare``'s multi-token decode): ``slots``, ``vis``,
    ``d_vis`` and ``page_table`` are per sequence and ``chunk`` counts
    sequences (each with its s_q queries).
    """
    n_q, nh = int(d_q_nope.shape[0]), int(d_q_nope.shape[1])
    s_q = int(s_q)
    bounds = chunk_bounds(n_q // max(s_q, 1), chunk)
    if len(bounds) == 1:
        p = prepare(d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale,
                    d_rope=d_rope, w_uk_layout=w_uk_layout, stream=stream, defect=defect,
                    workspace=workspace, d_vis=d_vis, tensor=tensor, max_vis=max_vis,
                    page_table=page_table, page_defect=page_defect, s_q=s_q)
        return [p], p["out"], p["o_lat"], p["lse"]
    slots, vis = np.asarray(slots), np.asarray(vis)
    if max_vis is None:
        max_vis = int(vis.max()) if vis.size else 0
    rank = int(d_latent.shape[2]) - d_rope
    out = device_empty((n_q, nh, int(d_w_uv.shape[1])), np.float32, stream)
    o_lat = device_empty((n_q, nh, rank), np.float32, stream)
    lse = device_empty((n_q, nh), np.float32, stream)
    workspace = workspace or Workspace()
    plans = []
    for b0, b1 in bounds:  # sequences b0..b1-1: queries q0..q1-1
        q0, q1 = b0 * s_q, b1 * s_q
        plans.append(prepare(
            d_q_nope[q0:q1], d_q_pe[q0:q1] if d_rope else d_q_pe, d_w_uk, d_w_uv, d_latent,
            slots[b0:b1], vis[b0:b1], scale, d_rope=d_rope, w_uk_layout=w_uk_layout,
            stream=stream, defect=defect, workspace=workspace,
            d_vis=None if d_vis is None else d_vis[b0:b1], tensor=tensor, max_vis=max_vis,
            out=out[q0:q1], o_lat=o_lat[q0:q1], lse=lse[q0:q1],
            page_table=None if page_table is None else page_table[b0:b1],
            page_defect=page_defect, s_q=s_q))
        plans[-1]["smem_ready"] = plans[0]["smem_ready"]  # one record for every chunk
    return plans, out, o_lat, lse


def launch_chunks(plans, stream):
    """``launch_prepared`` for each of ``prepare_chunks``' dicts, in order."""
    for p in plans:
        launch_prepared(p, stream)


def enqueue(d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale, *, d_rope,
            w_uk_layout, stream, defect=None, workspace=None, tensor=True, chunk=None,
            d_vis=None, page_table=None, page_defect=None, s_q=1):
    """``prepare_chunks`` then ``launch_chunks`` on ``stream`` (arguments as
    ``prepare``; ``chunk``: queries per launch set, None for one set; with
    ``s_q`` > 1: sequences of s_q queries).
    Returns (out [Q, nh, d_v], o_lat [Q, nh, r], lse [Q, nh]) device float32."""
    plans, out, o_lat, lse = prepare_chunks(
        d_q_nope, d_q_pe, d_w_uk, d_w_uv, d_latent, slots, vis, scale, d_rope=d_rope,
        w_uk_layout=w_uk_layout, stream=stream, chunk=chunk, defect=defect,
        workspace=workspace, tensor=tensor, d_vis=d_vis, page_table=page_table,
        page_defect=page_defect, s_q=s_q)
    launch_chunks(plans, launch_stream(stream))
    return out, o_lat, lse
