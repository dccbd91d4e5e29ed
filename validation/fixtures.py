"""Hostile, reproducible inputs for the validation sweep and the growth runs.

Every generator takes a ``numpy.random.Generator`` from ``case_rng``, which
derives it from the seed and the case's name only (not from the kernel, the
dtype, the shard or the order of the run): the same seed gives the same data
everywhere, and every kernel of a kind sees the same inputs.

What makes the data hostile (each is a way a kernel can be silently wrong):

* ``nan_fill``: cache slots no sequence uses, and every position at or
  beyond a sequence's length, hold NaN. A kernel that reads one stray element
  turns its output NaN, which the NaN/inf placement check reports.
* shuffled slot tables: sequence ``m`` lives in slot ``slot_table[m]``, a
  random permutation with spare slots, so a kernel that assumes ``slot == m``
  or a slot stride off by one reads NaN or another sequence's keys.
* ``scores="large"``: queries scaled so the largest ``|scale * q . k|`` of
  every (sequence, head) is ``LARGE_SCORE`` (1e4): an ``exp`` taken before the
  maximum is subtracted overflows to inf, and score rounding is at its worst.
* ``scores="equal"``: every key of a (slot, kv head) is the same row, so all
  scores of a query are exactly equal (uniform softmax; the output is the mean
  of the values): a tie-breaking or strict-inequality bug in the running max
  shows up here.
* ``scores="normal"``: standard normal data, the baseline case.
"""

from __future__ import annotations

import zlib

import numpy as np

LARGE_SCORE = 1.0e4
SCORE_FIXTURES = ("normal", "large", "equal")


def case_rng(seed, *tags):
    """A generator determined by ``seed`` and the text of ``tags`` (stable across runs
    and processes: the tags are hashed with CRC32, not Python's salted ``hash``)."""
    key = "/".join(str(t) for t in tags)
    return np.random.default_rng([int(seed), zlib.crc32(key.encode())])


def _rescale_to(scores, target):
    """Factor that makes ``max|scores|`` equal ``target`` (1 when all scores are 0)."""
    peak = float(np.abs(scores).max()) if scores.size else 0.0
    return target / peak if peak > 0 else 1.0


def decode_inputs(rng, *, m, h, h_kv, d, lens, max_seq, kv_slots, scores="normal",
                  nan_fill=True, shuffle=True):
    """Inputs of batched decode attention.

    Returns a dict: ``q [M, H, D]`` float32, ``k_cache``/``v_cache``
    ``[KV_SLOTS, H_kv, max_seq, D]`` float32 (NaN outside the live rows when
    ``nan_fill``), ``seq_lens [M]`` int32, ``slot_table [M]`` int32 (a random
    choice of distinct slots when ``shuffle``), ``scale`` (1/sqrt(D)).
    """
    if scores not in SCORE_FIXTURES:
        raise ValueError(f"scores: expected one of {SCORE_FIXTURES}, got {scores!r}")
    lens = np.asarray(lens, dtype=np.int32)
    assert lens.shape == (m,) and kv_slots >= m and (lens <= max_seq).all()
    slot_table = (rng.permutation(kv_slots)[:m] if shuffle else np.arange(m)).astype(np.int32)
    shape = (kv_slots, h_kv, max_seq, d)
    fill = np.nan if nan_fill else 0.0
    k_cache = np.full(shape, fill, dtype=np.float64)
    v_cache = np.full(shape, fill, dtype=np.float64)
    q = rng.standard_normal((m, h, d))
    for i in range(m):
        slot, length = int(slot_table[i]), int(lens[i])
        if scores == "equal":
            row = rng.standard_normal((h_kv, 1, d))
            k_cache[slot, :, :length] = np.broadcast_to(row, (h_kv, length, d))
        else:
            k_cache[slot, :, :length] = rng.standard_normal((h_kv, length, d))
        v_cache[slot, :, :length] = rng.standard_normal((h_kv, length, d))
    scale = 1.0 / np.sqrt(d)
    if scores == "large":
        for i in range(m):
            slot, length = int(slot_table[i]), int(lens[i])
            for head in range(h):
                g = head * h_kv // h
                s = k_cache[slot, g, :length] @ q[i, head] * scale
                q[i, head] *= _rescale_to(s, LARGE_SCORE)
    return {
        "q": q.astype(np.float32),
        "k_cache": k_cache.astype(np.float32),
        "v_cache": v_cache.astype(np.float32),
        "seq_lens": lens,
        "slot_table": slot_table,
        "scale": scale,
    }


