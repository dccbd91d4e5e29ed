"""Float64 CPU references for MLA. The only place MLA references live.

Written plainly (explicit per-query, per-head loops, one full softmax through
``attention.oracle.softmax_attend``) so they cannot share a defect with the
kernels they judge. Layouts (the "mla" layout used everywhere in ``mla/``)::

    q_nope [t_q, nh, d_nope]   q_pe [t_q, nh, d_rope]
    c_kv   [t_kv, r]           k_pe [t_kv, d_rope]      (shared by all heads)
    w_uk   [nh, d_nope, r]     w_uv [nh, d_v, r]
    out    [t_q, nh, d_v]

Causal rule (prefill, chunked prefill and decode alike): the ``t_q`` queries
are the last ``t_q`` of the ``t_kv`` positions, so query ``i`` attends to
positions ``0 .. t_kv - t_q + i`` (inclusive). Decode is ``t_q = 1``.

Two forms of the same attention:

* naive:    ``k_nope[s,h] = W_UK[h] c_kv[s]``, ``v[s,h] = W_UV[h] c_kv[s]``,
  ``score = scale (q_nope . k_nope + q_pe . k_pe)``, ``out = softmax . v``;
* absorbed: ``q_lat[t,h] = W_UK[h]^T q_nope[t,h]``, ``score = scale (q_lat .
  c_kv[s] + q_pe . k_pe[s])``, ``o_lat = sum_s p_s c_kv[s]``,
  ``out[t,h] = W_UV[h] o_lat``.

Batched decode (``mla_decode_ref``, and ``mla_decode_paged_ref`` over a paged
cache): sequence b's ``s_q`` new queries ``[B, s_q, nh, .]`` are its last
``s_q`` positions (``t_q = s_q``, ``t_kv = lengths[b]``): multi-token decode,
as in DeepSeek's multi-token prediction, by the same causal rule.

``mla_attend_float32`` is the same-precision *baseline* (absorbed form in
float32 numpy) whose error against the float64 oracles sets the kernels'
tolerance (``tolerance()``).
"""

from __future__ import annotations

import numpy as np

from attention.oracle import softmax_attend

F32_EPS = float(np.finfo(np.float32).eps)


def default_scale(d_nope, d_rope):
    return 1.0 / np.sqrt(d_nope + d_rope)


def visible_positions(t_q, t_kv, i):
    """Number of positions query ``i`` of ``t_q`` attends (``t_kv - t_q + i + 1``)."""
    return t_kv - t_q + i + 1


def _unpack(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv):
    arrs = [np.asarray(a, dtype=np.float64) for a in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)]
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = arrs
    t_q, nh, d_nope = q_nope.shape
    t_kv, r = c_kv.shape
    d_rope = q_pe.shape[2]
    if t_q > t_kv:
        raise ValueError(f"t_q={t_q} queries cannot be the last of t_kv={t_kv} positions")
    assert q_pe.shape[:2] == (t_q, nh) and k_pe.shape == (t_kv, d_rope)
    assert w_uk.shape == (nh, d_nope, r) and w_uv.shape[0] == nh and w_uv.shape[2] == r
    return q_nope, q_pe, c_kv, k_pe, w_uk, w_uv


