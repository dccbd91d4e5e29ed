"""Float64 CPU references for attention. The only place references live.

Written plainly (one full softmax, no online rescaling, explicit GQA map) so
they cannot share a defect with the kernels they judge. ``dtype`` (default
float64) selects the arithmetic: the same code run in float32 is the
same-precision *baseline* whose error against the float64 oracle sets the
tolerance a kernel is held to (``validation/tolerance.py``). Every function returns
``(out, lse)``: the attention output and the natural-log log-sum-exp of the
scaled scores (``-inf`` where a query attends to nothing, with the output
zeros there).

GQA: query head ``h`` reads kv head ``h * H_kv // H`` (consecutive query heads
share a kv head).
"""

from __future__ import annotations

import numpy as np


ROW_BLOCK = 256  # prefill oracle: query rows scored at once


def kv_head_of(head, n_heads, n_kv_heads):
    """The kv head a query head reads under GQA."""
    return head * n_kv_heads // n_heads


def softmax_attend_rows(scores, values):
    """Attention of R query rows over the same S keys.

    scores: [R, S] (already scaled; -inf marks a key a row may not see),
    values: [S, Dv], both of the working dtype. Every row must see a key.
    Returns (out [R, Dv], lse [R]).
    """
    m = scores.max(axis=1, keepdims=True)  # pass 1: row max            [R, 1]
    e = np.exp(scores - m)  # pass 2: exponentials (masked -> 0)        [R, S]
    denom = e.sum(axis=1)  # their sum                                  [R]
    out = (e @ values) / denom[:, None]  # pass 3: weighted values        [R, Dv]
    return out, m[:, 0] + np.log(denom)


def softmax_attend(scores, values):
    """Attention of one query row.

    scores: [S] (already scaled), values: [S, Dv], both of the working dtype.
    Returns (out [Dv], lse scalar); S == 0 gives zeros and -inf.
    """
    if scores.shape[0] == 0:
        return np.zeros(values.shape[1], values.dtype), -np.inf
    out, lse = softmax_attend_rows(scores[None, :], values)
    return out[0], lse[0]


def decode_attention_ref(q, k_cache, v_cache, seq_lens, slot_table=None, scale=None,
                         dtype=np.float64):
    """Decode attention: one query per sequence over its cached positions.

    q:        [M, H, D]                  (or [H, D] for one sequence)
    k_cache:  [KV_SLOTS, H_kv, max_seq, D] (or [H_kv, max_seq, D])
    v_cache:  same shape as k_cache
    seq_lens: [M] ints (or one int): positions 0..len-1 of the slot are read
    slot_table: [M] ints, the cache slot of sequence m (default arange(M))
    scale:    default 1/sqrt(D)
    dtype:    arithmetic (float64 oracle; float32 for the baseline)
    Returns (out [M, H, D], lse [M, H]) in ``dtype`` (unbatched shapes if q was [H, D]).
    """
    dtype = np.dtype(dtype).type
    q = np.asarray(q, dtype=dtype)
    k_cache = np.asarray(k_cache, dtype=dtype)
    v_cache = np.asarray(v_cache, dtype=dtype)
    single = q.ndim == 2
    if single:
        q, k_cache, v_cache = q[None], k_cache[None], v_cache[None]
        seq_lens = [int(np.asarray(seq_lens).reshape(-1)[0])]
    m_count, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    if slot_table is None:
        slot_table = np.arange(m_count)
    scale = dtype(1.0 / np.sqrt(head_dim) if scale is None else scale)
    out = np.zeros((m_count, n_heads, v_cache.shape[-1]), dtype)
    lse = np.full((m_count, n_heads), -np.inf, dtype)
    for m in range(m_count):
        slot, length = int(slot_table[m]), int(seq_lens[m])
        for h in range(n_heads):
            g = kv_head_of(h, n_heads, n_kv)
            keys = k_cache[slot, g, :length]  # [L, D]
            vals = v_cache[slot, g, :length]  # [L, D]
            scores = (keys @ q[m, h]) * scale  # [L]
            out[m, h], lse[m, h] = softmax_attend(scores, vals)
    if single:
        return out[0], lse[0]
    return out, lse