HUGE_PAGE = 2 ** 30  # unused page-table entries: an index no cache has, never to be read


def paged_from_pooled(k_cache, v_cache, seq_lens, slot_table, page, layout, rng):
    """The rows of a pooled decode case as a paged cache (the same values:
    the oracle of the pooled case judges it).

    k_cache, v_cache [KV_SLOTS, H_kv, max_seq, D]; page >= 1; layout "HND"
    ([num_pages, H_kv, P, D]) or "NHD" ([num_pages, P, H_kv, D]). Each
    sequence gets ``ceil(len / P)`` pages drawn from a shuffled pool (the page
    order is asserted not to be the identity where there are two pages or
    more) with spare pages; rows past a length in its last page, and the spare
    pages, hold NaN; table entries past a sequence's pages hold ``HUGE_PAGE``.
    Returns (k_pages, v_pages, page_table [M, ceil(max_seq / P)] int32)."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    n_slots, h_kv, max_seq, d = k_cache.shape
    lens = [int(x) for x in np.asarray(seq_lens)]
    need = [-(-n // page) for n in lens]
    width = -(-max_seq // page)
    owned = sum(need) + 2  # two spare pages
    order = rng.permutation(owned)
    if owned > 1 and np.array_equal(order, np.arange(owned)):
        order = order[::-1].copy()
    table = np.full((len(lens), width), HUGE_PAGE, np.int32)
    shape = (owned, h_kv, page, d) if layout == "HND" else (owned, page, h_kv, d)
    # NaN where no row lives (uint8 caches hold fp8 e4m3 codes: 0x7F is NaN)
    fill = 0x7F if k_cache.dtype == np.uint8 else np.nan
    k_pages = np.full(shape, fill, k_cache.dtype)
    v_pages = np.full(shape, fill, v_cache.dtype)
    at = 0
    for m, n in enumerate(need):
        table[m, :n] = order[at:at + n]
        at += n
        slot = int(slot_table[m])
        for p in range(lens[m]):
            pg, off = table[m, p // page], p % page
            if layout == "HND":
                k_pages[pg, :, off], v_pages[pg, :, off] = k_cache[slot, :, p], v_cache[slot, :, p]
            else:
                k_pages[pg, off], v_pages[pg, off] = k_cache[slot, :, p], v_cache[slot, :, p]
    return k_pages, v_pages, table


def multi_token_case(q, seq_lens, capacity, t_q):
    """A one-query decode case as a multi-token one whose outputs the case's
    oracle judges, every query position exercised across the batch.

    q [M, H, D], seq_lens [M], capacity (the cache's positions, >= t_q).
    Sequence m's judged query is ``pick[m]`` (``m % t_q`` where its length
    allows, else the nearest index that does); its length is raised by
    ``t_q - 1 - pick[m]`` so that that query sees exactly the case's
    ``seq_lens[m]`` positions (the later queries see the rows past it, which
    the case leaves hostile; their outputs are not judged). Every query of a
    sequence is its q. A length of 0 stays 0 (an empty sequence: every
    query's output is zeros). Returns (q_multi [M, t_q, H, D], lengths [M]
    int32, pick [M] int): the judged outputs are ``out[arange(M), pick]``."""
    q = np.asarray(q)
    lens = [int(n) for n in np.asarray(seq_lens).reshape(-1)]
    if capacity < t_q:
        raise ValueError(f"capacity: expected at least t_q={t_q} positions, got {capacity}")
    pick = np.zeros(len(lens), np.int64)
    new = np.zeros(len(lens), np.int32)
    for m, n in enumerate(lens):
        if n == 0:
            pick[m] = m % t_q
            continue
        i = min(m % t_q, n - 1)  # the raised length must hold the t_q new tokens
        i = max(i, t_q - 1 - (capacity - n))  # and stay within the cache
        pick[m], new[m] = i, n + t_q - 1 - i
    q_multi = np.ascontiguousarray(np.repeat(q[:, None], t_q, axis=1))
    return q_multi, new, pick


def prefill_inputs(rng, *, t, h, h_kv, d, causal, scores="normal"):
    """Inputs of prefill attention: ``q [T, H*D]``, ``k``/``v [T, H_kv*D]`` float32
    (interleaved rows), ``n_heads``, ``n_kv_heads``, ``causal``, ``scale``."""
    if scores not in SCORE_FIXTURES:
        raise ValueError(f"scores: expected one of {SCORE_FIXTURES}, got {scores!r}")
    q = rng.standard_normal((t, h, d))
    if scores == "equal":
        k = np.broadcast_to(rng.standard_normal((1, h_kv, d)), (t, h_kv, d)).copy()
    else:
        k = rng.standard_normal((t, h_kv, d))
    v = rng.standard_normal((t, h_kv, d))
    scale = 1.0 / np.sqrt(d)
    if scores == "large" and t:
        for head in range(h):
            g = head * h_kv // h
            s = q[:, head] @ k[:, g].T * scale  # [T, T]
            q[:, head] *= _rescale_to(s, LARGE_SCORE)
    return {
        "q": q.reshape(t, h * d).astype(np.float32),
        "k": k.reshape(t, h_kv * d).astype(np.float32),
        "v": v.reshape(t, h_kv * d).astype(np.float32),
        "n_heads": h,
        "n_kv_heads": h_kv,
        "causal": causal,
        "scale": scale,
    }


def mla_inputs(rng, dims, *, t_q, t_kv, scores="normal"):
    """Inputs of MLA attention (``mla.oracle`` layouts), float32.

    ``q_nope [t_q, nh, d_nope]``, ``q_pe [t_q, nh, d_rope]``, ``c_kv [t_kv, r]``,
    ``k_pe [t_kv, d_rope]``, ``w_uk [nh, d_nope, r]``, ``w_uv [nh, d_v, r]``,
    ``scale`` (1/sqrt(d_nope + d_rope)). Weights are scaled by 1/sqrt(fan-in)
    so scores are O(1) before the fixture rescales them.
    """
    if scores not in SCORE_FIXTURES:
        raise ValueError(f"scores: expected one of {SCORE_FIXTURES}, got {scores!r}")
    nh, d_nope, d_rope, d_v, r = dims.n_head, dims.d_nope, dims.d_rope, dims.d_v, dims.kv_rank
    q_nope = rng.standard_normal((t_q, nh, d_nope))
    q_pe = rng.standard_normal((t_q, nh, d_rope))
    if scores == "equal":
        c_kv = np.broadcast_to(rng.standard_normal((1, r)), (t_kv, r)).copy()
        k_pe = np.broadcast_to(rng.standard_normal((1, d_rope)), (t_kv, d_rope)).copy()
    else:
        c_kv = rng.standard_normal((t_kv, r))
        k_pe = rng.standard_normal((t_kv, d_rope))
    w_uk = rng.standard_normal((nh, d_nope, r)) / np.sqrt(r)
    w_uv = rng.standard_normal((nh, d_v, r)) / np.sqrt(r)
    scale = 1.0 / np.sqrt(d_nope + d_rope)
    if scores == "large" and t_q and t_kv:
        for head in range(nh):
            q_lat = q_nope[:, head] @ w_uk[head]  # [t_q, r]
            s = (q_lat @ c_kv.T + q_pe[:, head] @ k_pe.T) * scale  # [t_q, t_kv]
            f = _rescale_to(s, LARGE_SCORE)
            q_nope[:, head] *= f
            q_pe[:, head] *= f
    f32 = np.float32
    return {
        "q_nope": q_nope.astype(f32), "q_pe": q_pe.astype(f32),
        "c_kv": c_kv.astype(f32), "k_pe": k_pe.astype(f32),
        "w_uk": w_uk.astype(f32), "w_uv": w_uv.astype(f32),
        "scale": scale,
    }


def cast(x, dtype):
    """``x`` stored in ``dtype`` (numpy dtype or name; "bfloat16" via ml_dtypes).
    Values beyond the dtype's range become inf, as a store would make them."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(resolve_dtype(dtype))


