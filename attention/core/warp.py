"""Warp-level building blocks shared by every kernel in this project.

Each helper is a ``@cuda.jit(device=True, inline="always")`` function: it is
inlined into the calling kernel (so kernels compile with ``compile_ptx`` and no
GPU) and it is the *only* implementation of its reduction in the project.

All helpers assume the full warp (32 lanes) calls them together: callers
predicate loads and stores, never the collective itself.

* ``warp_sum(v)`` / ``warp_max(v)``: butterfly (``shfl_xor``) reduction over
  32 lanes; the result is in every lane.
* ``group_sum(v, lanes)``: the butterfly over aligned groups of ``lanes``
  lanes (a power of two <= 32; a compile-time constant in the caller): every
  lane gets its group's total. ``group_sum(v, 32) == warp_sum(v)``.
* ``block_max(v, red)`` / ``block_sum(v, red)``: the whole block's max / sum
  in every thread: ``warp_max`` / ``warp_sum``, then the warps' values in warp
  order through ``red`` (a shared float32 array, one entry a warp; every warp
  of the block calls it). ``red`` may be reused as soon as it returns.
* ``warp_sum_down(v)``: shuffle-down tree into lane 0, then a broadcast from
  lane 0 (``shfl_sync(.., 0)``), so every lane holds lane 0's total. This is the
  reference design's order of additions.
* ``online_softmax_update(m, l, s)``: one step of the streaming softmax
  (Milakov & Gimelshein): returns ``(m_new, l_new, alpha, p)`` where
  ``m_new = max(m, s)``, ``alpha = exp(m - m_new)`` rescales everything
  accumulated so far, ``p = exp(s - m_new)`` weighs the new score and
  ``l_new = l * alpha + p``. The old max is read *before* it is replaced: the
  defect this project exists to catch is ``alpha`` computed from the new max
  twice (``exp(0) == 1``).
* ``online_softmax_merge(m, l, m2, l2)``: merge two partial softmax states
  (used by the split-KV combine and by lane-parallel decode); returns
  ``(m_new, l_new, alpha, beta)`` with ``alpha``/``beta`` the factors for the
  first and second state's accumulators.
* ``batch_reference(m_max)``: the reference max for merging a batch of
  states at once (weights ``exp(m_j - ref)``, independent of each other): the
  batch's max, or 0 when every state is empty.
* ``softmax_finish(m, l)``: the epilogue's ``(1 / l, m + log(l))`` with a
  correctly rounded reciprocal and an accurate ``logf`` (libdevice's
  ``frcp_rn`` and ``logf``), or ``(0, -inf)`` for an empty state. Under
  ``fastmath=True`` a plain ``1.0 / l`` compiles to ``div.approx`` and
  ``math.log`` to ``lg2.approx``: both cost an ulp or two on every output of a
  head (the validation's mean rule saw it, notes/validation.md), for one
  division and one log a head, so the epilogues take the accurate ones.
* ``fragment_softmax_tiles(s, n_s, o, n_o, m0, m1, l0, l1, new0, new1)``: the
  same step on the C fragments of a 16-row mma tile (two rows a lane, ``n_s /
  4`` n tiles of scores): P in place of the scores, the accumulators rescaled,
  the lane's parts of the row sums returned (the tensor-core kernels);
  ``fragment_softmax_step`` is its two-tile form; ``fragment_mask``,
  ``fragment_row_max`` and ``fragment_store_rows``: the masking, the rows'
  maxima and the epilogue's stores on the same layout (the tensor-core prefills).
* ``compensated_rescale_add(total, comp, alpha, y)``: ``total * alpha + y``
  with Kahan compensation, for accumulators summed over many positions in
  sequence (the warp-per-head decode). The true sum is ``total - comp``. A
  compiler allowed to reassociate could fold the compensation to zero; the
  PTX tests check that it survives numba-cuda's ``fastmath=True``.

``-inf`` handling: a state that has seen no score has ``m = -inf, l = 0``.
Updating it with a finite score gives ``alpha = exp(-inf) = 0``. Merging two
empty states returns factors 0 (never ``exp(-inf - -inf) = NaN``).
"""