def decode_attention_multi_ref(q, k_cache, v_cache, seq_lens, slot_table=None, scale=None,
                               dtype=np.float64):
    """Multi-token decode: T new queries a sequence, causal among themselves.

    q:        [M, T, H, D]
    k_cache, v_cache, slot_table, scale, dtype: as ``decode_attention_ref``
    seq_lens: [M] ints, each 0 or >= T: the length counts the T new tokens;
              query i of sequence m attends positions 0 .. seq_lens[m] - T + i
              (0: an empty sequence, every query gets zeros and LSE -inf)
    Returns (out [M, T, H, D], lse [M, T, H]) in ``dtype``: query i is
    ``decode_attention_ref`` of sequence m over its first
    ``seq_lens[m] - T + 1 + i`` positions.
    """
    q = np.asarray(q)
    m_count, t_q = q.shape[0], q.shape[1]
    lens = [int(x) for x in np.asarray(seq_lens).reshape(-1)]
    slots = np.arange(m_count) if slot_table is None else np.asarray(slot_table)
    outs, lses = [], []
    for i in range(t_q):
        seen = [0 if n == 0 else n - t_q + 1 + i for n in lens]
        if min(seen) < 0:
            raise ValueError(f"seq_lens: expected 0 or at least T={t_q}, got {lens}")
        o, s = decode_attention_ref(q[:, i], k_cache, v_cache, seen, slots, scale=scale,
                                    dtype=dtype)
        outs.append(o)
        lses.append(s)
    return np.stack(outs, axis=1), np.stack(lses, axis=1)


def paged_rows(pages, page_table, m, length, layout="HND"):
    """Rows 0..length-1 of sequence ``m`` of a paged cache, gathered in order:
    [H_kv, length, D]. pages: [num_pages, H_kv, P, D] ("HND") or [num_pages, P,
    H_kv, D] ("NHD"); page_table [M, max_pages]: position p is row p % P of
    page ``page_table[m, p // P]``. Only the entries of the first
    ceil(length / P) pages are read."""
    pages = np.asarray(pages)
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout: expected 'HND' or 'NHD', got {layout!r}")
    size = pages.shape[2] if layout == "HND" else pages.shape[1]
    rows = []
    for p in range(int(length)):
        page = int(page_table[m][p // size])
        rows.append(pages[page, :, p % size] if layout == "HND" else pages[page, p % size])
    if not rows:
        n_kv = pages.shape[1] if layout == "HND" else pages.shape[2]
        return np.zeros((n_kv, 0, pages.shape[3]), pages.dtype)
    return np.stack(rows, axis=1)


def decode_attention_paged_ref(q, k_pages, v_pages, page_table, seq_lens, layout="HND",
                               scale=None, dtype=np.float64):
    """``decode_attention_ref`` over a paged cache: each sequence's rows are
    gathered through its page table (``paged_rows``) into a cache of one slot a
    sequence, then attended as the pooled oracle does. q [M, H, D]; returns
    (out [M, H, D], lse [M, H]) in ``dtype``."""
    q = np.asarray(q)
    m_count = q.shape[0]
    lens = [int(x) for x in np.asarray(seq_lens).reshape(-1)]
    longest = max(lens + [1])
    n_kv = k_pages.shape[1] if layout == "HND" else k_pages.shape[2]
    shape = (m_count, n_kv, longest, q.shape[2])
    k = np.zeros(shape, dtype)
    v = np.zeros(shape, dtype)
    for m, length in enumerate(lens):
        k[m, :, :length] = paged_rows(k_pages, page_table, m, length, layout)
        v[m, :, :length] = paged_rows(v_pages, page_table, m, length, layout)
    return decode_attention_ref(q, k, v, lens, None, scale=scale, dtype=dtype)


def prefill_attention_ref(q, k, v, n_heads, n_kv_heads=None, causal=False, scale=None,
                          dtype=np.float64):
    """Multi-head prefill attention over T tokens, interleaved rows.

    q: [T, H*D], k and v: [T, H_kv*D]; query t attends to keys 0..t when causal,
    to all T keys otherwise. ``dtype``: arithmetic (float64 oracle, float32 baseline).
    Returns (out [T, H*D], lse [H, T]) in ``dtype``.
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    dtype = np.dtype(dtype).type
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(k, dtype=dtype)
    v = np.asarray(v, dtype=dtype)
    t_len = q.shape[0]
    head_dim = q.shape[1] // n_heads if n_heads else 0
    scale = dtype(1.0 / np.sqrt(head_dim) if scale is None else scale)
    out = np.zeros((t_len, n_heads * head_dim), dtype)
    lse = np.full((n_heads, t_len), -np.inf, dtype)
    for h in range(n_heads):
        g = kv_head_of(h, n_heads, n_kv_heads)
        qh = q[:, h * head_dim:(h + 1) * head_dim]  # [T, D]
        kh = k[:, g * head_dim:(g + 1) * head_dim]  # [T, D]
        vh = v[:, g * head_dim:(g + 1) * head_dim]  # [T, D]
        for lo in range(0, t_len, ROW_BLOCK):  # row blocks bound the [rows, T] scores
            rows = np.arange(lo, min(lo + ROW_BLOCK, t_len))
            scores = (qh[rows] @ kh.T) * scale  # [rows, T]
            if causal:  # query t sees keys 0..t
                scores[np.arange(t_len)[None, :] > rows[:, None]] = -np.inf
            o, lse[h, rows] = softmax_attend_rows(scores, vh)
            out[rows, h * head_dim:(h + 1) * head_dim] = o
    return out, lse