def resolve_dtype(name):
    """numpy dtype for a name: float32, float16 or bfloat16 (ml_dtypes)."""
    if isinstance(name, str) and name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


FP8_MODES = ("tensor", "token_head")  # the fp8 cache's scale modes (attention.cache.fp8)


def tensor_scale(values):
    """A per-tensor fp8 scale for float32 ``values``: their max |x| / 448 as
    float32, 1 where there are none or all are zero."""
    from attention.cache.fp8 import E4M3_MAX

    peak = float(np.abs(values).max()) if np.size(values) else 0.0
    return np.float32(peak / E4M3_MAX) if peak > 0 else np.float32(1.0)


def fp8_quantize(inputs, mode):
    """A decode case (``decode_inputs``) with its caches quantized to fp8 e4m3
    by the reference encoder (``attention.cache.fp8``), scales per tensor
    (``mode`` "tensor": amax over the live values / 448, 1 where there are
    none) or per (token, kv head) ("token_head": ``fp8.row_scales`` of each
    row, NaN where no row lives).

    Returns a new dict: ``k_codes`` / ``v_codes`` uint8 [KV_SLOTS, H_kv,
    max_seq, D] (0x7F, e4m3's NaN, where the case has NaN: unused rows),
    ``k_scale`` / ``v_scale`` float32 [1] or [KV_SLOTS, H_kv, max_seq],
    ``fp8_scales`` (the mode), and ``k_cache`` / ``v_cache`` replaced by the
    DEQUANTIZED values ``decode(code) * scale`` in float64 (exact; NaN where
    the case has NaN): what the oracle and the baseline take, so the kernel
    is judged on the values it was given. ``k_source`` / ``v_source``: the
    unquantized float32 caches (the quantization error's reference)."""
    from attention.cache import fp8

    if "c_kv" in inputs:  # an MLA case
        return mla_fp8_quantize(inputs, mode)
    if mode not in FP8_MODES:
        raise ValueError(f"mode: expected one of {FP8_MODES}, got {mode!r}")
    out = dict(inputs)
    for name in ("k", "v"):
        x = np.asarray(inputs[f"{name}_cache"], np.float32)
        live = np.isfinite(x).all(axis=-1)
        if mode == "tensor":
            scale = tensor_scale(x[live])
            codes = fp8.quantize_rows(np.where(live[..., None], x, 0), scale)
            scales = np.array([scale], np.float32)
            row_scale = np.broadcast_to(np.float64(scale), live.shape)
        else:
            scales = fp8.row_scales(np.where(live[..., None], x, 0))
            codes = fp8.quantize_rows(np.where(live[..., None], x, 0), scales)
            scales = np.where(live, scales, np.float32(np.nan)).astype(np.float32)
            row_scale = scales.astype(np.float64)
        codes = np.where(live[..., None], codes, np.uint8(fp8.E4M3_NAN)).astype(np.uint8)
        with np.errstate(invalid="ignore"):
            deq = fp8.decode_e4m3(codes).astype(np.float64) * row_scale[..., None]
        out[f"{name}_codes"], out[f"{name}_scale"] = codes, scales
        out[f"{name}_cache"] = np.where(live[..., None], deq, np.nan)
        out[f"{name}_source"] = x
    out["fp8_scales"] = mode
    return out