def mla_attend_naive(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=None, return_lse=False):
    """MLA with per-head keys and values decompressed first (float64).

    Returns out [t_q, nh, d_v] (and lse [t_q, nh] with ``return_lse``).
    """
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = _unpack(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    t_q, nh, d_nope = q_nope.shape
    t_kv = c_kv.shape[0]
    if scale is None:
        scale = default_scale(d_nope, q_pe.shape[2])
    # step 1: decompress every cached latent row into per-head keys and values
    k_nope = np.einsum("hpl,sl->shp", w_uk, c_kv)  # [t_kv, nh, d_nope]
    values = np.einsum("hjl,sl->shj", w_uv, c_kv)  # [t_kv, nh, d_v]
    out = np.zeros((t_q, nh, w_uv.shape[1]))
    lse = np.full((t_q, nh), -np.inf)
    for i in range(t_q):
        vis = visible_positions(t_q, t_kv, i)
        for h in range(nh):
            # step 2: scores over the visible positions
            scores = k_nope[:vis, h] @ q_nope[i, h] + k_pe[:vis] @ q_pe[i, h]  # [vis]
            # step 3: one full softmax, weighted values
            out[i, h], lse[i, h] = softmax_attend(scores * scale, values[:vis, h])
    return (out, lse) if return_lse else out


def mla_attend_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=None, return_lse=False):
    """MLA in absorbed form: attention over the latent rows themselves (float64).

    Returns out [t_q, nh, d_v] (and lse [t_q, nh] with ``return_lse``).
    """
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = _unpack(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    t_q, nh, d_nope = q_nope.shape
    t_kv = c_kv.shape[0]
    if scale is None:
        scale = default_scale(d_nope, q_pe.shape[2])
    out = np.zeros((t_q, nh, w_uv.shape[1]))
    lse = np.full((t_q, nh), -np.inf)
    for i in range(t_q):
        vis = visible_positions(t_q, t_kv, i)
        for h in range(nh):
            # step 1: absorb W_UK into the query
            q_lat = w_uk[h].T @ q_nope[i, h]  # [r]
            # step 2: scores against the latent rows [c_kv | k_pe]
            scores = c_kv[:vis] @ q_lat + k_pe[:vis] @ q_pe[i, h]  # [vis]
            # step 3: softmax-weighted latent rows, then decompress through W_UV
            o_lat, lse[i, h] = softmax_attend(scores * scale, c_kv[:vis])  # [r]
            out[i, h] = w_uv[h] @ o_lat  # [d_v]
    return (out, lse) if return_lse else out


def mla_attend_float32(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=None):
    """Same-precision baseline: the absorbed form in float32 numpy (vectorised).

    Not a reference: its error against the float64 oracles is what a plain
    float32 implementation costs, and sets the kernels' tolerance.
    """
    f = np.float32
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (np.asarray(a, dtype=f) for a in
                                            (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    t_q, nh, d_nope = q_nope.shape
    t_kv = c_kv.shape[0]
    if scale is None:
        scale = default_scale(d_nope, q_pe.shape[2])
    q_lat = np.einsum("hpl,thp->thl", w_uk, q_nope)  # [t_q, nh, r]
    scores = (np.einsum("thl,sl->ths", q_lat, c_kv)
              + np.einsum("thd,sd->ths", q_pe, k_pe)) * f(scale)  # [t_q, nh, t_kv]
    vis = np.array([visible_positions(t_q, t_kv, i) for i in range(t_q)])
    mask = np.arange(t_kv)[None, :] < vis[:, None]  # [t_q, t_kv]
    scores = np.where(mask[:, None, :], scores, f(-np.inf))
    m = scores.max(axis=2, keepdims=True) if t_kv else np.zeros((t_q, nh, 1), f)
    e = np.exp(scores - m)
    p = e / e.sum(axis=2, keepdims=True)
    o_lat = np.einsum("ths,sl->thl", p, c_kv)  # [t_q, nh, r]
    return np.einsum("hjl,thl->thj", w_uv, o_lat).astype(f)  # [t_q, nh, d_v]


def rope_interleaved_ref(x, positions, base=10000.0):
    """Interleaved rotary embedding (float64 copy of ``x`` rotated).

    x: [n_pos, ..., d_rope]; positions: [n_pos]. Adjacent pairs (2i, 2i+1) of
    row ``p`` rotate by ``positions[p] * base**(-2i/d_rope)``.
    """
    x = np.array(x, dtype=np.float64)
    d_rope = x.shape[-1]
    if d_rope == 0:
        return x
    pos = np.asarray(positions, dtype=np.float64).reshape((-1,) + (1,) * (x.ndim - 1))
    theta = base ** (-np.arange(0, d_rope, 2, dtype=np.float64) / d_rope)  # [d_rope/2]
    angle = pos * theta  # [n_pos, 1.., d_rope/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x0, x1 = x[..., 0::2].copy(), x[..., 1::2].copy()
    x[..., 0::2] = x0 * cos - x1 * sin
    x[..., 1::2] = x0 * sin + x1 * cos
    return x


def rope_interleaved_float32(x, positions, base=10000.0):
    """Same-precision baseline of ``rope_interleaved_ref`` (angles in float32)."""
    f = np.float32
    x = np.array(x, dtype=f)
    d_rope = x.shape[-1]
    if d_rope == 0:
        return x
    pos = np.asarray(positions, dtype=f).reshape((-1,) + (1,) * (x.ndim - 1))
    theta = f(base) ** (-np.arange(0, d_rope, 2, dtype=f) / f(d_rope))
    angle = pos * theta
    cos, sin = np.cos(angle), np.sin(angle)
    x0, x1 = x[..., 0::2].copy(), x[..., 1::2].copy()
    x[..., 0::2] = x0 * cos - x1 * sin
    x[..., 1::2] = x0 * sin + x1 * cos
    return x


def paged_rows_ref(cache, page_table_row, length):
    """Rows 0..length-1 of one sequence of a paged latent cache, gathered by
    plain indexing: position p is row p % P of page page_table_row[p // P].

    cache: [num_pages, P, r + d_rope]; page_table_row: [max_pages] ints.
    Returns [length, r + d_rope] in the cache's dtype (only used entries read).
    """
    cache = np.asarray(cache)
    page_size = cache.shape[1]
    rows = np.empty((int(length), cache.shape[2]), cache.dtype)
    for p in range(int(length)):
        rows[p] = cache[int(page_table_row[p // page_size]), p % page_size]
    return rows


def mla_decode_paged_ref(q_nope, q_pe, cache, page_table, lengths, w_uk, w_uv, scale=None,
                         return_lse=False):
    """Batched decode over a paged latent cache (float64): each sequence's rows
    gathered (``paged_rows_ref``), then ``mla_attend_absorbed`` of its one query.

    q_nope [B, nh, d_nope], q_pe [B, nh, d_rope], cache [num_pages, P, r +
    d_rope], page_table [B, max_pages], lengths [B] (0: zeros, LSE -inf),
    w_uk [nh, d_nope, r], w_uv [nh, d_v, r].
    Returns out [B, nh, d_v] (and lse [B, nh] with ``return_lse``).
    Multi-token queries [B, s_q, nh, .]: ``mla_decode_ref`` with the table.
    """
    q_nope, q_pe = np.asarray(q_nope), np.asarray(q_pe)
    if q_nope.ndim == 4:
        return mla_decode_ref(q_nope, q_pe, cache, lengths, w_uk, w_uv, scale=scale,
                              page_table=page_table, return_lse=return_lse)
    n_b, nh, _ = q_nope.shape
    rank = np.asarray(w_uk).shape[2]
    out = np.zeros((n_b, nh, np.asarray(w_uv).shape[1]))
    lse = np.full((n_b, nh), -np.inf)
    for b in range(n_b):
        n = int(lengths[b])
        if n == 0:
            continue  # nothing visible: zeros, LSE -inf
        rows = paged_rows_ref(cache, np.asarray(page_table)[b], n).astype(np.float64)
        o, l_ = mla_attend_absorbed(q_nope[b:b + 1], q_pe[b:b + 1], rows[:, :rank],
                                    rows[:, rank:], w_uk, w_uv, scale=scale, return_lse=True)
        out[b], lse[b] = o[0], l_[0]
    return (out, lse) if return_lse else out


def mla_decode_ref(q_nope, q_pe, latent, lengths, w_uk, w_uv, scale=None, page_table=None,
                   form="absorbed", return_lse=False):
    """Batched (multi-token) decode (float64): sequence b's ``s_q`` new queries
    are its last ``s_q`` positions, so query i attends positions ``0 ..
    lengths[b] - s_q + i``; each sequence is ``mla_attend_absorbed`` (``form``
    "absorbed") or ``mla_attend_naive`` ("naive") of its queries over its rows.

    q_nope [B, s_q, nh, d_nope] (or [B, nh, d_nope]: s_q = 1), q_pe [B, s_q,
    nh, d_rope] (or [B, nh, d_rope]); latent: the contiguous cache [B,
    max_seq, r + d_rope], or with ``page_table`` [B, max_pages] the paged
    cache [num_pages, P, r + d_rope] (rows gathered by ``paged_rows_ref``);
    lengths [B]: 0 (zeros, LSE -inf) or at least s_q (else ValueError);
    w_uk [nh, d_nope, r], w_uv [nh, d_v, r].
    Returns out [B, s_q, nh, d_v] (or [B, nh, d_v] for rank-3 queries), and
    lse [B, s_q, nh] (or [B, nh]) with ``return_lse``.
    """
    if form not in ("absorbed", "naive"):
        raise ValueError(f"form: expected 'absorbed' or 'naive', got {form!r}")
    attend = mla_attend_absorbed if form == "absorbed" else mla_attend_naive
    q_nope, q_pe = np.asarray(q_nope), np.asarray(q_pe)
    single = q_nope.ndim == 3
    if single:
        q_nope, q_pe = q_nope[:, None], q_pe[:, None]
    n_b, s_q, nh, _ = q_nope.shape
    rank = np.asarray(w_uk).shape[2]
    out = np.zeros((n_b, s_q, nh, np.asarray(w_uv).shape[1]))
    lse = np.full((n_b, s_q, nh), -np.inf)
    for b in range(n_b):
        n = int(lengths[b])
        if n == 0:
            continue  # nothing visible: zeros, LSE -inf
        if n < s_q:
            raise ValueError(f"lengths[{b}]={n}: the s_q={s_q} new queries must be the last "
                             f"of the sequence's positions")
        if page_table is None:
            rows = np.asarray(latent)[b, :n].astype(np.float64)
        else:
            rows = paged_rows_ref(latent, np.asarray(page_table)[b], n).astype(np.float64)
        out[b], lse[b] = attend(q_nope[b], q_pe[b], rows[:, :rank], rows[:, rank:], w_uk,
                                w_uv, scale=scale, return_lse=True)
    if single:
        out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


def latent_rows_ref(c_kv, k_pe):
    """Host layout of the latent cache rows: ``[c_kv | k_pe]`` per token, [t, r + d_rope]."""
    return np.concatenate([np.asarray(c_kv), np.asarray(k_pe)], axis=1)


def w_uk_checkpoint_ref(w_uk):
    """``attn_k_b`` checkpoint layout ``[nh, r, d_nope]`` of ``w_uk [nh, d_nope, r]``,
    by explicit loops (element (h, l, p) = w_uk[h, p, l])."""
    w_uk = np.asarray(w_uk)
    nh, d_nope, r = w_uk.shape
    out = np.empty((nh, r, d_nope), dtype=w_uk.dtype)
    for h in range(nh):
        for l in range(r):
            for p in range(d_nope):
                out[h, l, p] = w_uk[h, p, l]
    return out


def tolerance(baseline_err, magnitude, k):
    """Allowed kernel error: ``2 * baseline_err + floor``.

    baseline_err: max |float32 baseline - float64 oracle| on the same inputs
    (``mla_attend_float32``: what plain float32 arithmetic costs here).
    floor: ``sqrt(k) * eps32 * max(1, magnitude)``, the expected (random-walk)
    rounding error of one sequential fp32 running sum of ``k`` O(magnitude)
    terms. The kernels accumulate one term at a time (``k`` = the longest such
    sum, the latent width or d_nope) while numpy's float32 baseline uses
    pairwise/BLAS sums whose error grows more slowly, so on small outputs the
    baseline alone can under-state what a correct fp32 kernel must be allowed.
    """
    return 2.0 * baseline_err + np.sqrt(k) * F32_EPS * max(1.0, magnitude)
