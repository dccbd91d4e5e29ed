"""The sweep's float32 baselines: the oracle's arithmetic in each standard score order.

A kernel is held to twice the error of plain float32 arithmetic
(``validation.tolerance``). At well-conditioned scores every plain float32
computation has about the same error. At a near tie of large scores (the
``large`` fixture: |score| up to 1e4, where one float32 ulp is ~1e-3) it does
not: which way each score rounds moves the output by a fixed step, and that
depends on how the score was summed. One baseline is then one draw from a few
discrete error levels, and a correct kernel that sums in another standard order
fails by chance (validation/NOTES.md, near ties: every failure of run 20 is
reproduced to the last digit by one of the orders below).

So the sweep compares with each of the standard ways to compute a score in
float32, and takes the largest error among them:

* how the q.k products are summed (``SUMS``): ``matmul`` (the oracle's own
  ``@``/``einsum``, i.e. BLAS's blocked order), ``pairwise`` (``np.sum``: numpy's
  pairwise summation) or ``running`` (``np.cumsum``: one running sum, the plain
  loop over the head dimension);
* where the softmax scale is applied (``SCALES``): to the scores ``after`` the
  dot product (the oracle's choice), or ``before``, folded into q in float32
  (what a flash-attention kernel does to save a multiply per score).

Everything after the scores is the oracle's float32 code (``attention.oracle``'s
``softmax_attend_rows``; MLA's decompression through ``W_UV`` by ``einsum``). The
position sums (softmax denominator, P.V) are not varied: a kernel's long sums
are held to the numpy order (a plain running sum over positions would excuse the
error growth the growth runs look for). The growth runs keep the single
as-written baseline.

``variants(kind, inputs)`` returns ``{output: {label: array}}`` with labels
``"SUM/SCALE"``; ``"matmul/after"`` is exactly the oracle code run in float32
(``registry.references``' baseline).
"""

from __future__ import annotations

import numpy as np

from attention.oracle import (decode_attention_ref, kv_head_of, prefill_attention_ref,
                              softmax_attend, softmax_attend_rows)

F32 = np.float32
SUMS = ("matmul", "pairwise", "running")
SCALES = ("after", "before")
PLAIN = "matmul/after"
_CHUNK = 1 << 18  # float32 products formed at once by the pairwise sum (1 MiB)


def labels():
    """Every variant's label, the oracle's own order first."""
    return [f"{s}/{c}" for s in SUMS for c in SCALES]


def dot(a, b, how):
    """float32 sum over the last axis of ``a * b`` (broadcast), summed ``how``.

    a: [..., n], b: [..., n] (broadcastable), float32. Returns [...] float32.
    ``pairwise``: ``np.sum`` of the rounded products (numpy's pairwise sum),
    formed a chunk of leading rows at a time; ``running``: left to right, one
    rounding per product and per add (``np.cumsum``'s order, without its
    [..., n] intermediate).
    """
    shape = np.broadcast_shapes(a.shape, b.shape)
    if how == "running":  # the summed axis first, so each step's operands are contiguous
        a_t, b_t = (np.ascontiguousarray(np.moveaxis(x, -1, 0)) for x in (a, b))
        total = np.zeros(shape[:-1], F32)
        for i in range(shape[-1]):
            total += a_t[i % a_t.shape[0]] * b_t[i % b_t.shape[0]]
        return total
    a, b = np.broadcast_to(a, shape), np.broadcast_to(b, shape)
    if how != "pairwise":
        raise ValueError(f"dot: how must be 'pairwise' or 'running', got {how!r}")
    if len(shape) > 1 and int(np.prod(shape)) > _CHUNK:
        inner = int(np.prod(shape[1:]))
        if inner > _CHUNK:
            return np.stack([dot(a[i], b[i], how) for i in range(shape[0])])
        step = _CHUNK // inner
        return np.concatenate([dot(a[i:i + step], b[i:i + step], how)
                               for i in range(0, shape[0], step)])
    return np.ascontiguousarray(a * b, dtype=F32).sum(axis=-1, dtype=F32)


def _fold(q, scale):
    """q with the softmax scale folded in, in float32: (q * scale) rounded, scale 1."""
    return np.asarray(q, F32) * F32(scale), 1.0