MLA_FP8_MODES = ("tensor", "token")  # mla.fp8's scale modes


def mla_fp8_quantize(inputs, mode):
    """An MLA case (``mla_inputs``) with its c_kv quantized to fp8 e4m3 as the
    fp8 latent cache holds it (``mla.fp8``): scales per tensor (``mode``
    "tensor": amax / 448, 1 for an all-zero c_kv) or per token ("token": each
    row's amax / 448).

    Returns a new dict: ``latent_codes`` uint8 [t_kv, r] (the rows' c_kv
    codes; the run wrapper appends k_pe as float16 bytes), ``latent_scale``
    float32 [1] or [t_kv], ``fp8_scales`` (the mode), ``c_kv`` replaced by the
    DEQUANTIZED values ``e4m3(code) * scale`` in float64 (exact: what the
    oracle takes; the baseline rounds them as the kernel does,
    ``baselines.mla_rounded_p``) and ``c_kv_source`` the unquantized float32
    c_kv (the quantization error's reference)."""
    from attention.cache import fp8

    if mode not in MLA_FP8_MODES:
        raise ValueError(f"mode: expected one of {MLA_FP8_MODES}, got {mode!r}")
    x = np.asarray(inputs["c_kv"], np.float32)
    if mode == "tensor":
        scale = tensor_scale(x)
        codes = fp8.quantize_rows(x, scale)
        scales = np.array([scale], np.float32)
        row_scale = np.broadcast_to(np.float64(scale), x.shape[:-1])
    else:
        scales = fp8.row_scales(x)
        codes = fp8.quantize_rows(x, scales)
        row_scale = scales.astype(np.float64)
    out = dict(inputs)
    out["latent_codes"], out["latent_scale"], out["fp8_scales"] = codes, scales, mode
    out["c_kv"] = fp8.decode_e4m3(codes).astype(np.float64) * row_scale[..., None]
    out["c_kv_source"] = x
    return out