import math

from numba import cuda, float32

from attention.core.device import SIMULATOR

FULL_MASK = 0xFFFFFFFF


@cuda.jit(device=True, inline="always")
def warp_sum(v):
    """Sum of ``v`` over the 32 lanes, in every lane (butterfly)."""
    v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
    return v


@cuda.jit(device=True, inline="always")
def warp_max(v):
    """Maximum of ``v`` over the 32 lanes, in every lane (butterfly)."""
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
    return v


@cuda.jit(device=True, inline="always")
def group_sum(v, lanes):
    """Sum of ``v`` over each aligned group of ``lanes`` lanes, in every lane of it."""
    off = lanes // 2
    while off > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, off)
        off //= 2
    return v


@cuda.jit(device=True, inline="always")
def group_max(v, lanes):
    """Maximum of ``v`` over each aligned group of ``lanes`` lanes, in every lane
    of it (``lanes`` 4: the quad holding one row of an mma accumulator)."""
    off = lanes // 2
    while off > 0:
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
        off //= 2
    return v


@cuda.jit(device=True, inline="always")
def block_max(v, red):
    """Maximum of ``v`` over the block, in every thread. red: shared [warps]
    of ``v``'s type (float32 in the kernels; the simulator test uses float64),
    at least the block's warps; only the block's warps' entries are read (a
    smaller block than ``red`` is sized for leaves the rest as an earlier
    block wrote it)."""
    v = warp_max(v)
    if cuda.threadIdx.x % 32 == 0:
        red[cuda.threadIdx.x // 32] = v
    cuda.syncthreads()
    v = red[0]
    for w in range(1, min(red.shape[0], (cuda.blockDim.x + 31) // 32)):
        v = max(v, red[w])
    cuda.syncthreads()  # every thread has read red before it is reused
    return v


@cuda.jit(device=True, inline="always")
def block_sum(v, red):
    """Sum of ``v`` over the block (warp by warp, in warp order), in every thread.
    red: shared [warps] of ``v``'s type (float32 in the kernels; the simulator
    test uses float64, so its sums are exact); as ``block_max``, only the
    block's warps' entries are read."""
    v = warp_sum(v)
    if cuda.threadIdx.x % 32 == 0:
        red[cuda.threadIdx.x // 32] = v
    cuda.syncthreads()
    v = red[0]
    for w in range(1, min(red.shape[0], (cuda.blockDim.x + 31) // 32)):
        v += red[w]
    cuda.syncthreads()  # every thread has read red before it is reused
    return v


@cuda.jit(device=True, inline="always")
def warp_sum_down(v):
    """Shuffle-down tree sum into lane 0, broadcast to every lane."""
    v += cuda.shfl_down_sync(FULL_MASK, v, 16)
    v += cuda.shfl_down_sync(FULL_MASK, v, 8)
    v += cuda.shfl_down_sync(FULL_MASK, v, 4)
    v += cuda.shfl_down_sync(FULL_MASK, v, 2)
    v += cuda.shfl_down_sync(FULL_MASK, v, 1)
    return cuda.shfl_sync(FULL_MASK, v, 0)


@cuda.jit(device=True, inline="always")
def online_softmax_update(m, l, s):
    """One streaming-softmax step. Returns ``(m_new, l_new, alpha, p)``.

    m, l: running max and running sum (float32 scalars); s: the new score.
    Accumulators must be updated by the caller as ``acc = acc * alpha + p * v``.
    """
    m_new = max(m, s)
    alpha = math.exp(m - m_new)  # reads the OLD max: rescale of what came before
    p = math.exp(s - m_new)
    return m_new, l * alpha + p, alpha, p


@cuda.jit(device=True, inline="always")
def online_softmax_merge(m, l, m2, l2):
    """Merge softmax state ``(m2, l2)`` into ``(m, l)``.

    Returns ``(m_new, l_new, alpha, beta)``; accumulators combine as
    ``acc = acc * alpha + acc2 * beta``. Two empty states give zero factors.
    """
    m_new = max(m, m2)
    if m_new == -math.inf:
        return m_new, float32(0.0), float32(0.0), float32(0.0)
    alpha = math.exp(m - m_new)
    beta = math.exp(m2 - m_new)
    return m_new, l * alpha + l2 * beta, alpha, beta


@cuda.jit(device=True, inline="always")
def batch_reference(m_max):
    """The reference max of a batch of softmax states merged at once, given
    their largest running max: the states' weights are ``exp(m_j - ref)``. An
    all-empty batch (``m_max = -inf``) takes 0, so every weight is
    ``exp(-inf) = 0``, not NaN."""
    return m_max if m_max > float32(-3.0e38) else float32(0.0)


@cuda.jit(device=True, inline="always")
def fragment_softmax_tiles(s, n_s, o, n_o, m0, m1, l0, l1, new0, new1):
    """One online-softmax step on a 16-row mma tile's fragments (the tensor-core
    kernels: ``attention.decode.mma``, ``attention.prefill.tf32``, ``mla.mma``).

    ``s`` [n_s] float32 (``n_s = 4 x`` the n tiles): a lane's scaled, masked
    scores of ``n_s / 4`` 8-position n tiles, ``s[4 h + e]`` of row ``g = lane //
    4`` and ``s[4 h + 2 + e]`` of row ``g + 8`` (the mma's C layout, ``h`` the n
    tile); ``o`` [n_o] float32: the lane's P.V accumulators in the same layout
    (``o[4 nd + 0, 1]`` row g, ``+ 2, 3`` row g + 8); ``m0, m1``: the rows' running
    maxima; ``l0, l1``: this lane's parts of the row sums; ``new0, new1``: the
    rows' new maxima (the caller takes them over the quad, or over warps). An
    all-masked row (new max ``-inf``) takes reference 0, so its weights are
    ``exp(-inf) = 0``, never NaN. ``s`` becomes ``P = exp(s - new)`` and ``o`` is
    rescaled by ``exp(m - new)``; returns ``(l0, l1)`` with this tile's P added
    (a lane's pairs summed first, then the n tiles in order:
    ``((p0 + p1) + (p4 + p5)) + ...``)."""
    ref0 = new0 if new0 > float32(-3.0e38) else float32(0.0)
    ref1 = new1 if new1 > float32(-3.0e38) else float32(0.0)
    alpha0 = float32(math.exp(m0 - ref0))
    alpha1 = float32(math.exp(m1 - ref1))
    for h in range(n_s // 4):
        for e in range(2):
            s[4 * h + e] = float32(math.exp(s[4 * h + e] - ref0))
            s[4 * h + 2 + e] = float32(math.exp(s[4 * h + 2 + e] - ref1))
    sum0 = float32(s[0] + s[1])
    sum1 = float32(s[2] + s[3])
    for h in range(1, n_s // 4):
        sum0 = float32(sum0 + (s[4 * h] + s[4 * h + 1]))
        sum1 = float32(sum1 + (s[4 * h + 2] + s[4 * h + 3]))
    l0 = float32(l0 * alpha0 + sum0)
    l1 = float32(l1 * alpha1 + sum1)
    for nd in range(n_o // 4):
        o[4 * nd] *= alpha0
        o[4 * nd + 1] *= alpha0
        o[4 * nd + 2] *= alpha1
        o[4 * nd + 3] *= alpha1
    return l0, l1


@cuda.jit(device=True, inline="always")
def fragment_mask(s, n_s, pos0, lim0, lim1):
    """Mask a lane's scores (``s`` [n_s], the C layout of ``fragment_softmax_tiles``)
    to -inf where the position is not below its row's limit: ``s[4 h + e]`` is
    row g's score of position ``pos0 + 8 h + e`` (``pos0``: the tile's first
    position plus ``2 (lane % 4)``), limit ``lim0``; ``s[4 h + 2 + e]`` row g + 8's,
    limit ``lim1`` (the tensor-core prefills)."""
    for h in range(n_s // 4):
        for e in range(2):
            pos = pos0 + 8 * h + e
            if pos >= lim0:
                s[4 * h + e] = float32(-math.inf)
            if pos >= lim1:
                s[4 * h + 2 + e] = float32(-math.inf)


@cuda.jit(device=True, inline="always")
def fragment_row_max(s, n_s):
    """(row g's, row g + 8's) largest of a lane's scores ``s`` [n_s] (the C
    layout of ``fragment_softmax_tiles``); the caller takes them over the quad."""
    top0 = s[0]
    top1 = s[2]
    for h in range(n_s // 4):
        top0 = max(top0, max(s[4 * h], s[4 * h + 1]))
        top1 = max(top1, max(s[4 * h + 2], s[4 * h + 3]))
    return top0, top1


@cuda.jit(device=True, inline="always")
def fragment_store_rows(out, lse, head, o, n_o, r0, col0, t_len, tq, inv0, inv1, lse0, lse1):
    """Write a lane's part of two finished rows of a 16-row tile: ``out[r, col0 +
    8 nd + e] = o[4 nd + e] * inv0`` for row ``r0`` and ``o[4 nd + 2 + e] * inv1``
    for row ``r0 + 8`` (``o`` [n_o], the C layout), rows at or past ``t_len``
    skipped; the quad's first lane (``tq == 0``) writes ``lse[head, r]`` (the
    tensor-core prefills: out [T, H*D], lse [H, T])."""
    if r0 < t_len:
        for nd in range(n_o // 4):
            out[r0, col0 + 8 * nd] = o[4 * nd] * inv0
            out[r0, col0 + 8 * nd + 1] = o[4 * nd + 1] * inv0
        if tq == 0:
            lse[head, r0] = lse0
    r1 = r0 + 8
    if r1 < t_len:
        for nd in range(n_o // 4):
            out[r1, col0 + 8 * nd] = o[4 * nd + 2] * inv1
            out[r1, col0 + 8 * nd + 1] = o[4 * nd + 3] * inv1
        if tq == 0:
            lse[head, r1] = lse1


@cuda.jit(device=True, inline="always")
def fragment_softmax_step(s, o, n_o, m0, m1, l0, l1, new0, new1):
    """``fragment_softmax_tiles`` of two n tiles (``s`` [8]): the 16-bit
    tensor-core decodes' step."""
    return fragment_softmax_tiles(s, 8, o, n_o, m0, m1, l0, l1, new0, new1)


@cuda.jit(device=True, inline="always")
def compensated_rescale_add(total, comp, alpha, y):
    """Kahan-compensated ``total * alpha + y``. Returns ``(total, comp)``.

    ``comp`` (start at 0) holds the rounding error of the sum so far, negated:
    the exact running value is ``total - comp``. It is rescaled with ``total``
    (online softmax's ``alpha``), so a change of running max keeps it valid.
    """
    scaled = total * alpha
    y = y - comp * alpha
    t = scaled + y
    return t, (t - scaled) - y


if SIMULATOR:  # libdevice's functions are stubs there: the same roundings in numpy
    @cuda.jit(device=True, inline="always")
    def softmax_finish(m, l):
        """``(fl(1 / l), fl(m + fl(log l)))`` of a softmax state; ``(0, -inf)``
        when empty (``l == 0``)."""
        if l > float32(0.0):
            return float32(float32(1.0) / float32(l)), float32(m + float32(math.log(l)))
        return float32(0.0), float32(-math.inf)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def softmax_finish(m, l):
        """``(fl(1 / l), fl(m + fl(log l)))`` of a softmax state; ``(0, -inf)``
        when empty (``l == 0``)."""
        if l > float32(0.0):
            return libdevice.frcp_rn(l), m + libdevice.logf(l)
        return float32(0.0), float32(-math.inf)