def decode_variant(q, k_cache, v_cache, seq_lens, slot_table, how, where):
    """``attention.oracle.decode_attention_ref`` in float32, scores summed ``how``
    (``SUMS``), the scale applied ``where`` (``SCALES``). Shapes as the oracle's
    batched form: q [M, H, D], caches [KV_SLOTS, H_kv, max_seq, D], seq_lens [M],
    slot_table [M]; returns (out [M, H, D], lse [M, H]) float32."""
    q = np.asarray(q, F32)
    scale = 1.0 / np.sqrt(q.shape[-1])
    if where == "before":
        q, scale = _fold(q, scale)
    if how == "matmul":
        return decode_attention_ref(q, k_cache, v_cache, seq_lens, slot_table, scale=scale,
                                    dtype=F32)
    k_cache, v_cache = np.asarray(k_cache, F32), np.asarray(v_cache, F32)
    m_count, n_heads, _ = q.shape
    out = np.zeros((m_count, n_heads, v_cache.shape[-1]), F32)
    lse = np.full((m_count, n_heads), -np.inf, F32)
    for m in range(m_count):
        slot, length = int(slot_table[m]), int(seq_lens[m])
        for h in range(n_heads):
            g = kv_head_of(h, n_heads, k_cache.shape[1])
            scores = dot(k_cache[slot, g, :length], q[m, h], how) * F32(scale)  # [L]
            out[m, h], lse[m, h] = softmax_attend(scores, v_cache[slot, g, :length])
    return out, lse


def prefill_variant(q, k, v, n_heads, n_kv_heads, causal, how, where):
    """``attention.oracle.prefill_attention_ref`` in float32, scores summed ``how``,
    the scale applied ``where``. q [T, H*D], k and v [T, H_kv*D]; returns
    (out [T, H*D], lse [H, T]) float32."""
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
        scores = dot(q[:, None, cols(h)], k[None, :, cols(g)], how) * F32(scale)  # [T, T]
        if causal:
            scores[np.arange(t_len)[None, :] > np.arange(t_len)[:, None]] = -np.inf
        if t_len:
            out[:, cols(h)], lse[h] = softmax_attend_rows(scores, v[:, cols(g)])
    return out, lse


def mla_variant(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, how, where):
    """``mla.oracle.mla_attend_float32`` with q_lat and the scores summed ``how``
    and the scale applied ``where``. q_nope [t_q, nh, d_nope], q_pe [t_q, nh, d_rope],
    c_kv [t_kv, r], k_pe [t_kv, d_rope], w_uk [nh, d_nope, r], w_uv [nh, d_v, r];
    returns out [t_q, nh, d_v] float32."""
    from mla.oracle import default_scale, mla_attend_float32, visible_positions

    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (np.asarray(a, F32) for a in
                                            (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    t_q, n_head, d_nope = q_nope.shape
    scale = default_scale(d_nope, q_pe.shape[2])
    if where == "before":
        (q_nope, scale), (q_pe, _) = _fold(q_nope, scale), _fold(q_pe, scale)
    if how == "matmul":
        return mla_attend_float32(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=scale)
    t_kv = c_kv.shape[0]
    # q_lat[t, h, l] = sum_p w_uk[h, p, l] q_nope[t, h, p]: the sum over p last
    q_lat = dot(np.swapaxes(w_uk, 1, 2)[None], q_nope[:, :, None, :], how)  # [t_q, nh, r]
    lat = np.concatenate([q_lat, q_pe], axis=-1)  # [t_q, nh, r + d_rope]
    rows = np.concatenate([c_kv, k_pe], axis=-1)  # [t_kv, r + d_rope]
    out = np.zeros((t_q, n_head, w_uv.shape[1]), F32)
    for i in range(t_q):
        vis = visible_positions(t_q, t_kv, i)
        if vis == 0:
            continue
        scores = dot(rows[None, :vis], lat[i][:, None, :], how) * F32(scale)  # [nh, vis]
        o_lat, _ = softmax_attend_rows(scores, c_kv[:vis])  # [nh, r]
        out[i] = np.einsum("hjl,hl->hj", w_uv, o_lat)  # [nh, d_v]
    return out


def variants(kind, inputs, plain=None):
    """{output name: {label: float32 array}} for a sweep case's inputs (the
    registry's input dict of ``kind`` decode | prefill | mla). ``plain``: the
    oracle's float32 outputs when already computed (``registry.references``'
    baseline, {output name: array}), taken as the ``PLAIN`` variant."""
    if kind not in ("decode", "prefill", "mla"):
        raise ValueError(f"variants: kind must be decode, prefill or mla, got {kind!r}")
    got = {}
    for label in labels():
        how, where = label.split("/")
        if label == PLAIN and plain is not None:
            for name, arr in plain.items():
                got.setdefault(name, {})[label] = arr
            continue
        if kind == "decode":
            o, lse = decode_variant(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                    inputs["seq_lens"], inputs["slot_table"], how, where)
            res = {"out": o, "lse": lse}
        elif kind == "prefill":
            o, lse = prefill_variant(inputs["q"], inputs["k"], inputs["v"], inputs["n_heads"],
                                     inputs["n_kv_heads"], inputs["causal"], how, where)
            res = {"out": o, "lse": lse}
        else:
            from validation.registry import MLA_ARGS

            res = {"out": mla_variant(*(inputs[n] for n in MLA_ARGS), how, where)}
        for name, arr in res.items():
            got.setdefault(name, {})[label] = arr
    return got