def paged_scales(scales, seq_lens, slot_table, page, layout, rng):
    """Per-(token, kv head) scales [KV_SLOTS, H_kv, max_seq] in the pages
    ``paged_from_pooled`` makes from the same ``rng`` state: HND [num_pages,
    H_kv, P], NHD [num_pages, P, H_kv] (NaN where no row lives)."""
    s = np.asarray(scales, np.float32)[..., None]
    pages, _, table = paged_from_pooled(s, s, seq_lens, slot_table, page, layout, rng)
    return np.ascontiguousarray(pages[..., 0]), table


# ---------------------------------------------------------------------------
# paged MLA latent caches (``mla.paged``): the tests' and suite_mla_paged's fixture
# ---------------------------------------------------------------------------

MLA_HUGE_ENTRY = 2 ** 31 - 1  # what an MLA page table holds past a sequence's pages


def mla_build_pages(rows, lengths, page_size, max_pages, rng, *, share_first=True, spare=2,
                    fill=np.nan):
    """Scatter ``rows[b, :lengths[b]]`` of each sequence into shuffled pages.

    rows [B, >= max length, W]. Every non-empty sequence other than the
    longest (the donor) takes the donor's first page as its own first page
    (its rows there must equal the donor's: ``mla_paged_case`` makes them so).
    Returns (pages [num_pages, P, W], table [B, max_pages] int32, used: the
    page ids in the order they were handed out). Unused rows ``fill`` (NaN;
    an fp8 cache's uint8 rows: 0xFF, NaN codes and a NaN k_pe), unused entries
    ``MLA_HUGE_ENTRY``, ``spare`` pages nobody uses.
    """
    from mla.paged import pages_needed

    n_b, _, width = rows.shape
    donor = int(np.argmax(lengths))
    need = [(b, j) for b in range(n_b) for j in range(pages_needed(lengths[b], page_size))
            if not (share_first and j == 0 and b != donor)]
    n_pages = len(need) + spare
    ids = rng.permutation(n_pages)
    while len(need) > 1 and (ids[:len(need)] == np.arange(len(need))).all():
        ids = rng.permutation(n_pages)
    pages = np.full((n_pages, page_size, width), fill, rows.dtype)
    table = np.full((n_b, max_pages), MLA_HUGE_ENTRY, np.int32)
    for (b, j), page in zip(need, ids):
        table[b, j] = page
        n = min(page_size, lengths[b] - j * page_size)
        pages[page, :n] = rows[b, j * page_size:j * page_size + n]
    if share_first:
        for b in range(n_b):
            if b != donor and lengths[b] > 0:
                table[b, 0] = table[donor, 0]
    return pages, table, ids[:len(need)]


def mla_paged_case(page_size, dtype=np.float32, *, dims, lengths=None, seed=0, s_q=None):
    """Queries, weights, a contiguous cache and the same rows paged.

    lengths default [0, 1, P, P + 1, 2P] (2P: the capacity of a 2-page table).
    ``s_q``: None, queries [B, nh, .]; else multi-token queries [B, s_q, nh, .].
    Returns a dict: q_nope, q_pe, w_uk, w_uv, lengths, cont [B, cap, W] (NaN
    past each length), pages, table, used (page ids in hand-out order), dims
    (``dims``: an ``mla.dims.MlaDims``).
    """
    from mla.paged import pages_needed

    rng = np.random.default_rng(seed)
    nh, r, p_ = dims.n_head, dims.kv_rank, dims.d_rope
    width = r + p_
    if lengths is None:
        lengths = [0, 1, page_size, page_size + 1, 2 * page_size]
    lengths = np.array(lengths, np.int64)
    max_pages = max(2, pages_needed(lengths.max(), page_size))
    cap = max_pages * page_size
    n_b = len(lengths)
    cont = rng.standard_normal((n_b, cap, width)).astype(dtype)
    donor = int(np.argmax(lengths))
    for b in range(n_b):  # the shared first page: the donor's rows
        n = min(page_size, lengths[b])
        cont[b, :n] = cont[donor, :n]
        cont[b, lengths[b]:] = np.nan
    pages, table, used = mla_build_pages(cont, lengths, page_size, max_pages, rng)
    ws = 1.0 / np.sqrt(r)
    f32 = np.float32
    rows = (n_b, nh) if s_q is None else (n_b, s_q, nh)
    return {"q_nope": rng.standard_normal(rows + (dims.d_nope,)).astype(f32),
            "q_pe": rng.standard_normal(rows + (p_,)).astype(f32),
            "w_uk": (rng.standard_normal((nh, dims.d_nope, r)) * ws).astype(f32),
            "w_uv": (rng.standard_normal((nh, dims.d_v, r)) * ws).astype(f32),
            "lengths": lengths, "cont": cont, "pages": pages, "table": table, "used": used,
            "dims": dims}


def mla_paged_hostile(c):
    """None when ``mla_paged_case`` dict ``c`` is the hostile fixture it should be
    (pages shuffled, a shared prefix page, huge unused entries, NaN rows), else
    what is missing."""
    used = np.asarray(c["used"])
    if np.array_equal(used, np.arange(len(used))):
        return "the page table is the identity"
    first = [c["table"][b, 0] for b in range(len(c["lengths"])) if c["lengths"][b] > 0]
    if len(first) < 2 or len(set(first)) != 1:
        return "no shared prefix page"
    if not (c["table"] == MLA_HUGE_ENTRY).any() or not np.isnan(c["pages"]).any():
        return "no huge unused entry or no NaN row"
    return None


def mla_append_case(dtype, seed=9):
    """Four sequences, pages of 3: appends that start a page, fill one, cross
    into the next, and 1..T rows a sequence; sequences 2 and 3 share their
    first page (a full prefix nobody writes). The cache is random bytes (NaN
    and inf patterns included): every byte outside the new rows must stay.
    Returns (cache [10, 3, 16], new_rows [4, 3, 16], table [4, 3] int32,
    lengths [4], n_new [4], want: the cache after a correct append)."""
    from mla.paged import pages_needed

    rng = np.random.default_rng(seed)
    page_size, width, t_new = 3, 16, 3
    lengths = np.array([0, 2, 3, 5])
    n_new = np.array([3, 1, 2, 3])
    table = np.full((4, 3), MLA_HUGE_ENTRY, np.int32)
    ids = iter(rng.permutation(9))
    for b in range(4):
        for j in range(pages_needed(lengths[b] + n_new[b], page_size)):
            table[b, j] = next(ids)
    table[3, 0] = table[2, 0]
    cache = np.frombuffer(rng.bytes(10 * page_size * width * np.dtype(dtype).itemsize),
                          dtype).reshape(10, page_size, width).copy()
    new_rows = rng.standard_normal((4, t_new, width)).astype(dtype)
    want = cache.copy()
    for b in range(4):
        for i in range(n_new[b]):
            p = lengths[b] + i
            want[table[b, p // page_size], p % page_size] = new_rows[b, i]
    return cache, new_rows, table, lengths, n_new, want
